//! Admission that follows the pipeline (docs/adr/0027): a write route whose
//! work is decided later (an order, by the saga) refuses a tenant whose work
//! in flight has reached its bound, with a `Retry-After` from the rate at
//! which that tenant's work is being decided. It is asked once the
//! Idempotency-Key is looked up and claimed: a retry of accepted work is
//! answered from its stored response at the bound, and a refusal rolls the
//! claim back, so the key stays free. The front door then accepts what the
//! pipeline decides, instead of an unbounded backlog.
//!
//! Each serving process keeps, per tenant, the last count the service's own
//! query returned (refreshed at most every `refresh`, by one request while
//! the others use the count they have) plus what it admitted since. Across
//! N `serve` replicas a tenant may overshoot its bound by what they admit
//! within one refresh: no shared counter on the hot path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use reliability::{Error, Result, TenantId};

/// The longest `Retry-After` we answer: a tenant whose work is not being
/// decided at all (a stalled pipeline) asks again within a minute.
pub const MAX_RETRY_AFTER_SECS: u32 = 60;

pub const ADMITTED: &str = "admission_admitted_total";
pub const REFUSED: &str = "admission_refused_total";
/// Refreshes of a tenant's count that failed (the request was admitted).
pub const UNKNOWN: &str = "admission_unknown_total";
/// Work undecided past [`AdmissionLimits::stuck_after`], of the tenants
/// this process counted within [`STUCK_SEEN_WITHIN`].
pub const STUCK: &str = "admission_stuck_work";

/// How long work may stay undecided before it is stuck, not in flight: it
/// leaves the count, so that work a pipeline will never decide (its events
/// dead-lettered) does not lock its tenant out, and shows in `status` and
/// in [`STUCK`]. Five minutes: the saga decides in seconds, and its
/// slowest honest path (a provider look-up's grace, a retried payment)
/// in about a minute.
pub const STUCK_AFTER_SECS: u64 = 300;

/// Under a derived bound ([`AdmissionLimits::horizon`]), what a tenant may
/// have in flight before any of its work has been decided: its first burst.
pub const DERIVED_FLOOR: u32 = 32;

/// The tenants [`STUCK`] sums: those counted this recently.
pub const STUCK_SEEN_WITHIN: Duration = Duration::from_secs(60);

/// The bound per tenant and how fresh the count must be.
#[derive(Debug, Clone)]
pub struct AdmissionLimits {
    /// Work in flight a tenant may have; 0: no bound.
    pub default: u32,
    /// Tenants with a bound of their own.
    pub per_tenant: HashMap<TenantId, u32>,
    pub refresh: Duration,
    /// Past this age, undecided work is stuck: not counted in flight.
    pub stuck_after: Duration,
    /// A bound derived from the pipeline: a tenant may have in flight what
    /// is being decided of its work in this long (its drain rate times the
    /// horizon), at least [`DERIVED_FLOOR`] and at most its fixed bound.
    /// Zero: the fixed bound alone.
    pub horizon: Duration,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self {
            default: 0,
            per_tenant: HashMap::new(),
            refresh: Duration::from_millis(500),
            stuck_after: Duration::from_secs(STUCK_AFTER_SECS),
            horizon: Duration::ZERO,
        }
    }
}

impl AdmissionLimits {
    /// `per_tenant` is `tenant=bound,...` (e.g. `7=100,9=5000`).
    pub fn parse(default: u32, per_tenant: &str, refresh: Duration) -> Result<Self> {
        let mut map = HashMap::new();
        for item in per_tenant
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let parsed = item.split_once('=').and_then(|(t, b)| {
                Some((
                    TenantId::new(t.trim().parse().ok()?).ok()?,
                    b.trim().parse().ok()?,
                ))
            });
            let (tenant, bound) = parsed.ok_or_else(|| {
                Error::Config(format!(
                    "ADMISSION_TENANT_MAX_IN_FLIGHT: expected tenant=bound, got {item:?}"
                ))
            })?;
            map.insert(tenant, bound);
        }
        Ok(Self {
            default,
            per_tenant: map,
            refresh,
            ..Self::default()
        })
    }

    pub fn bound(&self, tenant: TenantId) -> u32 {
        self.per_tenant
            .get(&tenant)
            .copied()
            .unwrap_or(self.default)
    }
}

/// What one process knows of one tenant.
#[derive(Debug, Default)]
struct Seen {
    /// Work in flight at the last count, and the service's mark of the
    /// newest work then (the query counts what was created after it).
    in_flight: i64,
    /// Work stuck at the last count.
    stuck: i64,
    mark: Option<i64>,
    at: Option<Instant>,
    /// Work decided per second, smoothed over the counts.
    drain_per_sec: f64,
    /// The first count, or the last one that found work decided.
    progress_at: Option<Instant>,
    /// Admitted by this process since the last count.
    admitted: i64,
    refreshing: bool,
}

/// The gate of one route: the service's query of a tenant's backlog, run
/// in the tenant's own transaction (so RLS applies) with `$1` the mark the
/// previous count returned (NULL the first time: nothing is "created
/// since") and `$2` [`AdmissionLimits::stuck_after`] in seconds
/// (`float8`), returning `(in_flight, created_since_mark, mark, stuck)` as
/// `bigint`s: work undecided for less than `$2`, and for longer. The
/// counts must come from an index: they run on the request path.
/// Layer it on the route (`route_layer(Extension(backlog))`); the
/// `Idempotent` extractor asks it once the key is claimed fresh.
#[derive(Clone)]
pub struct Backlog {
    limits: Arc<AdmissionLimits>,
    pool: PgPool,
    sql: &'static str,
    tenants: Arc<Mutex<HashMap<TenantId, Seen>>>,
}

impl Backlog {
    pub fn new(pool: PgPool, limits: AdmissionLimits, sql: &'static str) -> Self {
        Self {
            limits: Arc::new(limits),
            pool,
            sql,
            tenants: Arc::default(),
        }
    }

    /// Admits, or says how many seconds to wait.
    pub async fn admit(&self, tenant: TenantId) -> std::result::Result<(), u32> {
        let bound = self.limits.bound(tenant);
        if bound == 0 {
            return Ok(());
        }
        let mark = {
            let mut tenants = self.tenants.lock().expect("admission state");
            let seen = tenants.entry(tenant).or_default();
            let stale = seen.at.is_none_or(|at| at.elapsed() >= self.limits.refresh);
            // One request refreshes; the others decide on what is known.
            (stale && !seen.refreshing).then(|| {
                seen.refreshing = true;
                seen.mark
            })
        };
        if let Some(mark) = mark {
            // Let go of the refresh even if this request is dropped
            // mid-count (a client gone, a request timeout): else no one
            // would count this tenant again.
            let refreshing = Refreshing {
                tenants: &self.tenants,
                tenant,
            };
            let counted = self.count(tenant, mark).await;
            drop(refreshing);
            match counted {
                Ok((in_flight, created, mark, stuck)) => {
                    let mut tenants = self.tenants.lock().expect("admission state");
                    tenants
                        .entry(tenant)
                        .or_default()
                        .update(in_flight, created, mark, stuck);
                    let stuck: i64 = tenants
                        .values()
                        .filter(|s| s.at.is_some_and(|at| at.elapsed() < STUCK_SEEN_WITHIN))
                        .map(|s| s.stuck)
                        .sum();
                    metrics::gauge!(STUCK).set(stuck as f64);
                }
                Err(e) => {
                    // The claim that follows meets the same database: it
                    // answers 503 if it is down. Unknown is not a refusal.
                    tracing::warn!(tenant_id = %tenant, error = %e, "admission: the backlog could not be counted");
                    metrics::counter!(UNKNOWN).increment(1);
                    return Ok(());
                }
            }
        }
        let mut tenants = self.tenants.lock().expect("admission state");
        let seen = tenants.entry(tenant).or_default();
        let in_flight = seen.in_flight + seen.admitted;
        let limit = seen.limit(bound, self.limits.horizon);
        if in_flight < limit {
            seen.admitted += 1;
            metrics::counter!(ADMITTED).increment(1);
            return Ok(());
        }
        metrics::counter!(REFUSED).increment(1);
        let waited = seen.progress_at.map_or(Duration::ZERO, |at| at.elapsed());
        Err(retry_after(
            in_flight + 1 - limit,
            seen.drain_per_sec,
            waited,
        ))
    }

    async fn count(&self, tenant: TenantId, mark: Option<i64>) -> Result<(i64, i64, i64, i64)> {
        let mut tx = reliability::TenantTx::begin(&self.pool, tenant).await?;
        let counted = sqlx::query_as(sqlx::AssertSqlSafe(self.sql))
            .bind(mark)
            .bind(self.limits.stuck_after.as_secs_f64())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(counted)
    }
}

/// A tenant's refresh in progress, ended when dropped.
struct Refreshing<'a> {
    tenants: &'a Mutex<HashMap<TenantId, Seen>>,
    tenant: TenantId,
}

impl Drop for Refreshing<'_> {
    fn drop(&mut self) {
        if let Some(seen) = self
            .tenants
            .lock()
            .ok()
            .as_mut()
            .and_then(|t| t.get_mut(&self.tenant))
        {
            seen.refreshing = false;
        }
    }
}

impl Seen {
    /// Work that became stuck since the last count left `in_flight`
    /// undecided: it counts here as decided, a small overestimate of the
    /// drain rate only while it ages out.
    fn update(&mut self, in_flight: i64, created: i64, mark: i64, stuck: i64) {
        let now = Instant::now();
        if let (Some(at), Some(_)) = (self.at, self.mark) {
            let secs = now.duration_since(at).as_secs_f64().max(0.001);
            let decided = (self.in_flight + created - in_flight).max(0) as f64;
            if decided > 0.0 {
                self.progress_at = Some(now);
            }
            let sample = decided / secs;
            self.drain_per_sec = if self.drain_per_sec == 0.0 {
                sample
            } else {
                0.5 * self.drain_per_sec + 0.5 * sample
            };
        }
        self.in_flight = in_flight;
        self.stuck = stuck;
        self.mark = Some(mark);
        self.progress_at.get_or_insert(now);
        self.at = Some(now);
        self.admitted = 0;
    }
}

impl Seen {
    /// What the tenant may have in flight: `fixed`, or under a `horizon`
    /// what the pipeline decides of its work in that long (Little's law:
    /// the work in flight that keeps its decisions `horizon` behind), within
    /// [`DERIVED_FLOOR`] and `fixed`. The drain rate is itself bounded by
    /// the limit, so a horizon shorter than an order's time in flight at
    /// this load decays to the floor (ADR 0027, amended in session 35).
    fn limit(&self, fixed: u32, horizon: Duration) -> i64 {
        let fixed = i64::from(fixed);
        if horizon.is_zero() {
            return fixed;
        }
        let derived = (self.drain_per_sec * horizon.as_secs_f64()).ceil() as i64;
        derived.max(i64::from(DERIVED_FLOOR)).min(fixed)
    }
}

/// Seconds until `excess` units of work are decided at `drain_per_sec`,
/// within 1 and [`MAX_RETRY_AFTER_SECS`]. While none of the tenant's work
/// has been seen decided, the rate is not known: a tenant's first burst
/// has none decided yet, and a stalled pipeline none for long. The client
/// then waits as long as nothing has been decided (`undecided_for`): 1 s
/// at a first burst, a minute once the pipeline has stalled for one.
pub fn retry_after(excess: i64, drain_per_sec: f64, undecided_for: Duration) -> u32 {
    let secs = if drain_per_sec > 0.0 {
        excess.max(1) as f64 / drain_per_sec
    } else {
        undecided_for.as_secs_f64()
    };
    (secs.ceil() as u32).clamp(1, MAX_RETRY_AFTER_SECS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_follows_the_drain_rate_within_its_bounds() {
        let none = Duration::ZERO;
        assert_eq!(retry_after(10, 5.0, none), 2);
        assert_eq!(retry_after(1, 100.0, none), 1);
        assert_eq!(retry_after(10_000, 1.0, none), MAX_RETRY_AFTER_SECS);
    }

    #[test]
    fn with_nothing_decided_yet_retry_after_grows_with_the_wait() {
        let ms = Duration::from_millis;
        assert_eq!(retry_after(3, 0.0, ms(300)), 1, "a first burst");
        assert_eq!(retry_after(3, 0.0, ms(12_400)), 13);
        assert_eq!(
            retry_after(3, 0.0, ms(600_000)),
            MAX_RETRY_AFTER_SECS,
            "a stalled pipeline"
        );
    }

    #[test]
    fn a_derived_bound_follows_the_drain_rate_within_its_floor_and_the_fixed_bound() {
        let seen = |drain_per_sec| Seen {
            drain_per_sec,
            ..Seen::default()
        };
        let second = Duration::from_secs(1);
        assert_eq!(seen(150.0).limit(1000, Duration::ZERO), 1000, "off");
        assert_eq!(seen(150.0).limit(1000, second), 150);
        assert_eq!(seen(150.0).limit(1000, 2 * second), 300);
        assert_eq!(seen(0.0).limit(1000, second), i64::from(DERIVED_FLOOR));
        assert_eq!(
            seen(5000.0).limit(1000, second),
            1000,
            "the fixed bound caps it"
        );
        assert_eq!(
            seen(0.0).limit(3, second),
            3,
            "a fixed bound under the floor holds"
        );
    }

    /// A gate whose database is at `host:port`.
    fn gate(host: &str, port: u16, bound: u32) -> Backlog {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(300))
            .connect_lazy_with(
                sqlx::postgres::PgConnectOptions::new()
                    .host(host)
                    .port(port),
            );
        let limits = AdmissionLimits {
            default: bound,
            ..AdmissionLimits::default()
        };
        Backlog::new(
            pool,
            limits,
            "SELECT 0::bigint, 0::bigint, 0::bigint, 0::bigint",
        )
    }

    #[tokio::test]
    async fn a_request_dropped_mid_count_lets_go_of_the_refresh() {
        // Accepts connections (the kernel's backlog) and never answers.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let backlog = gate("127.0.0.1", silent.local_addr().unwrap().port(), 10);
        let tenant = TenantId::new(1).unwrap();
        let cut = tokio::time::timeout(Duration::from_millis(20), backlog.admit(tenant)).await;
        assert!(cut.is_err(), "the count was still running");
        let tenants = backlog.tenants.lock().unwrap();
        assert!(
            !tenants[&tenant].refreshing,
            "the next request may count again"
        );
    }

    #[tokio::test]
    async fn a_backlog_that_cannot_be_counted_refuses_no_one() {
        let backlog = gate("127.0.0.1", 1, 1);
        let tenant = TenantId::new(1).unwrap();
        for _ in 0..3 {
            assert_eq!(backlog.admit(tenant).await, Ok(()));
        }
    }

    #[test]
    fn per_tenant_bounds_parse_and_bad_ones_are_named() {
        let limits = AdmissionLimits::parse(100, "7=5, 9=0", Duration::from_millis(1)).unwrap();
        assert_eq!(limits.bound(TenantId::new(7).unwrap()), 5);
        assert_eq!(limits.bound(TenantId::new(9).unwrap()), 0);
        assert_eq!(limits.bound(TenantId::new(8).unwrap()), 100);
        let err = AdmissionLimits::parse(100, "7:5", Duration::ZERO).unwrap_err();
        assert!(err.to_string().contains("tenant=bound"), "{err}");
    }
}
