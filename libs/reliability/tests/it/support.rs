//! Fixtures shared by the tests: a tenant-scoped effect table whose handler
//! is deliberately NOT idempotent (it adds), so any double apply shows.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reliability::TenantTx;
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::{self, Envelope, NewEvent};
use serde_json::json;
use testkit::TestDb;

pub use testkit::{DEADLINE, tenant};

/// `test_effects`: per (tenant, aggregate) how many events were applied and
/// the sum of their amounts. Tenant-owned, with RLS like a real table.
pub async fn create_effects_table(db: &TestDb) {
    sqlx::raw_sql(
        "CREATE TABLE test_effects (
             tenant_id bigint NOT NULL,
             aggregate_id text NOT NULL,
             applied integer NOT NULL,
             total bigint NOT NULL,
             PRIMARY KEY (tenant_id, aggregate_id));
         ALTER TABLE test_effects ENABLE ROW LEVEL SECURITY;
         ALTER TABLE test_effects FORCE ROW LEVEL SECURITY;
         CREATE POLICY tenant_isolation ON test_effects
             USING (tenant_id = (SELECT app_current_tenant()))
             WITH CHECK (tenant_id = (SELECT app_current_tenant()));
         GRANT SELECT, INSERT, UPDATE ON test_effects TO commerce_app;",
    )
    .execute(&db.owner)
    .await
    .unwrap();
}

/// (tenant, aggregate) -> (applied, total), read as the owner.
pub async fn effects(db: &TestDb) -> Vec<(i64, String, i32, i64)> {
    sqlx::query_as("SELECT tenant_id, aggregate_id, applied, total FROM test_effects ORDER BY 1, 2")
        .fetch_all(&db.owner)
        .await
        .unwrap()
}

/// Adds `payload.amount` to the aggregate's total. Fails every `Poison`
/// event while `poisoned` is set.
#[derive(Clone, Default)]
pub struct AddingHandler {
    pub poisoned: Arc<AtomicBool>,
    /// Work each event takes, so that lanes hold full prefetch windows.
    pub work: Duration,
}

impl Handler for AddingHandler {
    async fn handle(&self, tx: &mut TenantTx, event: &Envelope) -> Result<(), HandlerError> {
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        if event.event_type == "Poison" && self.poisoned.load(Ordering::SeqCst) {
            return Err(HandlerError::Transient("poison pill".into()));
        }
        let amount = event.payload["amount"]
            .as_i64()
            .ok_or_else(|| HandlerError::Permanent("no amount".into()))?;
        sqlx::query(
            "INSERT INTO test_effects (tenant_id, aggregate_id, applied, total) VALUES ($1, $2, 1, $3)
             ON CONFLICT (tenant_id, aggregate_id)
             DO UPDATE SET applied = test_effects.applied + 1, total = test_effects.total + EXCLUDED.total",
        )
        .bind(tx.tenant().get())
        .bind(&event.aggregate_id)
        .bind(amount)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// Commits one `Added` event of `amount` for `aggregate` in its own transaction.
pub async fn enqueue_added(db: &TestDb, tenant_id: i64, aggregate: &str, amount: i64) -> i64 {
    let mut tx = TenantTx::begin(&db.app, tenant(tenant_id)).await.unwrap();
    let id = outbox::enqueue(
        &mut tx,
        &NewEvent::new("test", aggregate, "Added", &json!({ "amount": amount })).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    id
}

pub use testkit::Broker;

/// An envelope as the relay of `source` would publish it.
pub fn envelope(
    source: &str,
    id: i64,
    tenant_id: i64,
    aggregate: &str,
    event_type: &str,
    amount: i64,
) -> Envelope {
    Envelope {
        id,
        source: source.to_owned(),
        tenant_id,
        aggregate_type: "test".into(),
        aggregate_id: aggregate.to_owned(),
        event_type: event_type.to_owned(),
        event_version: 1,
        occurred_at: chrono::Utc::now(),
        payload: json!({ "amount": amount }),
        aggregate_seq: None,
    }
}

/// A small deterministic PRNG (xorshift) so shuffles are repeatable.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}
