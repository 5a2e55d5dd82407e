//! inventory against the real PostgreSQL: the adjustment contract, and
//! reservations that never oversell.

mod api;
mod appliers;
mod stock;

use inventory::{SERVICE, Settings};
use reliability::service::{self, CommonSettings, Role, ShutdownToken};
use reliability::testing::{ApiClient, TestDb, unique};

pub struct TestApp {
    pub api: ApiClient,
    pub db: TestDb,
    stop: ShutdownToken,
}

impl TestApp {
    pub async fn spawn() -> Self {
        let db = TestDb::with_migrations(&inventory::MIGRATIONS).await;
        let mut common = CommonSettings::local();
        common.exchange = unique("reltest.inventory.");
        let jwt = common.jwt_keys();
        let settings = Settings {
            role: Role::Serve,
            ..Settings::local(common)
        };
        let stop = ShutdownToken::new();
        let app = service::start(&SERVICE, settings, db.databases(), stop.clone())
            .await
            .unwrap();
        let api = ApiClient::new(app.port(), jwt);
        tokio::spawn(app.run_until_stopped());
        Self { api, db, stop }
    }

    pub async fn adjust(
        &self,
        tenant: i64,
        key: &str,
        sku: &str,
        delta: i64,
    ) -> reliability::testing::Answer {
        let body = serde_json::json!({"sku": sku, "delta": delta, "reason": "test"}).to_string();
        self.api
            .post(tenant, "/stock/adjustments", key, &body)
            .await
    }

    pub async fn stop(self) {
        self.stop.cancel();
        self.db.cleanup().await;
    }
}
