//! The provider worker (invariant I4: at most one charge per payment,
//! whatever crashes and retries happen).
//!
//! For each due payment (or refund): take a lease in a short transaction
//! (`next_attempt_at = now() + lease`), commit, call the provider with a key
//! derived from the payment (`pay-<tenant>-<payment_id>`, the same on every
//! try), then record the answer in a new transaction. No transaction is open
//! while the provider is called. If the worker dies between the provider's
//! answer and the record, the lease runs out and the next try sends the same
//! key: the provider answers with the charge it already made.

use std::time::Duration;

use contracts::{aggregate, event};
use reliability::failpoint::FailPoints;
use reliability::outbox::{self, NewEvent};
use reliability::service::ShutdownToken;
use reliability::trace::{self, TraceContext};
use reliability::{Error, Result, TenantId, TenantTx};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgListener;

/// Fail point: the provider answered; nothing recorded yet.
pub const AFTER_PROVIDER: &str = "payments.after_provider";

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// How long one try may take before another worker may retry it.
    pub lease: Duration,
    pub poll_interval: Duration,
    /// Retry delay grows 200 ms × 2^n up to this.
    pub max_backoff: Duration,
    pub batch: i32,
}

impl Default for WorkerConfig {
    /// 30 s lease, 1 s poll (NOTIFY wakes it sooner), backoff up to 30 s.
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            batch: 50,
        }
    }
}

/// The payment provider's HTTP API.
#[derive(Clone)]
pub struct Psp {
    http: reqwest::Client,
    base_url: String,
}

/// What a provider call came to.
enum Reply<T> {
    Done(T),
    /// A 4xx: asking again will not help.
    Refused(String),
    /// Timeout, connection error, 5xx: ask again later with the same key.
    Retry(String),
}

#[derive(Deserialize)]
struct ChargeReply {
    charge_id: String,
    status: String,
}

#[derive(Deserialize)]
struct RefundReply {
    refund_id: String,
}

impl Psp {
    pub fn new(base_url: &str, timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .expect("an HTTP client with a timeout");
        Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
        }
    }

    async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        key: &str,
        body: serde_json::Value,
    ) -> Reply<T> {
        let sent = self
            .http
            .post(format!("{}{path}", self.base_url))
            .header("X-Idempotency-Key", key)
            .json(&body)
            .send()
            .await;
        match sent {
            Err(e) => Reply::Retry(format!("provider unreachable: {e}")),
            Ok(resp) => {
                let status = resp.status();
                if status.is_success() {
                    match resp.json().await {
                        Ok(reply) => Reply::Done(reply),
                        Err(e) => Reply::Retry(format!("provider reply unreadable: {e}")),
                    }
                } else if status.is_server_error() || matches!(status.as_u16(), 408 | 425 | 429) {
                    Reply::Retry(format!("provider answered {status}"))
                } else {
                    Reply::Refused(format!("provider answered {status}"))
                }
            }
        }
    }
}

pub struct Worker {
    /// The runtime role: each item is handled under its own tenant.
    pool: PgPool,
    psp: Psp,
    config: WorkerConfig,
    fail_points: FailPoints,
}

#[derive(sqlx::FromRow)]
struct LeasedPayment {
    order_id: i64,
    customer_id: String,
    amount_cents: i64,
    currency: String,
    attempts: i32,
    traceparent: Option<String>,
}

#[derive(sqlx::FromRow)]
struct LeasedRefund {
    payment_id: i64,
    order_id: i64,
    amount_cents: i64,
    provider_charge_id: Option<String>,
    attempts: i32,
    traceparent: Option<String>,
}

impl Worker {
    pub fn new(pool: PgPool, psp: Psp, config: WorkerConfig, fail_points: FailPoints) -> Self {
        Self {
            pool,
            psp,
            config,
            fail_points,
        }
    }

    /// Works until `shutdown`, woken by new payments and refunds.
    pub async fn run(&self, shutdown: ShutdownToken) -> Result<()> {
        while !shutdown.is_cancelled() {
            let mut listener = match PgListener::connect_with(&self.pool).await {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::warn!(error = %e, "provider worker cannot listen; polling only");
                    None
                }
            };
            if let Some(l) = listener.as_mut() {
                let _ = l.listen("payments_work").await;
            }
            loop {
                match self.process_due().await {
                    Ok(n) if n > 0 => continue,
                    Ok(_) => {}
                    Err(e @ Error::FailPoint(_)) => return Err(e),
                    Err(e) => tracing::warn!(error = %e, "provider worker pass failed"),
                }
                let woke = async {
                    match listener.as_mut() {
                        Some(l) => l.recv().await.is_ok(),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(()),
                    ok = woke => if !ok { break },
                    () = tokio::time::sleep(self.config.poll_interval) => {}
                }
            }
        }
        Ok(())
    }

    /// One pass over due payments and refunds; how many it tried.
    pub async fn process_due(&self) -> Result<usize> {
        let payments: Vec<(i64, i64)> =
            sqlx::query_as("SELECT tenant_id, payment_id FROM due_payments($1)")
                .bind(self.config.batch)
                .fetch_all(&self.pool)
                .await?;
        let refunds: Vec<(i64, i64)> =
            sqlx::query_as("SELECT tenant_id, refund_id FROM due_refunds($1)")
                .bind(self.config.batch)
                .fetch_all(&self.pool)
                .await?;
        for &(tenant, id) in &payments {
            self.charge(tenant_id(tenant)?, id).await?;
        }
        for &(tenant, id) in &refunds {
            self.refund(tenant_id(tenant)?, id).await?;
        }
        Ok(payments.len() + refunds.len())
    }

    fn backoff(&self, attempts: i32) -> Duration {
        let exp = u32::try_from(attempts.clamp(1, 16) - 1).unwrap_or(0);
        (Duration::from_millis(200) * 2u32.pow(exp)).min(self.config.max_backoff)
    }

    #[tracing::instrument(skip(self), fields(tenant_id = %tenant))]
    async fn charge(&self, tenant: TenantId, payment_id: i64) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let leased: Option<LeasedPayment> = sqlx::query_as(
            "UPDATE payments SET attempts = attempts + 1, next_attempt_at = now() + make_interval(secs => $2), updated_at = now()
             WHERE payment_id = $1 AND status = 'pending' AND next_attempt_at <= now()
             RETURNING order_id, customer_id, amount_cents, currency, attempts, traceparent",
        )
        .bind(payment_id)
        .bind(self.config.lease.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        let Some(p) = leased else { return Ok(()) }; // another worker has it
        let ctx = p
            .traceparent
            .as_deref()
            .and_then(TraceContext::parse)
            .map_or_else(TraceContext::root, |t| t.child());
        trace::scope(ctx, self.charge_leased(tenant, payment_id, p)).await
    }

    async fn charge_leased(
        &self,
        tenant: TenantId,
        payment_id: i64,
        p: LeasedPayment,
    ) -> Result<()> {
        let key = format!("pay-{tenant}-{payment_id}");
        let body = json!({"amount_cents": p.amount_cents, "currency": p.currency, "customer_id": p.customer_id});
        let reply: Reply<ChargeReply> = self.psp.post("/charges", &key, body).await;
        self.fail_points.check(AFTER_PROVIDER)?;

        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let outcome = match reply {
            Reply::Done(c) if c.status == "succeeded" => Ok(c.charge_id),
            Reply::Done(c) => Err(c.status),
            Reply::Refused(e) => Err(e),
            Reply::Retry(e) => {
                tracing::warn!(payment_id, attempts = p.attempts, error = %e, "charge not settled; will retry with the same key");
                sqlx::query(
                    "UPDATE payments SET next_attempt_at = now() + make_interval(secs => $2), last_error = $3, updated_at = now()
                     WHERE payment_id = $1 AND status = 'pending'",
                )
                .bind(payment_id)
                .bind(self.backoff(p.attempts).as_secs_f64())
                .bind(&e)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                return Ok(());
            }
        };
        let (status, charge_id, reason) = match &outcome {
            Ok(charge_id) => ("captured", Some(charge_id.as_str()), None),
            Err(reason) => ("failed", None, Some(reason.as_str())),
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
            let event = match outcome {
                Ok(_) => NewEvent::new(
                    aggregate::PAYMENT,
                    payment_id,
                    event::PAYMENT_CAPTURED,
                    &contracts::PaymentCaptured {
                        order_id: p.order_id,
                        payment_id,
                        amount_cents: p.amount_cents,
                        currency: p.currency,
                    },
                )?,
                Err(reason) => NewEvent::new(
                    aggregate::PAYMENT,
                    payment_id,
                    event::PAYMENT_FAILED,
                    &contracts::PaymentFailed {
                        order_id: p.order_id,
                        payment_id,
                        reason,
                    },
                )?,
            };
            outbox::enqueue(&mut tx, &event).await?;
            tracing::info!(payment_id, order_id = p.order_id, status, "payment settled");
        }
        tx.commit().await?;
        Ok(())
    }

    #[tracing::instrument(skip(self), fields(tenant_id = %tenant))]
    async fn refund(&self, tenant: TenantId, refund_id: i64) -> Result<()> {
        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        let leased: Option<LeasedRefund> = sqlx::query_as(
            "UPDATE refunds r SET attempts = r.attempts + 1, next_attempt_at = now() + make_interval(secs => $2), updated_at = now()
             FROM payments p
             WHERE r.refund_id = $1 AND r.status = 'pending' AND r.next_attempt_at <= now() AND p.payment_id = r.payment_id
             RETURNING r.payment_id, p.order_id, r.amount_cents, p.provider_charge_id, r.attempts, r.traceparent",
        )
        .bind(refund_id)
        .bind(self.config.lease.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        let Some(r) = leased else { return Ok(()) };
        let ctx = r
            .traceparent
            .as_deref()
            .and_then(TraceContext::parse)
            .map_or_else(TraceContext::root, |t| t.child());
        trace::scope(ctx, self.refund_leased(tenant, refund_id, r)).await
    }

    async fn refund_leased(&self, tenant: TenantId, refund_id: i64, r: LeasedRefund) -> Result<()> {
        let key = format!("refund-{tenant}-{refund_id}");
        let body = json!({"charge_id": r.provider_charge_id, "amount_cents": r.amount_cents});
        let reply: Reply<RefundReply> = self.psp.post("/refunds", &key, body).await;
        self.fail_points.check(AFTER_PROVIDER)?;

        let mut tx = TenantTx::begin(&self.pool, tenant).await?;
        match reply {
            Reply::Done(done) => {
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
                        &NewEvent::new(
                            aggregate::PAYMENT,
                            r.payment_id,
                            event::REFUND_ISSUED,
                            &issued,
                        )?,
                    )
                    .await?;
                }
            }
            Reply::Refused(e) => {
                // Give the amount back so it can be refunded another way.
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
            Reply::Retry(e) => {
                sqlx::query(
                    "UPDATE refunds SET next_attempt_at = now() + make_interval(secs => $2), last_error = $3, updated_at = now()
                     WHERE refund_id = $1 AND status = 'pending'",
                )
                .bind(refund_id)
                .bind(self.backoff(r.attempts).as_secs_f64())
                .bind(&e)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }
}

fn tenant_id(id: i64) -> Result<TenantId> {
    TenantId::new(id).map_err(|e| Error::Config(e.to_string()))
}
