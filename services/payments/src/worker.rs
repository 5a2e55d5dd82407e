//! The provider worker (invariant I4: at most one charge per payment,
//! whatever crashes and retries happen; docs/adr/0007 and 0011).
//!
//! Many provider calls are in flight at once, up to `max_in_flight`, and no
//! tenant holds more than `tenant_share` of them, so one tenant's burst or a
//! slow customer cannot starve the others; a hung call holds only its own
//! slot until its timeout. Work is claimed in one statement that leases it
//! (`next_attempt_at = now() + lease`), so any number of workers, in one
//! process or many, share it and each payment has one caller at a time.
//! No transaction is open while the provider is called.
//!
//! The outcome rules (ADR 0011): an attempt with an unknown outcome is
//! retried with the same key and never followed by "failed" on a later 4xx
//! alone (the key is looked up instead); a 2xx that is not final is not a
//! failure; past the deadline the payment fails and whatever may have been
//! charged is refunded by key; a refund keeps its key for good.

use std::collections::HashMap;
use std::time::Duration;

use contracts::{aggregate, event};
use futures_util::future::join_all;
use reliability::failpoint::FailPoints;
use reliability::outbox::{self, NewEvent};
use reliability::service::ShutdownToken;
use reliability::trace::{self, TraceContext};
use reliability::{Error, Result, TenantId, TenantTx};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::task::JoinSet;

use crate::provider::{ChargeReply, ChargeState, Psp, RefundReply, Reply};

/// Fail point: the provider answered; nothing recorded yet.
pub const AFTER_PROVIDER: &str = "payments.after_provider";

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// How long one try may take before another worker may retry it.
    pub lease: Duration,
    pub poll_interval: Duration,
    /// Retry delay grows 200 ms × 2^n up to this.
    pub max_backoff: Duration,
    /// Provider calls in flight at once in this process.
    pub max_in_flight: usize,
    /// Of those, at most this many for one tenant.
    pub tenant_share: usize,
    /// A payment still undecided this long after it was recorded fails, and
    /// anything it may have charged is refunded.
    pub deadline: Duration,
}

impl Default for WorkerConfig {
    /// 30 s lease, 1 s poll (NOTIFY wakes it sooner), backoff up to 30 s;
    /// 64 calls in flight (~200 calls/s at 300 ms each), 16 per tenant;
    /// a 15-minute deadline.
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            max_in_flight: 64,
            tenant_share: 16,
            deadline: Duration::from_secs(15 * 60),
        }
    }
}

/// One claimed piece of work.
#[derive(Debug, Clone, Copy)]
enum Work {
    Charge(TenantId, i64),
    Refund(TenantId, i64),
}

impl Work {
    fn tenant(self) -> TenantId {
        match self {
            Self::Charge(t, _) | Self::Refund(t, _) => t,
        }
    }
}

#[derive(Clone)]
pub struct Worker {
    /// The runtime role: each item is handled under its own tenant.
    pool: PgPool,
    psp: Psp,
    config: WorkerConfig,
    fail_points: FailPoints,
}

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

/// What the record step does with a charge.
enum Charge {
    Captured(String),
    Failed(String),
    Unknown(String),
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

    /// Works until `shutdown`, woken by new payments and refunds: claims as
    /// much as there are free slots (within each tenant's share), starts
    /// each call, and claims again as calls finish.
    pub async fn run(&self, shutdown: ShutdownToken) -> Result<()> {
        let mut in_flight: JoinSet<(TenantId, Result<()>)> = JoinSet::new();
        let mut busy: HashMap<TenantId, usize> = HashMap::new();
        let mut listener: Option<PgListener> = None;
        while !shutdown.is_cancelled() {
            if listener.is_none() {
                listener = self.listen().await;
            }
            let free = self.config.max_in_flight.saturating_sub(in_flight.len());
            let claimed = match self.claim(free, &busy).await {
                Ok(work) => work,
                Err(e) => {
                    tracing::warn!(error = %e, "provider worker cannot claim work");
                    Vec::new()
                }
            };
            let took = claimed.len();
            for work in claimed {
                *busy.entry(work.tenant()).or_default() += 1;
                let worker = self.clone();
                in_flight.spawn(async move { (work.tenant(), worker.perform(work).await) });
            }
            metrics::gauge!("psp_calls_in_flight").set(in_flight.len() as f64);
            if took > 0 && took == free {
                // Every slot was filled: wait for one to free up.
            } else if took > 0 {
                continue; // there may be more due within the shares
            }
            let woke = async {
                match listener.as_mut() {
                    Some(l) => l.recv().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                    self.finished(done, &mut busy)?;
                    while let Some(done) = in_flight.try_join_next() {
                        self.finished(done, &mut busy)?;
                    }
                }
                ok = woke => if !ok { listener = None },
                () = tokio::time::sleep(self.config.poll_interval) => {}
            }
        }
        // Calls in flight end within the provider timeout; one cut short
        // leaves its lease, and the next try sends the same key.
        while let Some(done) = in_flight.join_next().await {
            self.finished(done, &mut busy)?;
        }
        Ok(())
    }

    async fn listen(&self) -> Option<PgListener> {
        let mut l = match PgListener::connect_with(&self.pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "provider worker cannot listen; polling only");
                return None;
            }
        };
        l.listen("payments_work").await.ok()?;
        Some(l)
    }

    fn finished(
        &self,
        done: std::result::Result<(TenantId, Result<()>), tokio::task::JoinError>,
        busy: &mut HashMap<TenantId, usize>,
    ) -> Result<()> {
        let (tenant, result) =
            done.map_err(|e| Error::Config(format!("provider call panicked: {e}")))?;
        if let Some(n) = busy.get_mut(&tenant) {
            *n -= 1;
            if *n == 0 {
                busy.remove(&tenant);
            }
        }
        match result {
            Err(e @ Error::FailPoint(_)) => Err(e),
            Err(e) => {
                tracing::warn!(tenant_id = %tenant, error = %e, "provider call not recorded; its lease will expire");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// One pass: claims everything due (up to `max_in_flight`), makes the
    /// calls side by side, and waits for them; how many it tried. For tests
    /// and one-shot tools.
    pub async fn process_due(&self) -> Result<usize> {
        let work = self
            .claim(self.config.max_in_flight, &HashMap::new())
            .await?;
        let results = join_all(work.iter().map(|&w| self.clone().perform(w))).await;
        for r in results {
            r?;
        }
        Ok(work.len())
    }

    /// Leases up to `free` due payments and refunds, round-robin across
    /// tenants, counting each tenant's calls already in flight.
    async fn claim(&self, free: usize, busy: &HashMap<TenantId, usize>) -> Result<Vec<Work>> {
        if free == 0 {
            return Ok(Vec::new());
        }
        let tenants: Vec<i64> = busy.keys().map(|t| t.get()).collect();
        let counts: Vec<i32> = busy.values().map(|&n| n as i32).collect();
        let claim = |sql: &'static str, max: usize| {
            sqlx::query_as::<_, (i64, i64)>(sql)
                .bind(max as i32)
                .bind(self.config.tenant_share as i32)
                .bind(&tenants)
                .bind(&counts)
                .bind(self.config.lease.as_secs_f64())
                .fetch_all(&self.pool)
        };
        let mut work = Vec::new();
        for (tenant, id) in
            claim("SELECT * FROM claim_due_payments($1, $2, $3, $4, $5)", free).await?
        {
            work.push(Work::Charge(tenant_id(tenant)?, id));
        }
        let left = free - work.len();
        if left > 0 {
            for (tenant, id) in
                claim("SELECT * FROM claim_due_refunds($1, $2, $3, $4, $5)", left).await?
            {
                work.push(Work::Refund(tenant_id(tenant)?, id));
            }
        }
        Ok(work)
    }

    async fn perform(self, work: Work) -> Result<()> {
        match work {
            Work::Charge(tenant, id) => self.charge(tenant, id).await,
            Work::Refund(tenant, id) => self.refund(tenant, id).await,
        }
    }

    fn backoff(&self, attempts: i32) -> Duration {
        let exp = u32::try_from(attempts.clamp(1, 16) - 1).unwrap_or(0);
        (Duration::from_millis(200) * 2u32.pow(exp)).min(self.config.max_backoff)
    }

    #[tracing::instrument(skip(self), fields(tenant_id = %tenant))]
    async fn charge(&self, tenant: TenantId, payment_id: i64) -> Result<()> {
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
        let ctx = p
            .traceparent
            .as_deref()
            .and_then(TraceContext::parse)
            .map_or_else(TraceContext::root, |t| t.child());
        if p.expired {
            return trace::scope(ctx, self.expire(tenant, payment_id, p)).await;
        }
        trace::scope(ctx, self.charge_leased(tenant, payment_id, p)).await
    }

    async fn charge_leased(&self, tenant: TenantId, payment_id: i64, p: Payment) -> Result<()> {
        let key = charge_key(tenant, payment_id);
        let body = json!({"amount_cents": p.amount_cents, "currency": p.currency, "customer_id": p.customer_id});
        let started = std::time::Instant::now();
        let reply: Reply<ChargeReply> = self.psp.post("/charges", &key, body).await;
        metrics::histogram!("psp_call_duration_seconds", "call" => "charge")
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
                Charge::Captured(_) => NewEvent::new(
                    aggregate::PAYMENT,
                    payment_id,
                    event::PAYMENT_CAPTURED,
                    &contracts::PaymentCaptured {
                        order_id,
                        payment_id,
                        amount_cents: p.amount_cents,
                        currency: p.currency,
                    },
                )?,
                Charge::Failed(reason) | Charge::Unknown(reason) => NewEvent::new(
                    aggregate::PAYMENT,
                    payment_id,
                    event::PAYMENT_FAILED,
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
                &NewEvent::new(
                    aggregate::PAYMENT,
                    payment_id,
                    event::PAYMENT_FAILED,
                    &failed,
                )?,
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

    #[tracing::instrument(skip(self), fields(tenant_id = %tenant))]
    async fn refund(&self, tenant: TenantId, refund_id: i64) -> Result<()> {
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
        let ctx = r
            .traceparent
            .as_deref()
            .and_then(TraceContext::parse)
            .map_or_else(TraceContext::root, |t| t.child());
        trace::scope(ctx, self.refund_leased(tenant, refund_id, r)).await
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

fn tenant_id(id: i64) -> Result<TenantId> {
    TenantId::new(id).map_err(|e| Error::Config(e.to_string()))
}
