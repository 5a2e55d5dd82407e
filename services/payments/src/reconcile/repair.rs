//! The repairs reconciliation may make, each with our row locked and our
//! side read again inside the transaction, so two passes side by side never
//! repair one thing twice.

use contracts::aggregate;
use reliability::outbox::{self, NewEvent};
use reliability::{Result, TenantId, TenantTx};

use super::{Mismatch, Reconciler, parse_key};
use crate::provider::{ChargeRecord, RefundRecord};

impl Reconciler {
    /// A listed charge our books may disagree with: judged with our row
    /// locked, and repaired where a rule says how.
    pub(super) async fn charge(&self, c: &ChargeRecord, repair: bool) -> Result<Option<Mismatch>> {
        let mismatch = |kind, detail, repaired| Mismatch::found(kind, &c.key, detail, repaired);
        let Some((tenant, payment_id)) = parse_key(&c.key, "pay-") else {
            return Ok(mismatch(
                "unknown_key",
                "a charge under a key we never issue".into(),
                false,
            ));
        };
        let mut tx = TenantTx::begin(&self.owner, TenantId::new(tenant)?).await?;
        let ours: Option<(String, i64)> = sqlx::query_as(
            "SELECT status, amount_cents FROM payments WHERE tenant_id = $1 AND payment_id = $2 FOR UPDATE",
        )
        .bind(tenant)
        .bind(payment_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((status, amount)) = ours else {
            return Ok(mismatch(
                "unknown_key",
                "a charge for no payment of ours".into(),
                false,
            ));
        };
        match (c.status.as_str(), status.as_str()) {
            ("succeeded", "failed") => {}
            ("declined" | "failed", "captured") => {
                return Ok(mismatch(
                    "captured_without_charge",
                    format!(
                        "we captured payment {payment_id}; the provider says {}",
                        c.status
                    ),
                    false,
                ));
            }
            _ => return Ok(None),
        }
        // Charged for a cancelled order: whatever neither the provider nor
        // a refund of ours in flight has given back is owed.
        let (pending, succeeded): (i64, i64) = sqlx::query_as(
            "SELECT coalesce(sum(amount_cents) FILTER (WHERE status = 'pending'), 0)::bigint,
                    coalesce(sum(amount_cents) FILTER (WHERE status = 'succeeded'), 0)::bigint
             FROM refunds WHERE tenant_id = $1 AND payment_id = $2",
        )
        .bind(tenant)
        .bind(payment_id)
        .fetch_one(&mut *tx)
        .await?;
        let owed = amount.min(c.amount_cents) - c.refunded_cents.max(succeeded) - pending;
        if owed <= 0 {
            return Ok(None);
        }
        let detail = format!(
            "payment {payment_id} failed (order cancelled) but the provider charged {} and {} came back",
            c.amount_cents, c.refunded_cents
        );
        if !repair {
            return Ok(mismatch("charge_without_order", detail, false));
        }
        let inserted = sqlx::query(
            "INSERT INTO refunds (tenant_id, payment_id, amount_cents, charge_key, repair)
             VALUES ($1, $2, $3, $4, true) ON CONFLICT DO NOTHING",
        )
        .bind(tenant)
        .bind(payment_id)
        .bind(owed)
        .bind(&c.key)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        // A refund of the repair's already there counted when it was made.
        if inserted == 1 {
            count_refunded(&mut tx, payment_id, owed).await?;
        }
        tx.commit().await?;
        Ok(mismatch("charge_without_order", detail, true))
    }

    /// Captured payments of the window whose `refunded_cents` is not what
    /// their own refunds pending or succeeded add up to (as
    /// `refunded::recount` counts them): drift in our books, counted again,
    /// each judged with its row locked. Whether each refund's status is the
    /// provider's is the refund pass's to judge.
    pub(super) async fn books(
        &self,
        since: chrono::DateTime<chrono::Utc>,
        repair: bool,
    ) -> Result<Vec<Mismatch>> {
        let drifted: Vec<(i64, i64)> = sqlx::query_as(concat!(
            "SELECT p.tenant_id, p.payment_id FROM payments p
             WHERE p.status = 'captured' AND p.first_attempt_at >= $1 AND p.refunded_cents <> ",
            counted!()
        ))
        .bind(since)
        .fetch_all(&self.owner)
        .await?;
        let mut found = Vec::new();
        for (tenant, payment_id) in drifted {
            let mut tx = TenantTx::begin(&self.owner, TenantId::new(tenant)?).await?;
            let row: Option<(i64, i64)> = sqlx::query_as(concat!(
                "SELECT p.refunded_cents, ",
                counted!(),
                "::bigint FROM payments p
                 WHERE p.tenant_id = $1 AND p.payment_id = $2 AND p.status = 'captured' FOR UPDATE OF p"
            ))
            .bind(tenant)
            .bind(payment_id)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((books, counted)) = row.filter(|(b, c)| b != c) else {
                continue;
            };
            if repair {
                crate::refunded::recount(&mut tx, payment_id).await?;
                tx.commit().await?;
            }
            found.extend(Mismatch::found(
                "refunded_amount_drift",
                &contracts::provider::charge_key(tenant, payment_id),
                format!(
                    "payment {payment_id} counts {books} cents refunded; its refunds pending or succeeded add up to {counted}"
                ),
                repair,
            ));
        }
        Ok(found)
    }

    /// A listed refund our books may disagree with, the same way.
    pub(super) async fn refund(&self, r: &RefundRecord, repair: bool) -> Result<Option<Mismatch>> {
        let mismatch = |kind, detail, repaired| Mismatch::found(kind, &r.key, detail, repaired);
        let Some((tenant, refund_id)) = parse_key(&r.key, "refund-") else {
            return Ok(mismatch(
                "unknown_key",
                "a refund under a key we never issue".into(),
                false,
            ));
        };
        if r.status != "succeeded" {
            return Ok(None);
        }
        let mut tx = TenantTx::begin(&self.owner, TenantId::new(tenant)?).await?;
        let ours: Option<(String, i64, i64, i64)> = sqlx::query_as(
            "SELECT r.status, r.payment_id, p.order_id, r.amount_cents
             FROM refunds r JOIN payments p ON p.tenant_id = r.tenant_id AND p.payment_id = r.payment_id
             WHERE r.tenant_id = $1 AND r.refund_id = $2 FOR UPDATE OF r, p",
        )
        .bind(tenant)
        .bind(refund_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((status, payment_id, order_id, amount)) = ours else {
            return Ok(mismatch(
                "unknown_key",
                "a refund for no refund of ours".into(),
                false,
            ));
        };
        if status != "failed" {
            return Ok(None);
        }
        let detail = format!(
            "refund {refund_id} is failed here; the provider refunded {} cents",
            r.amount_cents
        );
        if !repair {
            return Ok(mismatch("refund_marked_failed", detail, false));
        }
        sqlx::query(
            "UPDATE refunds SET status = 'succeeded', provider_refund_id = $3, updated_at = now()
             WHERE tenant_id = $1 AND refund_id = $2",
        )
        .bind(tenant)
        .bind(refund_id)
        .bind(&r.refund_id)
        .execute(&mut *tx)
        .await?;
        // The row is locked (FOR UPDATE above): counted from the refunds.
        crate::refunded::recount(&mut tx, payment_id).await?;
        let issued = contracts::RefundIssued {
            order_id,
            payment_id,
            refund_id,
            amount_cents: amount,
        };
        let event = NewEvent::of(aggregate::PAYMENT, payment_id, &issued)?;
        outbox::enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(mismatch("refund_marked_failed", detail, true))
    }
}

/// `amount` more of a failed payment is on its way back (a repair's refund
/// of a late charge): the guard against refunding more counts it.
async fn count_refunded(tx: &mut TenantTx, payment_id: i64, amount: i64) -> Result<()> {
    sqlx::query(
        "UPDATE payments SET refunded_cents = least(amount_cents, refunded_cents + $3), updated_at = now()
         WHERE tenant_id = $1 AND payment_id = $2",
    )
    .bind(tx.tenant().get())
    .bind(payment_id)
    .bind(amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
