//! payments against the real PostgreSQL and the provider simulator: one
//! charge per payment whatever fails, refunds once and never above capture.

mod appliers;
mod flow;
mod model;
mod outcomes;
mod reconcile;
mod throughput;

use std::time::Duration;

use payments::charges::{CONSUMER, Charges};
use payments::provider::Psp;
use payments::worker::{Worker, WorkerConfig};
use payments::{PspSettings, SERVICE, Settings};
use reliability::consumer::{Consumer, ConsumerConfig};
use reliability::failpoint::FailPoints;
use reliability::outbox::Envelope;
use serde_json::json;
use service_kit::service::{Role, ShutdownToken};
use testkit::{ApiClient, Served, TestDb, amqp_url, serve, unique};

pub struct TestApp {
    pub api: ApiClient,
    pub db: TestDb,
    pub psp: psp_sim::Simulator,
    pub psp_url: String,
    stop: ShutdownToken,
}

impl TestApp {
    pub async fn spawn() -> Self {
        let db = TestDb::with_migrations(&payments::MIGRATIONS).await;
        let sim = psp_sim::Application::build(psp_sim::Settings::local(0))
            .await
            .unwrap();
        let (psp_url, psp) = (format!("http://127.0.0.1:{}", sim.port()), sim.simulator());

        let mut common = testkit::common_settings();
        common.exchange = unique("reltest.payments.");
        let settings = Settings {
            role: Role::Serve,
            service: PspSettings {
                psp_url: psp_url.clone(),
                psp_timeout_ms: 500,
                ..Default::default()
            },
            ..Settings::local(common)
        };
        let Served { api, stop, .. } = serve(&SERVICE, settings, db.databases()).await;
        // The simulator's port is bound already; it stops with the service.
        tokio::spawn(sim.run_until_stopped(stop.clone()));
        Self {
            api,
            db,
            psp,
            psp_url,
            stop,
        }
    }

    pub fn worker(&self, fail_points: FailPoints) -> Worker {
        self.worker_with(
            WorkerConfig::default(),
            Duration::from_millis(300),
            fail_points,
        )
    }

    pub fn worker_with(
        &self,
        config: WorkerConfig,
        timeout: Duration,
        fail_points: FailPoints,
    ) -> Worker {
        let psp = Psp::new(&self.psp_url, timeout);
        Worker::new(self.db.app.clone(), psp, config, fail_points)
    }

    /// Status of every payment of `tenant`, as the owner.
    pub async fn statuses(&self, tenant: i64) -> Vec<String> {
        sqlx::query_scalar("SELECT status FROM payments WHERE tenant_id = $1 ORDER BY payment_id")
            .bind(tenant)
            .fetch_all(&self.db.owner)
            .await
            .unwrap()
    }

    /// Records a pending payment as the saga's consumer would.
    pub async fn reserve(&self, tenant: i64, order_id: i64, customer: &str, total: i64) {
        let consumer = Consumer::new(
            self.db.app.clone(),
            &amqp_url(),
            ConsumerConfig::new(CONSUMER, "unused", &[]),
            Charges,
        );
        let e = Envelope {
            id: order_id,
            source: "inventory".into(),
            tenant_id: tenant,
            aggregate_type: "order".into(),
            aggregate_id: order_id.to_string(),
            event_type: "InventoryReserved".into(),
            event_version: 1,
            occurred_at: chrono::Utc::now(),
            payload: json!({"order_id": order_id, "customer_id": customer, "currency": "EUR", "total_cents": total}),
            aggregate_seq: None,
        };
        consumer.apply(&e).await.unwrap();
    }

    /// `POST /refunds` of `amount` of tenant 1's `payment` under `key`: its status.
    pub async fn refund(&self, payment: i64, key: &str, amount: i64) -> u16 {
        let body = serde_json::json!({"payment_id": payment, "amount_cents": amount}).to_string();
        self.api.post(1, "/refunds", key, &body).await.0
    }

    /// (payment_id, status, refunded_cents) of an order's payment, as the owner.
    pub async fn payment(&self, order_id: i64) -> (i64, String, i64) {
        sqlx::query_as(
            "SELECT payment_id, status, refunded_cents FROM payments WHERE order_id = $1",
        )
        .bind(order_id)
        .fetch_one(&self.db.owner)
        .await
        .unwrap()
    }

    /// Ends every lease and backoff now, as if the time had passed.
    pub async fn expire_leases(&self) {
        sqlx::query("UPDATE payments SET next_attempt_at = now() WHERE status = 'pending'")
            .execute(&self.db.owner)
            .await
            .unwrap();
        sqlx::query("UPDATE refunds SET next_attempt_at = now() WHERE status = 'pending'")
            .execute(&self.db.owner)
            .await
            .unwrap();
    }

    pub async fn events(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT event_type FROM outbox_messages ORDER BY id")
            .fetch_all(&self.db.owner)
            .await
            .unwrap()
    }

    pub async fn stop(self) {
        self.stop.cancel();
        self.db.cleanup().await;
    }
}
