//! orders against the real PostgreSQL: every rule of the HTTP contract, and
//! the saga's decisions.

mod admission;
mod api;
mod appliers;
mod ops;
mod saga;

use orders::{SERVICE, Settings};
use serde_json::Value;
use service_kit::service::{CommonSettings, Role, ShutdownToken};
use testkit::{Answer, ApiClient, Served, TestDb, serve, unique};

/// The orders service on a free port with a database of its own.
pub struct TestApp {
    pub api: ApiClient,
    /// The ops port's base URL: `/metrics`, `/readyz` with its detail.
    pub ops: String,
    pub db: TestDb,
    stop: ShutdownToken,
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with(|_| {}).await
    }

    /// With settings of its own (e.g. admission bounds).
    pub async fn spawn_with(settings: impl FnOnce(&mut CommonSettings)) -> Self {
        let db = TestDb::with_migrations(&orders::MIGRATIONS).await;
        let mut common = testkit::common_settings();
        settings(&mut common);
        common.exchange = unique("reltest.orders.");
        let settings = Settings {
            role: Role::Serve,
            ..Settings::local(common)
        };
        let Served { api, ops, stop } = serve(&SERVICE, settings, db.databases()).await;
        Self { api, ops, db, stop }
    }

    pub async fn place(&self, tenant: i64, key: &str, body: &str) -> Answer {
        self.api.post(tenant, "/orders", key, body).await
    }

    /// The process's `/metrics` text, from its ops port.
    pub async fn metrics(&self) -> String {
        let url = format!("{}/metrics", self.ops);
        let resp = self.api.http.get(url).send().await.unwrap();
        resp.text().await.unwrap()
    }

    pub async fn get(&self, tenant: i64, path: &str) -> (u16, Value) {
        self.api.get(tenant, path).await
    }

    pub async fn count(&self, table: &'static str) -> i64 {
        let sql = match table {
            "orders" => "SELECT count(*) FROM orders",
            "order_lines" => "SELECT count(*) FROM order_lines",
            "outbox_messages" => "SELECT count(*) FROM outbox_messages",
            other => panic!("no count for {other}"),
        };
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.owner)
            .await
            .unwrap()
    }

    pub async fn stop(self) {
        self.stop.cancel();
        self.db.cleanup().await;
    }
}

pub const ORDER: &str = r#"{"customer_id": "c-1", "currency": "EUR", "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}, {"sku": "SKU-2", "quantity": 1, "unit_price_cents": 99}]}"#;
