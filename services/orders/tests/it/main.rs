//! orders against the real PostgreSQL: every rule of the HTTP contract, and
//! the saga's decisions.

mod api;
mod saga;

use std::time::Duration;

use orders::{Application, Settings};
use reliability::TenantId;
use reliability::auth::JwtKeys;
use reliability::service::{CommonSettings, Role, ShutdownToken};
use reliability::testing::{TestDb, unique};
use serde_json::Value;

/// The orders service on a free port with a database of its own.
pub struct TestApp {
    pub url: String,
    pub db: TestDb,
    pub jwt: JwtKeys,
    pub http: reqwest::Client,
    stop: ShutdownToken,
}

impl TestApp {
    pub async fn spawn() -> Self {
        let db = TestDb::with_migrations(&orders::MIGRATIONS).await;
        let mut common = CommonSettings::local();
        common.exchange = unique("reltest.orders.");
        let jwt = common.jwt_keys();
        let settings = Settings {
            role: Role::Serve,
            port: 0,
            database_url: String::new(),
            common,
        };
        let stop = ShutdownToken::new();
        let app = Application::build_with(settings, db.databases(), stop.clone())
            .await
            .unwrap();
        let url = format!("http://127.0.0.1:{}", app.port());
        tokio::spawn(app.run_until_stopped());
        Self {
            url,
            db,
            jwt,
            http: reqwest::Client::new(),
            stop,
        }
    }

    pub fn token(&self, tenant: i64) -> String {
        self.jwt
            .mint(TenantId::new(tenant).unwrap(), Duration::from_secs(600))
    }

    /// POST /orders as `tenant` with `key`; (status, replayed, body).
    pub async fn place(&self, tenant: i64, key: &str, body: &str) -> (u16, bool, Value) {
        let resp = self
            .http
            .post(format!("{}/orders", self.url))
            .bearer_auth(self.token(tenant))
            .header("Idempotency-Key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let replayed = resp.headers().get("idempotent-replayed").is_some();
        (status, replayed, resp.json().await.unwrap_or(Value::Null))
    }

    pub async fn get(&self, tenant: i64, path: &str) -> (u16, Value) {
        let resp = self
            .http
            .get(format!("{}{path}", self.url))
            .bearer_auth(self.token(tenant))
            .send()
            .await
            .unwrap();
        (
            resp.status().as_u16(),
            resp.json().await.unwrap_or(Value::Null),
        )
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
