//! inventory against the real PostgreSQL: the adjustment contract, and
//! reservations that never oversell.

mod api;
mod appliers;
mod stock;

use inventory::{SERVICE, Settings};
use service_kit::service::{Role, ShutdownToken};
use testkit::{ApiClient, TestDb, unique};

pub struct TestApp {
    pub api: ApiClient,
    pub db: TestDb,
    stop: ShutdownToken,
}

impl TestApp {
    pub async fn spawn() -> Self {
        let db = TestDb::with_migrations(&inventory::MIGRATIONS).await;
        let mut common = testkit::common_settings();
        common.exchange = unique("reltest.inventory.");
        let settings = Settings {
            role: Role::Serve,
            ..Settings::local(common)
        };
        let app = testkit::serve(&SERVICE, settings, db.databases()).await;
        Self {
            api: app.api,
            db,
            stop: app.stop,
        }
    }

    pub async fn adjust(&self, tenant: i64, key: &str, sku: &str, delta: i64) -> testkit::Answer {
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
