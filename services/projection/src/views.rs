//! The order view, built from events alone. Each event is stored per order;
//! the view is then recomputed from the whole set, so it is the same
//! whatever order the events came in, and a rebuild lands on the same view.
//! The recompute reads the order's events and writes its view: two appliers
//! of one order's events would each miss the other's event and the later
//! write would lose one, so they take turns on the order (`lock_key`).

use contracts::{AnyEvent, aggregate};
use reliability::TenantTx;
use reliability::consumer::{Handler, HandlerError, payload_lock_key};
use reliability::outbox::Envelope;

pub const CONSUMER: &str = contracts::topology::PROJECTION_VIEWS.consumer;

pub struct Views;

impl Handler for Views {
    /// Every event of one order takes turns, whichever aggregate sent it.
    fn lock_key(&self, e: &Envelope) -> Option<String> {
        Some(payload_lock_key(e, aggregate::ORDER, "order_id"))
    }

    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        // The events that belong to an order's view; the view is computed
        // from their stored payloads.
        let order_id = match e.event()? {
            AnyEvent::OrderPlaced(p) => p.order_id,
            AnyEvent::OrderConfirmed(p) => p.order_id,
            AnyEvent::OrderCancelled(p) => p.order_id,
            AnyEvent::InventoryReserved(p) => p.order_id,
            AnyEvent::InventoryRejected(p) => p.order_id,
            AnyEvent::PaymentCaptured(p) => p.order_id,
            AnyEvent::PaymentFailed(p) => p.order_id,
            AnyEvent::RefundIssued(p) => p.order_id,
            AnyEvent::StockAdjusted(_) => return Ok(()),
        };
        let tenant = tx.tenant().get();
        sqlx::query(
            "INSERT INTO order_view_events (tenant_id, order_id, source, message_id, event_type, occurred_at, payload)
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
        )
        .bind(tenant)
        .bind(order_id)
        .bind(&e.source)
        .bind(e.id)
        .bind(&e.event_type)
        .bind(e.occurred_at)
        .bind(&e.payload)
        .execute(&mut **tx)
        .await?;
        recompute(tx, order_id).await?;
        Ok(())
    }
}

/// The view as a function of the set of events and of the facts the rows
/// stated (`facts`): terminal states win, a reservation is committed or
/// released by the order's outcome, and a refund counts once by its id,
/// whether its event, its fact or both are there. The tenant is named as
/// well as enforced: a repair runs as the owner, whom row-level security
/// does not filter, and two tenants may use one order id.
pub(crate) async fn recompute(tx: &mut TenantTx, order_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH e AS (SELECT event_type, payload FROM order_view_events WHERE tenant_id = $1 AND order_id = $2
                   UNION ALL
                   SELECT event_type, payload FROM order_view_facts WHERE tenant_id = $1 AND order_id = $2),
              refunds AS (SELECT DISTINCT ON (payload->>'refund_id') (payload->>'amount_cents')::bigint AS amount
                          FROM e WHERE event_type = 'RefundIssued'),
              has AS (SELECT bool_or(event_type = 'OrderConfirmed') AS confirmed,
                             bool_or(event_type = 'OrderCancelled') AS cancelled,
                             bool_or(event_type = 'InventoryReserved') AS reserved,
                             bool_or(event_type = 'InventoryRejected') AS rejected,
                             bool_or(event_type = 'PaymentCaptured') AS captured,
                             bool_or(event_type = 'PaymentFailed') AS failed,
                             max((payload->>'total_cents')::bigint) FILTER (WHERE event_type = 'OrderPlaced') AS total,
                             max(payload->>'currency') FILTER (WHERE event_type = 'OrderPlaced') AS currency,
                             (SELECT coalesce(sum(amount), 0) FROM refunds) AS refunded
                      FROM e)
         INSERT INTO order_views (tenant_id, order_id, status, total_cents, currency, payment_status, reservation_status, refunded_cents)
         SELECT $1, $2,
                CASE WHEN confirmed THEN 'confirmed' WHEN cancelled THEN 'cancelled' ELSE 'pending' END,
                total, currency,
                CASE WHEN captured THEN 'captured' WHEN failed THEN 'failed' WHEN reserved THEN 'pending' ELSE 'none' END,
                CASE WHEN rejected THEN 'rejected'
                     WHEN reserved AND confirmed THEN 'committed'
                     WHEN reserved AND cancelled THEN 'released'
                     WHEN reserved THEN 'reserved'
                     ELSE 'pending' END,
                refunded
         FROM has
         ON CONFLICT (tenant_id, order_id) DO UPDATE SET
             status = EXCLUDED.status, total_cents = EXCLUDED.total_cents, currency = EXCLUDED.currency,
             payment_status = EXCLUDED.payment_status, reservation_status = EXCLUDED.reservation_status,
             refunded_cents = EXCLUDED.refunded_cents, updated_at = now()",
    )
    .bind(tx.tenant().get())
    .bind(order_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
