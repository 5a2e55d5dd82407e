//! Charging one leased payment: the call, the outcome rules, the record,
//! and the deadline (docs/adr/0011).

use contracts::aggregate;
use reliability::outbox::{self, NewEvent};
use reliability::trace::{Kind, Span, TraceContext};
use reliability::{Result, TenantId, TenantTx};
use serde_json::json;

use super::{AFTER_PROVIDER, Worker};
use crate::provider::{ChargeReply, ChargeState, Reply};

#[derive(sqlx::FromRow)]
struct Payment {
    order_id: i64,
    customer_id: String,
    amount_cents: i64,
    currency: String,
    attempts: i32,
    outcome_unknown: bool,
    expired: bool,
    traceparent: Option<String>,
}

/// What the record step does with a charge.
enum Charge {
    Captured(String),
    Failed(String),
    Unknown(String),
}
impl Worker {
    #[tracing::instrument(skip(self), fields(tenant_id = %tenant))]
    pub(super) async fn charge(&self, tenant: TenantId, payment_id: i64) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let leased: Option<Payment> = sqlx::query_as(
            "SELECT order_id, customer_id, amount_cents, currency, attempts, outcome_unknown, traceparent,
                    created_at + make_interval(secs => $2) < now() AS expired
             FROM payments WHERE payment_id = $1 AND status = 'pending'",
        )
        .bind(payment_id)
        .bind(self.config.deadline.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        let Some(p) = leased else { return Ok(()) };
        let parent = p.traceparent.as_deref().and_then(TraceContext::parse);
        let mut step = Span::start(
            contracts::source::PAYMENTS,
            "charge payment",
            Kind::Internal,
            parent,
        );
        step.set("tenant.id", tenant.get());
        step.set("payment.attempt", i64::from(p.attempts) + 1);
        match p.expired {
            true => step.run(self.expire(tenant, payment_id, p)).await,
            false => step.run(self.charge_leased(tenant, payment_id, p)).await,
        }
    }

    async fn charge_leased(&self, tenant: TenantId, payment_id: i64, p: Payment) -> Result<()> {
        let key = charge_key(tenant, payment_id);
        let body = json!({"amount_cents": p.amount_cents, "currency": p.currency, "customer_id": p.customer_id});
        let started = std::time::Instant::now();
        let reply: Reply<ChargeReply> = self.psp.post("/charges", &key, body).await;
        metrics::histogram!(super::PSP_CALL_DURATION, "call" => "charge")
            .record(started.elapsed().as_secs_f64());
        self.fail_points.check(AFTER_PROVIDER)?;
        let outcome = match reply {
            Reply::Done(c) => settled(c),
            Reply::Retry(e) => Charge::Unknown(e),
            Reply::Refused(e) if !p.outcome_unknown => Charge::Failed(e),
            // An earlier try may have charged: only the provider's record
            // under our key can tell "failed" from "charged".
            Reply::Refused(e) => match self.psp.lookup::<ChargeReply>("/charges", &key).await {
                Reply::Done(Some(c)) => settled(c),
                Reply::Done(None) => Charge::Failed(e),
                Reply::Refused(l) | Reply::Retry(l) => {
                    Charge::Unknown(format!("{e}; look-up by key: {l}"))
                }
            },
        };
        self.record_charge(tenant, payment_id, p, outcome).await
    }

    async fn record_charge(
        &self,
        tenant: TenantId,
        payment_id: i64,
        p: Payment,
        outcome: Charge,
    ) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let (status, charge_id, reason) = match &outcome {
            Charge::Captured(id) => ("captured", Some(id.as_str()), None),
            Charge::Failed(reason) => ("failed", None, Some(reason.as_str())),
            Charge::Unknown(e) => {
                tracing::warn!(payment_id, attempts = p.attempts, error = %e, "charge not settled; will retry with the same key");
                sqlx::query(
                    "UPDATE payments SET next_attempt_at = now() + make_interval(secs => $2), last_error = $3,
                            outcome_unknown = true, updated_at = now()
                     WHERE payment_id = $1 AND status = 'pending'",
                )
                .bind(payment_id)
                .bind(self.backoff(p.attempts).as_secs_f64())
                .bind(e)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                return Ok(());
            }
        };
        let moved = sqlx::query(
            "UPDATE payments SET status = $2, provider_charge_id = $3, failure_reason = $4, updated_at = now()
             WHERE payment_id = $1 AND status = 'pending'",
        )
        .bind(payment_id)
        .bind(status)
        .bind(charge_id)
        .bind(reason)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved == 1 {
            let order_id = p.order_id;
            let event = match outcome {
                Charge::Captured(_) => NewEvent::of(
                    aggregate::PAYMENT,
                    payment_id,
                    &contracts::PaymentCaptured {
                        order_id,
                        payment_id,
                        amount_cents: p.amount_cents,
                        currency: p.currency,
                    },
                )?,
                Charge::Failed(reason) | Charge::Unknown(reason) => NewEvent::of(
                    aggregate::PAYMENT,
                    payment_id,
                    &contracts::PaymentFailed {
                        order_id,
                        payment_id,
                        reason,
                    },
                )?,
            };
            outbox::enqueue(&mut tx, &event).await?;
            tracing::info!(payment_id, order_id, status, "payment settled");
        }
        tx.commit().await?;
        Ok(())
    }

    /// Past the deadline: the payment fails (the order is cancelled), and if
    /// an earlier try may have charged, a refund of the whole amount by the
    /// charge's key is queued (it finds nothing to refund if nothing moved).
    async fn expire(&self, tenant: TenantId, payment_id: i64, p: Payment) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let moved = sqlx::query(
            "UPDATE payments SET status = 'failed', failure_reason = 'deadline_exceeded',
                    refunded_cents = CASE WHEN outcome_unknown THEN amount_cents ELSE 0 END, updated_at = now()
             WHERE payment_id = $1 AND status = 'pending'",
        )
        .bind(payment_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved == 1 {
            if p.outcome_unknown {
                sqlx::query(
                    "INSERT INTO refunds (tenant_id, payment_id, amount_cents, charge_key, traceparent)
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(tenant.get())
                .bind(payment_id)
                .bind(p.amount_cents)
                .bind(charge_key(tenant, payment_id))
                .bind(p.traceparent.as_deref())
                .execute(&mut *tx)
                .await?;
            }
            let failed = contracts::PaymentFailed {
                order_id: p.order_id,
                payment_id,
                reason: "deadline_exceeded".into(),
            };
            outbox::enqueue(
                &mut tx,
                &NewEvent::of(aggregate::PAYMENT, payment_id, &failed)?,
            )
            .await?;
            tracing::warn!(
                payment_id,
                order_id = p.order_id,
                refund_by_key = p.outcome_unknown,
                "payment ran out of time"
            );
        }
        tx.commit().await?;
        Ok(())
    }
}

fn settled(c: ChargeReply) -> Charge {
    match c.state() {
        ChargeState::Captured(id) => Charge::Captured(id),
        ChargeState::Failed(reason) => Charge::Failed(reason),
        ChargeState::Open(status) => Charge::Unknown(status),
    }
}

/// The provider's idempotency key of a payment: the same on every try.
fn charge_key(tenant: TenantId, payment_id: i64) -> String {
    format!("pay-{tenant}-{payment_id}")
}
