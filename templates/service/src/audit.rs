//! The consumer: records each `ItemCreated` in `item_audit`, exactly once,
//! with any number of lanes and replicas applying side by side
//! (docs/adr/0010). A handler answers two questions: what aggregate an
//! event changes (`lock_key`: events of one item take turns), and which
//! rows it shares with other aggregates (`prepare`: none here).

use reliability::TenantTx;
use reliability::broker::Subscription;
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::Envelope;

use crate::http::ItemCreated;

/// The consumer's queue and bindings, declared once: the consumer binds its
/// queue from it and the relay declares it before it publishes. A service
/// whose consumers take other services' events adds them to
/// `contracts::topology` instead, so every publisher declares them.
///
/// Order-free: any number of appliers share one queue. A handler that needs
/// each item's events in the order they were written (an update after the
/// create) says `.ordered(4)`: four partition queues, one active consumer
/// each, and an event that fails for good parks its item alone
/// (docs/template.md, docs/adr/0028).
pub const SUBSCRIPTION: Subscription =
    Subscription::new("__SERVICE__.audit", &["__SERVICE__.ItemCreated"]);

pub const CONSUMER: &str = SUBSCRIPTION.consumer;

pub struct Audit;

impl Handler for Audit {
    /// The item the event is about (the envelope's aggregate, the default).
    fn lock_key(&self, e: &Envelope) -> Option<String> {
        Some(format!("{}:{}", e.aggregate_type, e.aggregate_id))
    }

    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        // The queue binds ItemCreated alone: anything else, or another
        // version, is refused (dead-lettered), not skipped.
        let item: ItemCreated = e.decode()?;
        sqlx::query("INSERT INTO item_audit (tenant_id, item_id) VALUES ($1, $2)")
            .bind(tx.tenant().get())
            .bind(item.item_id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}
