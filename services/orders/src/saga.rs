//! The saga's outcome: orders confirms on `PaymentCaptured` and cancels on
//! `InventoryRejected` or `PaymentFailed`, emitting `OrderConfirmed` /
//! `OrderCancelled`. Only a `pending` order moves, so a late or repeated
//! event cannot flip a decided one.

use contracts::{AnyEvent, aggregate};
use reliability::TenantTx;
use reliability::consumer::{Handler, HandlerError, payload_lock_key};
use reliability::outbox::{self, Envelope, NewEvent};

pub const CONSUMER: &str = contracts::topology::ORDERS_SAGA.consumer;

pub struct Saga;

impl Handler for Saga {
    /// Every event of one order takes turns, whichever aggregate sent it.
    fn lock_key(&self, e: &Envelope) -> Option<String> {
        Some(payload_lock_key(e, aggregate::ORDER, "order_id"))
    }

    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        match e.event()? {
            AnyEvent::PaymentCaptured(p) => decide(tx, p.order_id, None).await,
            AnyEvent::PaymentFailed(p) => {
                let reason = format!("payment_failed: {}", p.reason);
                decide(tx, p.order_id, Some(reason)).await
            }
            AnyEvent::InventoryRejected(p) => {
                let reason = format!("inventory_rejected: {}", p.reason);
                decide(tx, p.order_id, Some(reason)).await
            }
            _ => Ok(()),
        }
    }
}

/// Confirms (`cancel_reason` None) or cancels a pending order and emits the outcome.
async fn decide(
    tx: &mut TenantTx,
    order_id: i64,
    cancel_reason: Option<String>,
) -> Result<(), HandlerError> {
    let status = if cancel_reason.is_some() {
        "cancelled"
    } else {
        "confirmed"
    };
    let moved = sqlx::query(
        "UPDATE orders SET status = $2, cancel_reason = $3, updated_at = now()
         WHERE order_id = $1 AND status = 'pending'",
    )
    .bind(order_id)
    .bind(status)
    .bind(&cancel_reason)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if moved == 0 {
        let current: Option<String> =
            sqlx::query_scalar("SELECT status FROM orders WHERE order_id = $1")
                .bind(order_id)
                .fetch_optional(&mut **tx)
                .await?;
        return match current {
            None => Err(HandlerError::Permanent(
                format!("no order {order_id}").into(),
            )),
            Some(current) => {
                tracing::warn!(
                    order_id,
                    current,
                    wanted = status,
                    "order already decided; event ignored"
                );
                Ok(())
            }
        };
    }
    let event = match cancel_reason {
        None => NewEvent::of(
            aggregate::ORDER,
            order_id,
            &contracts::OrderConfirmed { order_id },
        )?,
        Some(reason) => NewEvent::of(
            aggregate::ORDER,
            order_id,
            &contracts::OrderCancelled { order_id, reason },
        )?,
    };
    outbox::enqueue(tx, &event).await?;
    tracing::info!(order_id, status, "order decided");
    Ok(())
}
