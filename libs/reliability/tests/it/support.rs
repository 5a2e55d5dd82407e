//! Fixtures shared by the tests: a tenant-scoped effect table whose handler
//! is deliberately NOT idempotent (it adds), so any double apply shows.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::{self, Envelope, NewEvent};
use reliability::testing::{TestDb, amqp_url, unique};
use reliability::{TenantId, TenantTx, broker};
use serde_json::json;

pub const DEADLINE: Duration = Duration::from_secs(20);

pub fn tenant(id: i64) -> TenantId {
    TenantId::new(id).unwrap()
}

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

/// A broker connection and a fresh exchange name for one test.
pub struct Broker {
    pub conn: Connection,
    pub channel: Channel,
    pub exchange: String,
}

impl Broker {
    pub async fn new() -> Self {
        let conn = broker::connect(&amqp_url(), "reliability-tests")
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        let exchange = unique("reltest.events.");
        broker::declare_exchange(&channel, &exchange).await.unwrap();
        Self {
            conn,
            channel,
            exchange,
        }
    }

    /// A queue bound to every routing key of the exchange, as a consumer would declare it.
    pub async fn queue(&self, bindings: &[&str]) -> String {
        let name = unique("reltest.q.");
        let spec = broker::QueueSpec::new(&name, &self.exchange, bindings);
        broker::declare_queue(&self.channel, &spec).await.unwrap();
        name
    }

    /// Takes (and acks) every ready message of `queue`.
    pub async fn take_all(&self, queue: &str) -> Vec<Envelope> {
        let mut out = Vec::new();
        while let Some(msg) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            out.push(serde_json::from_slice(&msg.delivery.data).unwrap());
            msg.delivery
                .ack(BasicAckOptions { multiple: false })
                .await
                .unwrap();
        }
        out
    }

    /// The string headers of the next message on `queue` (acked).
    pub async fn take_headers(&self, queue: &str) -> HashMap<String, String> {
        let msg = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("a message");
        msg.delivery
            .ack(BasicAckOptions { multiple: false })
            .await
            .unwrap();
        let table = msg
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        table
            .inner()
            .keys()
            .filter_map(|k| {
                let v = broker::header_str(&msg.delivery.properties, k.as_str())?;
                Some((k.as_str().to_owned(), v))
            })
            .collect()
    }

    pub async fn depth(&self, queue: &str) -> u32 {
        broker::queue_depth(&self.channel, queue).await.unwrap()
    }

    /// Publishes raw bytes straight onto `queue` (default exchange), confirmed.
    pub async fn publish_to_queue(&self, queue: &str, body: &[u8]) {
        let ch = self.conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions { nowait: false })
            .await
            .unwrap();
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }

    /// Deletes an ordered subscription's partition queues, DLQ and hash
    /// exchange, then the rest as [`Broker::cleanup`].
    pub async fn cleanup_ordered(self, spec: &broker::QueueSpec) {
        use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        for q in spec.queues() {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .exchange_delete(
                spec.partition_exchange().as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        self.cleanup(&[&spec.queue]).await;
    }

    /// Deletes the test's queues (and their DLQs) and exchange.
    pub async fn cleanup(self, queues: &[&str]) {
        use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        for q in queues {
            for name in [q.to_string(), broker::dead_letter_queue(q)] {
                let _ = self
                    .channel
                    .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let dlx = broker::dead_letter_exchange(&self.exchange);
        let _ = self
            .channel
            .exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
}

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
