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
//! The outcome rules (ADR 0011): the claim that leases a payment or refund
//! is the durable record that a request may now leave, so an attempt whose
//! answer was never recorded (a crash, a failed record) is as unknown as a
//! timeout. An unknown outcome is retried with the same key and never
//! followed by "failed" on a later 4xx alone: the key is looked up, and a
//! look-up that finds nothing is final only once the provider's processing
//! bound (`grace`) has passed since the last request in doubt. A 2xx that
//! is not final is not a failure; past the deadline (counted from the first
//! attempt) the payment fails and whatever may have been charged is
//! refunded by key; a refund keeps its key for good.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use reliability::failpoint::FailPoints;
use reliability::metrics::{Kind, Metric};
use reliability::supervise::Backoff;
use reliability::{Error, Result, TenantId, TenantTx};
use service_kit::service::ShutdownToken;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::task::JoinSet;

use self::claim::Work;
use crate::provider::Psp;

mod charge;
mod claim;
mod refund;

/// Fail point: the attempt is claimed; no request has left yet.
pub const BEFORE_PROVIDER: &str = "payments.before_provider";
/// Fail point: the provider answered; nothing recorded yet.
pub const AFTER_PROVIDER: &str = "payments.after_provider";
/// Fail point: the answer's record transaction fails before it commits.
pub const BEFORE_RECORD_COMMIT: &str = "payments.before_record_commit";

pub const PSP_CALLS_IN_FLIGHT: &str = "psp_calls_in_flight";
pub const PSP_CALL_DURATION: &str = "psp_call_duration_seconds";
pub const REFUNDS_FAILED: &str = "payments_refunds_failed_total";

/// The worker's own metrics (the library's are in `reliability::metrics`).
pub const METRICS: &[Metric] = &[
    Metric {
        name: PSP_CALLS_IN_FLIGHT,
        kind: Kind::Gauge,
        labels: &[],
        help: "Provider calls in flight in this process.",
    },
    Metric {
        name: PSP_CALL_DURATION,
        kind: Kind::Histogram,
        labels: &["call"],
        help: "Provider call latency (call=\"charge\").",
    },
    Metric {
        name: REFUNDS_FAILED,
        kind: Kind::Counter,
        labels: &["reason"],
        help: "Refunds that ended failed, their amount given back to the payment (reason=\"refused\"|\"charge_failed\"|\"nothing_charged\"|\"failed_at_provider\"|\"no_room_left\").",
    },
    Metric {
        name: crate::reconcile::MISMATCHES,
        kind: Kind::Counter,
        labels: &["kind"],
        help: "Differences reconciliation found between the provider's lists and our payments and refunds.",
    },
    Metric {
        name: crate::reconcile::REPAIRS,
        kind: Kind::Counter,
        labels: &["kind"],
        help: "Of those, the ones reconciliation repaired (a refund by key, a refund marked succeeded).",
    },
    Metric {
        name: crate::reconcile::LAST_SUCCESS,
        kind: Kind::Gauge,
        labels: &[],
        help: "When reconciliation last read the provider's lists through.",
    },
];

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
    /// A payment still undecided this long after its first attempt fails,
    /// once an attempt made after that has not settled it either, and
    /// anything it may have charged is refunded.
    pub deadline: Duration,
    /// The provider's processing bound: a look-up by key that finds nothing
    /// is final only for requests sent longer ago than this.
    pub grace: Duration,
}

impl Default for WorkerConfig {
    /// 30 s lease, 1 s poll (NOTIFY wakes it sooner), backoff up to 30 s;
    /// 64 calls in flight (~200 calls/s at 300 ms each), 16 per tenant;
    /// a 15-minute deadline; a look-up finding nothing is final after 120 s.
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            max_in_flight: 64,
            tenant_share: 16,
            deadline: Duration::from_secs(15 * 60),
            grace: Duration::from_secs(120),
        }
    }
}

#[derive(Clone)]
pub struct Worker {
    /// The runtime role: each item is handled under its own tenant.
    pool: PgPool,
    /// Where the wake-up LISTEN runs: a session of its own, never through
    /// a transaction-mode pooler (docs/adr/0026). The runtime pool by
    /// default.
    listen: PgPool,
    psp: Psp,
    config: WorkerConfig,
    fail_points: FailPoints,
}

impl Worker {
    pub fn new(pool: PgPool, psp: Psp, config: WorkerConfig, fail_points: FailPoints) -> Self {
        Self {
            listen: pool.clone(),
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
        // While the database is away: retries spread out, not every poll.
        let (mut claims, mut listens) = (Backoff::default(), Backoff::default());
        let mut listen_at = Instant::now();
        while !shutdown.is_cancelled() {
            if listener.is_none() && Instant::now() >= listen_at {
                listener = self.listen().await;
                match listener {
                    Some(_) => listens.reset(),
                    None => listen_at = Instant::now() + listens.next_delay(),
                }
            }
            let free = self.config.max_in_flight.saturating_sub(in_flight.len());
            let mut idle = self.config.poll_interval;
            let claimed = match self.claim(free, &busy).await {
                Ok(work) => {
                    claims.reset();
                    work
                }
                Err(e) => {
                    idle = claims.next_delay();
                    tracing::warn!(error = %e, retry_in = ?idle, "provider worker cannot claim work");
                    Vec::new()
                }
            };
            let took = claimed.len();
            for work in claimed {
                *busy.entry(work.tenant()).or_default() += 1;
                let worker = self.clone();
                in_flight.spawn(async move { (work.tenant(), worker.perform(work).await) });
            }
            metrics::gauge!(PSP_CALLS_IN_FLIGHT).set(in_flight.len() as f64);
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
                () = tokio::time::sleep(idle) => {}
            }
        }
        // Calls in flight end within the provider timeout; one cut short
        // leaves its lease, and the next try sends the same key.
        while let Some(done) = in_flight.join_next().await {
            self.finished(done, &mut busy)?;
        }
        Ok(())
    }

    /// Listens for new work on `pool` (the service's relay pool, which
    /// always connects direct) instead of the runtime pool.
    pub fn listen_on(mut self, pool: PgPool) -> Self {
        self.listen = pool;
        self
    }

    async fn listen(&self) -> Option<PgListener> {
        let mut l = match PgListener::connect_with(&self.listen).await {
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
        let (tenant, result) = done.map_err(|source| Error::Panicked {
            task: "provider call".into(),
            source,
        })?;
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
        let tried = work.len();
        let results = join_all(work.into_iter().map(|w| self.clone().perform(w))).await;
        for r in results {
            r?;
        }
        Ok(tried)
    }

    async fn perform(self, work: Work) -> Result<()> {
        match work {
            Work::Charge(tenant, id, attempt, leased) => {
                self.charge(tenant, id, attempt, *leased).await
            }
            Work::Refund(tenant, id, attempt) => self.refund(tenant, id, attempt).await,
        }
    }

    /// Records an attempt that settled nothing: its answer is in; if its
    /// own outcome is unknown, its request joins those in doubt; the next
    /// try comes after a backoff if this attempt still holds the lease.
    #[allow(clippy::too_many_arguments)]
    async fn not_settled(
        &self,
        tx: &mut TenantTx,
        table: &'static str,
        id_column: &'static str,
        id: i64,
        attempt: i32,
        doubt: bool,
        why: &str,
    ) -> Result<()> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET answered_attempts = greatest(answered_attempts, $2),
                    doubt_sent_at = CASE WHEN $3 THEN greatest(doubt_sent_at, sent_at) ELSE doubt_sent_at END,
                    outcome_unknown = outcome_unknown OR $3, last_error = $4,
                    next_attempt_at = CASE WHEN attempts = $2 THEN now() + make_interval(secs => $5)
                                           ELSE next_attempt_at END,
                    updated_at = now()
             WHERE {id_column} = $1 AND status = 'pending'"
        )))
        .bind(id)
        .bind(attempt)
        .bind(doubt)
        .bind(why)
        .bind(self.backoff(attempt).as_secs_f64())
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    fn backoff(&self, attempts: i32) -> Duration {
        let exp = u32::try_from(attempts.clamp(1, 16) - 1).unwrap_or(0);
        (Duration::from_millis(200) * 2u32.pow(exp)).min(self.config.max_backoff)
    }
}

fn tenant_id(id: i64) -> Result<TenantId> {
    Ok(TenantId::new(id)?)
}
