//! The payments step of the saga: on `InventoryReserved`, record a pending
//! payment. Charging happens in the provider worker, outside any transaction.

use contracts::AnyEvent;
use reliability::TenantTx;
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::Envelope;

pub const CONSUMER: &str = contracts::topology::PAYMENTS_CHARGES.consumer;

pub struct Charges;

impl Handler for Charges {
    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        let AnyEvent::InventoryReserved(r) = e.event()? else {
            return Ok(());
        };
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
