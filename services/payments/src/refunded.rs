//! A payment's `refunded_cents`: the refunds accepted so far, in progress
//! or done, the guard against refunding more than was captured. Once a
//! refund settles it is counted again from the refunds themselves, never
//! moved by an increment: a refund marked failed, counted again by
//! reconciliation while another was reserved, then that one refused,
//! drifted from the provider's amount in increments capped at the charge
//! (issue 43). After every refund has settled it is the sum of the
//! succeeded ones, which is what the provider refunded.

/// What a payment's `refunded_cents` must be: its refunds pending or
/// succeeded (`p` is the payment's row).
macro_rules! counted {
    () => {
        "least(p.amount_cents, (SELECT coalesce(sum(r.amount_cents), 0) FROM refunds r
          WHERE r.tenant_id = p.tenant_id AND r.payment_id = p.payment_id
            AND r.status IN ('pending', 'succeeded')))"
    };
}

use reliability::Result;
use reliability::tenant::TenantTx;

/// Locks `payment_id`'s row: the refunds a count reads are then all
/// committed ones (a reservation holds the row until it commits), read by
/// the next statement's snapshot.
pub(crate) async fn lock(tx: &mut TenantTx, payment_id: i64) -> Result<()> {
    sqlx::query("SELECT 1 FROM payments WHERE payment_id = $1 FOR UPDATE")
        .bind(payment_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Counts `payment_id`'s refunds pending or succeeded again, its row
/// locked by [`lock`] first. Capped at the amount only while a reservation
/// made on wrong books is still pending: the provider refuses it, and the
/// next count drops it.
pub(crate) async fn recount(tx: &mut TenantTx, payment_id: i64) -> Result<()> {
    sqlx::query(concat!(
        "UPDATE payments p SET updated_at = now(), refunded_cents = ",
        counted!(),
        " WHERE p.payment_id = $1"
    ))
    .bind(payment_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
