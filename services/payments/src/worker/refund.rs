//! Refunding one leased refund with its own key, for good (docs/adr/0011).

use contracts::aggregate;
use reliability::outbox::{self, NewEvent};
use reliability::trace::{Kind, Span, TraceContext};
use reliability::{Result, TenantId, TenantTx};
use serde_json::json;

use super::{AFTER_PROVIDER, Worker};
use crate::provider::{RefundReply, Reply};

#[derive(sqlx::FromRow)]
struct Refund {
    payment_id: i64,
    order_id: i64,
    amount_cents: i64,
    provider_charge_id: Option<String>,
    charge_key: Option<String>,
    attempts: i32,
    outcome_unknown: bool,
    traceparent: Option<String>,
}

impl Worker {
    #[tracing::instrument(skip(self), fields(tenant_id = %tenant))]
    pub(super) async fn refund(&self, tenant: TenantId, refund_id: i64) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let leased: Option<Refund> = sqlx::query_as(
            "SELECT r.payment_id, p.order_id, r.amount_cents, p.provider_charge_id, r.charge_key,
                    r.attempts, r.outcome_unknown, r.traceparent
             FROM refunds r JOIN payments p ON p.payment_id = r.payment_id
             WHERE r.refund_id = $1 AND r.status = 'pending'",
        )
        .bind(refund_id)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        let Some(r) = leased else { return Ok(()) };
        let parent = r.traceparent.as_deref().and_then(TraceContext::parse);
        let mut step = Span::start(
            contracts::source::PAYMENTS,
            "refund payment",
            Kind::Internal,
            parent,
        );
        step.set("tenant.id", tenant.get());
        step.run(self.refund_leased(tenant, refund_id, r)).await
    }

    async fn refund_leased(&self, tenant: TenantId, refund_id: i64, r: Refund) -> Result<()> {
        // The same key on every try, for good: a refund whose outcome was
        // unknown is never issued again under another key.
        let key = format!("refund-{tenant}-{refund_id}");
        let body = match &r.charge_key {
            Some(charge_key) => json!({"charge_key": charge_key, "amount_cents": r.amount_cents}),
            None => json!({"charge_id": r.provider_charge_id, "amount_cents": r.amount_cents}),
        };
        let mut reply: Reply<RefundReply> = self.psp.post("/refunds", &key, body).await;
        if let Reply::Refused(e) = &reply
            && r.outcome_unknown
        {
            reply = match self.psp.lookup::<RefundReply>("/refunds", &key).await {
                Reply::Done(Some(done)) => Reply::Done(done),
                Reply::Done(None) => Reply::Refused(e.clone()),
                Reply::Refused(l) | Reply::Retry(l) => {
                    Reply::Retry(format!("{e}; look-up by key: {l}"))
                }
            };
        }
        self.fail_points.check(AFTER_PROVIDER)?;

        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        match reply {
            Reply::Done(done) if done.status == "succeeded" => {
                let moved = sqlx::query(
                    "UPDATE refunds SET status = 'succeeded', provider_refund_id = $2, updated_at = now()
                     WHERE refund_id = $1 AND status = 'pending'",
                )
                .bind(refund_id)
                .bind(&done.refund_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if moved == 1 {
                    let issued = contracts::RefundIssued {
                        order_id: r.order_id,
                        payment_id: r.payment_id,
                        refund_id,
                        amount_cents: r.amount_cents,
                    };
                    outbox::enqueue(
                        &mut tx,
                        &NewEvent::of(aggregate::PAYMENT, r.payment_id, &issued)?,
                    )
                    .await?;
                }
            }
            Reply::Refused(e) => {
                // Final, and nothing moved under our key: give the amount
                // back so it can be refunded another way.
                sqlx::query(
                    "WITH failed AS (
                        UPDATE refunds SET status = 'failed', last_error = $2, updated_at = now()
                        WHERE refund_id = $1 AND status = 'pending' RETURNING payment_id, amount_cents)
                     UPDATE payments p SET refunded_cents = p.refunded_cents - failed.amount_cents
                     FROM failed WHERE p.payment_id = failed.payment_id",
                )
                .bind(refund_id)
                .bind(&e)
                .execute(&mut *tx)
                .await?;
            }
            Reply::Done(RefundReply { status, .. }) | Reply::Retry(status) => {
                sqlx::query(
                    "UPDATE refunds SET next_attempt_at = now() + make_interval(secs => $2), last_error = $3,
                            outcome_unknown = true, updated_at = now()
                     WHERE refund_id = $1 AND status = 'pending'",
                )
                .bind(refund_id)
                .bind(self.backoff(r.attempts).as_secs_f64())
                .bind(&status)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }
}
