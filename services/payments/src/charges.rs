//! The payments step of the saga: on `InventoryReserved`, record a pending
//! payment. Charging happens in the provider worker, outside any transaction.

use contracts::event;
use reliability::consumer::{ConsumerConfig, Handler, HandlerError};
use reliability::outbox::Envelope;
use reliability::{TenantTx, service::CommonSettings};

pub const CONSUMER: &str = contracts::topology::PAYMENTS_CHARGES.consumer;

/// The queue and bindings of `contracts::topology::PAYMENTS_CHARGES`.
pub fn consumer_config(common: &CommonSettings) -> reliability::Result<ConsumerConfig> {
    common.consumer_config(&contracts::topology::PAYMENTS_CHARGES)
}

pub struct Charges;

impl Handler for Charges {
    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        if e.event_type != event::INVENTORY_RESERVED {
            return Ok(());
        }
        if e.event_version != 1 {
            return Err(HandlerError::Permanent(format!(
                "unknown version {} of {}",
                e.event_version, e.event_type
            )));
        }
        let r: contracts::InventoryReserved = e.payload_as().map_err(|err| {
            HandlerError::Permanent(format!("bad InventoryReserved payload: {err}"))
        })?;
        // One payment per order, whatever arrives twice.
        sqlx::query(
            "INSERT INTO payments (tenant_id, order_id, customer_id, amount_cents, currency, traceparent)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant_id, order_id) DO NOTHING",
        )
        .bind(tx.tenant().get())
        .bind(r.order_id)
        .bind(&r.customer_id)
        .bind(r.total_cents)
        .bind(&r.currency)
        .bind(reliability::trace::current().map(|t| t.to_header()))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}
