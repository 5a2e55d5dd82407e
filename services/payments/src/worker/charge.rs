//! Charging one leased payment: the call, the outcome rules, the record,
//! and the deadline (docs/adr/0011).

use chrono::{DateTime, Utc};
use contracts::aggregate;
use reliability::outbox::{self, NewEvent};
use reliability::trace::{Kind, Span, TraceContext};
use reliability::{Result, TenantId, TenantTx};
use serde_json::json;

use super::{AFTER_PROVIDER, BEFORE_PROVIDER, BEFORE_RECORD_COMMIT, Worker};
use crate::provider::{ChargeReply, ChargeState, EXPIRED, Reply, refused_because};

/// A leased payment as the claim left it (`claim_due_work`).
pub(super) struct Payment {
    pub(super) order_id: i64,
    pub(super) customer_id: String,
    pub(super) amount_cents: i64,
    pub(super) currency: String,
    /// An earlier request under the key may have moved money.
    pub(super) outcome_unknown: bool,
    /// This attempt's lease end: the provider books nothing for its
    /// request after it.
    pub(super) not_after: DateTime<Utc>,
    /// Past the deadline, once an attempt made after it has not settled
    /// the payment: a worker outage alone fails nothing.
    pub(super) expired: bool,
    pub(super) traceparent: Option<String>,
}

/// What one attempt learned.
enum Charge {
    /// The provider's record under our key: money moved.
    Captured(String),
    /// The provider's record under our key: declined, nothing moved.
    Declined(String),
    /// This request was refused, and no earlier one is in doubt.
    Refused(String),
    /// This request was refused and the provider has nothing under the key:
    /// final once the last request in doubt is older than the grace window.
    NotFound(String),
    /// This request's own outcome is unknown (timeout, reset, 5xx, pending).
    Unknown(String),
    /// This request is answered, but an earlier one is still in doubt.
    InDoubt(String),
}

impl Worker {
    #[tracing::instrument(skip(self, p), fields(tenant_id = %tenant))]
    pub(super) async fn charge(
        &self,
        tenant: TenantId,
        payment_id: i64,
        attempt: i32,
        p: Payment,
    ) -> Result<()> {
        let parent = p.traceparent.as_deref().and_then(TraceContext::parse);
        let mut step = Span::start(
            contracts::source::PAYMENTS,
            "charge payment",
            Kind::Internal,
            parent,
        );
        step.set("tenant.id", tenant.get());
        step.set("payment.attempt", i64::from(attempt));
        match p.expired {
            true => step.run(self.expire(tenant, payment_id, attempt, p)).await,
            false => {
                step.run(self.charge_leased(tenant, payment_id, attempt, p))
                    .await
            }
        }
    }

    async fn charge_leased(
        &self,
        tenant: TenantId,
        payment_id: i64,
        attempt: i32,
        p: Payment,
    ) -> Result<()> {
        let key = charge_key(tenant, payment_id);
        let body = json!({"amount_cents": p.amount_cents, "currency": p.currency, "customer_id": p.customer_id});
        self.fail_points.check(BEFORE_PROVIDER)?;
        let started = std::time::Instant::now();
        let reply: Reply<ChargeReply> = self.psp.post("/charges", &key, p.not_after, body).await;
        metrics::histogram!(super::PSP_CALL_DURATION, "call" => "charge")
            .record(started.elapsed().as_secs_f64());
        self.fail_points.check(AFTER_PROVIDER)?;
        let outcome = match reply {
            Reply::Done(c) => settled(c, Charge::Unknown),
            Reply::Retry(e) => Charge::Unknown(e),
            // Past our lease: this request did nothing, and says nothing
            // of the payment. Asked again under a later lease.
            Reply::Refused(e) if refused_because(&e, EXPIRED) => Charge::InDoubt(e),
            Reply::Refused(e) if !p.outcome_unknown => Charge::Refused(e),
            // An earlier try may have charged: only the provider's record
            // under our key can tell "failed" from "charged".
            Reply::Refused(e) => match self.psp.lookup::<ChargeReply>("/charges", &key).await {
                Reply::Done(Some(c)) => settled(c, Charge::InDoubt),
                Reply::Done(None) => Charge::NotFound(e),
                Reply::Refused(l) | Reply::Retry(l) => {
                    Charge::InDoubt(format!("{e}; look-up by key: {l}"))
                }
            },
        };
        self.record_charge(tenant, payment_id, attempt, p, outcome)
            .await
    }

    async fn record_charge(
        &self,
        tenant: TenantId,
        payment_id: i64,
        attempt: i32,
        p: Payment,
        outcome: Charge,
    ) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        // The provider's own record decides whoever holds the lease; our
        // refusal or "nothing found" only while we hold it and no request
        // of ours can still land (a later claim may have sent another).
        let (status, charge_id, reason, guard) = match &outcome {
            Charge::Captured(id) => ("captured", Some(id.as_str()), None, "true"),
            Charge::Declined(why) => ("failed", None, Some(why.as_str()), "true"),
            Charge::Refused(why) => (
                "failed",
                None,
                Some(why.as_str()),
                "attempts = $5 AND NOT outcome_unknown",
            ),
            Charge::NotFound(why) => (
                "failed",
                None,
                Some(why.as_str()),
                "attempts = $5 AND (doubt_sent_at IS NULL OR doubt_sent_at < now() - make_interval(secs => $6))",
            ),
            Charge::Unknown(_) | Charge::InDoubt(_) => ("pending", None, None, "false"),
        };
        let moved = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE payments SET status = $2, provider_charge_id = $3, failure_reason = $4,
                    answered_attempts = greatest(answered_attempts, $5), updated_at = now()
             WHERE payment_id = $1 AND status = 'pending' AND ({guard})"
        )))
        .bind(payment_id)
        .bind(status)
        .bind(charge_id)
        .bind(reason)
        .bind(attempt)
        .bind(self.config.grace.as_secs_f64())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved == 0 {
            let (doubt, why) = match outcome {
                Charge::Unknown(why) => (true, why),
                Charge::InDoubt(why) | Charge::Refused(why) | Charge::NotFound(why) => (false, why),
                // Someone else recorded the provider's answer first.
                Charge::Captured(_) | Charge::Declined(_) => return Ok(tx.commit().await?),
            };
            tracing::warn!(payment_id, attempt, error = %why, "charge not settled; will ask again under the same key");
            self.not_settled(
                &mut tx,
                "payments",
                "payment_id",
                payment_id,
                attempt,
                doubt,
                &why,
            )
            .await?;
        } else {
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
                Charge::Declined(reason)
                | Charge::Refused(reason)
                | Charge::NotFound(reason)
                | Charge::Unknown(reason)
                | Charge::InDoubt(reason) => NewEvent::of(
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
        self.fail_points.check(BEFORE_RECORD_COMMIT)?;
        tx.commit().await?;
        Ok(())
    }

    /// Past the deadline: the payment fails (the order is cancelled), and if
    /// an earlier try may have charged, a refund of the whole amount by the
    /// charge's key is queued (it finds nothing to refund if nothing moved).
    async fn expire(
        &self,
        tenant: TenantId,
        payment_id: i64,
        attempt: i32,
        p: Payment,
    ) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let refund_by_key: Option<bool> = sqlx::query_scalar(
            "UPDATE payments SET status = 'failed', failure_reason = 'deadline_exceeded',
                    refunded_cents = CASE WHEN outcome_unknown THEN amount_cents ELSE 0 END,
                    answered_attempts = greatest(answered_attempts, $2), updated_at = now()
             WHERE payment_id = $1 AND status = 'pending' AND attempts = $2
             RETURNING outcome_unknown",
        )
        .bind(payment_id)
        .bind(attempt)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(refund_by_key) = refund_by_key {
            if refund_by_key {
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
                refund_by_key,
                "payment ran out of time"
            );
        }
        self.fail_points.check(BEFORE_RECORD_COMMIT)?;
        tx.commit().await?;
        Ok(())
    }
}

/// The provider's record of a charge: final, or not yet (`open`).
fn settled(c: ChargeReply, open: fn(String) -> Charge) -> Charge {
    match c.state() {
        ChargeState::Captured(id) => Charge::Captured(id),
        ChargeState::Failed(reason) => Charge::Declined(reason),
        ChargeState::Open(status) => open(status),
    }
}

/// The provider's idempotency key of a payment: the same on every try.
pub(crate) fn charge_key(tenant: TenantId, payment_id: i64) -> String {
    contracts::provider::charge_key(tenant.get(), payment_id)
}
