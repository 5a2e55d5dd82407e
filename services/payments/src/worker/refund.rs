//! Refunding one leased refund with its own key, for good (docs/adr/0011):
//! the same rules as a charge, and a refund by the charge's key that finds
//! no charge waits out the charge's own requests in doubt.

use chrono::{DateTime, Utc};
use contracts::aggregate;
use reliability::outbox::{self, NewEvent};
use reliability::trace::{Kind, Span, TraceContext};
use reliability::{Result, TenantId, TenantTx};
use serde_json::json;

use super::{AFTER_PROVIDER, BEFORE_PROVIDER, BEFORE_RECORD_COMMIT, Worker};
use crate::provider::{ChargeReply, ChargeState, EXPIRED, RefundReply, Reply, refused_because};

#[derive(sqlx::FromRow)]
struct Refund {
    payment_id: i64,
    order_id: i64,
    amount_cents: i64,
    provider_charge_id: Option<String>,
    charge_key: Option<String>,
    outcome_unknown: bool,
    traceparent: Option<String>,
    /// This attempt's lease end: the provider books nothing for its
    /// request after it.
    not_after: DateTime<Utc>,
}

/// A final failure of a kind the provider's answer alone decides.
fn failed(reason: &'static str, why: &str) -> Outcome {
    Outcome::Failed {
        why: why.to_owned(),
        by_key_not_found: false,
        reason,
    }
}

/// What one attempt learned.
enum Outcome {
    Succeeded(String),
    /// Nothing was or will be refunded under our key; `by_key_not_found`:
    /// the charge's key had nothing either, final only once the charge's
    /// own requests in doubt are older than the grace window.
    Failed {
        why: String,
        by_key_not_found: bool,
        /// The label of `payments_refunds_failed_total`.
        reason: &'static str,
    },
    /// This request's outcome is unknown.
    Unknown(String),
    /// Answered, but not settled: ask again later.
    InDoubt(String),
}

impl Worker {
    #[tracing::instrument(skip(self), fields(tenant_id = %tenant))]
    pub(super) async fn refund(
        &self,
        tenant: TenantId,
        refund_id: i64,
        attempt: i32,
    ) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let leased: Option<Refund> = sqlx::query_as(
            "SELECT r.payment_id, p.order_id, r.amount_cents, p.provider_charge_id, r.charge_key,
                    r.outcome_unknown, r.traceparent, r.sent_at + make_interval(secs => $3) AS not_after
             FROM refunds r JOIN payments p ON p.payment_id = r.payment_id
             WHERE r.refund_id = $1 AND r.status = 'pending' AND r.attempts = $2",
        )
        .bind(refund_id)
        .bind(attempt)
        .bind(self.config.lease.as_secs_f64())
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
        step.run(self.refund_leased(tenant, refund_id, attempt, r))
            .await
    }

    async fn refund_leased(
        &self,
        tenant: TenantId,
        refund_id: i64,
        attempt: i32,
        r: Refund,
    ) -> Result<()> {
        // The same key on every try, for good: a refund whose outcome was
        // unknown is never issued again under another key.
        let key = contracts::provider::refund_key(tenant.get(), refund_id);
        let body = match &r.charge_key {
            Some(charge_key) => json!({"charge_key": charge_key, "amount_cents": r.amount_cents}),
            None => json!({"charge_id": r.provider_charge_id, "amount_cents": r.amount_cents}),
        };
        self.fail_points.check(BEFORE_PROVIDER)?;
        let reply: Reply<RefundReply> = self.psp.post("/refunds", &key, r.not_after, body).await;
        let outcome = match reply {
            Reply::Done(done) if done.status == "succeeded" => Outcome::Succeeded(done.refund_id),
            // A provider that fails refunds after accepting them answers
            // the same failed refund under our key on every try: final.
            Reply::Done(done) if done.status == "failed" => failed(
                "failed_at_provider",
                "the provider failed the refund it had accepted",
            ),
            Reply::Done(RefundReply { status, .. }) | Reply::Retry(status) => {
                Outcome::Unknown(status)
            }
            // Past our lease: this request did nothing; asked again.
            Reply::Refused(e) if refused_because(&e, EXPIRED) => Outcome::InDoubt(e),
            Reply::Refused(e) => self.refused(&key, e, &r).await,
        };
        self.fail_points.check(AFTER_PROVIDER)?;
        self.record_refund(tenant, refund_id, attempt, r, outcome)
            .await
    }

    /// A 4xx to this request: what the provider holds under our key, and
    /// under the charge's key, decides.
    async fn refused(&self, key: &str, e: String, r: &Refund) -> Outcome {
        if r.outcome_unknown {
            match self.psp.lookup::<RefundReply>("/refunds", key).await {
                Reply::Done(Some(done)) if done.status == "succeeded" => {
                    return Outcome::Succeeded(done.refund_id);
                }
                Reply::Done(Some(done)) if done.status == "failed" => {
                    return failed(
                        "failed_at_provider",
                        "the provider failed the refund it had accepted",
                    );
                }
                Reply::Done(Some(RefundReply { status, .. })) => return Outcome::InDoubt(status),
                Reply::Done(None) => {}
                Reply::Refused(l) | Reply::Retry(l) => {
                    return Outcome::InDoubt(format!("{e}; look-up by key: {l}"));
                }
            }
        }
        let Some(charge_key) = &r.charge_key else {
            return Outcome::Failed {
                why: e,
                by_key_not_found: false,
                reason: "refused",
            };
        };
        // A refund by the charge's key: a charge still pending, or one that
        // lands late, is refunded once it is there.
        match self.psp.lookup::<ChargeReply>("/charges", charge_key).await {
            Reply::Done(Some(c)) => match c.state() {
                ChargeState::Failed(status) => Outcome::Failed {
                    why: format!("{e}; the charge is {status}"),
                    by_key_not_found: false,
                    reason: "charge_failed",
                },
                // Nothing under our key, and a captured charge with no
                // room left for it: no try will ever fit.
                ChargeState::Captured(_) if refused_because(&e, "amount_exceeds_charge") => {
                    failed("no_room_left", &e)
                }
                ChargeState::Captured(_) | ChargeState::Open(_) => Outcome::InDoubt(e),
            },
            Reply::Done(None) => Outcome::Failed {
                why: format!("{e}; nothing charged under {charge_key}"),
                by_key_not_found: true,
                reason: "nothing_charged",
            },
            Reply::Refused(l) | Reply::Retry(l) => {
                Outcome::InDoubt(format!("{e}; charge look-up by key: {l}"))
            }
        }
    }

    async fn record_refund(
        &self,
        tenant: TenantId,
        refund_id: i64,
        attempt: i32,
        r: Refund,
        outcome: Outcome,
    ) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let unsettled = match outcome {
            Outcome::Succeeded(provider_refund_id) => {
                let moved = sqlx::query(
                    "UPDATE refunds SET status = 'succeeded', provider_refund_id = $2,
                            answered_attempts = greatest(answered_attempts, $3), updated_at = now()
                     WHERE refund_id = $1 AND status = 'pending'",
                )
                .bind(refund_id)
                .bind(&provider_refund_id)
                .bind(attempt)
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
                None
            }
            // Final, and nothing moved under our key: give the amount back
            // so it can be refunded another way. Only while we hold the
            // lease and no request under either key can still land.
            Outcome::Failed {
                why,
                by_key_not_found,
                reason,
            } => {
                crate::refunded::lock(&mut tx, r.payment_id).await?;
                let failed = sqlx::query(
                    "UPDATE refunds r SET status = 'failed', last_error = $2,
                            answered_attempts = greatest(answered_attempts, $3), updated_at = now()
                     WHERE r.refund_id = $1 AND r.status = 'pending' AND r.attempts = $3
                       AND (r.doubt_sent_at IS NULL OR r.doubt_sent_at < now() - make_interval(secs => $5))
                       AND NOT ($4 AND EXISTS (
                           SELECT 1 FROM payments p WHERE p.payment_id = r.payment_id
                           AND p.doubt_sent_at >= now() - make_interval(secs => $5)))",
                )
                .bind(refund_id)
                .bind(&why)
                .bind(attempt)
                .bind(by_key_not_found)
                .bind(self.config.grace.as_secs_f64())
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if failed == 1 {
                    crate::refunded::recount(&mut tx, r.payment_id).await?;
                    metrics::counter!(super::REFUNDS_FAILED, "reason" => reason).increment(1);
                }
                (failed == 0).then_some((false, why))
            }
            Outcome::Unknown(why) => Some((true, why)),
            Outcome::InDoubt(why) => Some((false, why)),
        };
        if let Some((doubt, why)) = unsettled {
            tracing::warn!(refund_id, attempt, error = %why, "refund not settled; will ask again under the same key");
            self.not_settled(
                &mut tx,
                "refunds",
                "refund_id",
                refund_id,
                attempt,
                doubt,
                &why,
            )
            .await?;
        }
        self.fail_points.check(BEFORE_RECORD_COMMIT)?;
        tx.commit().await?;
        Ok(())
    }
}
