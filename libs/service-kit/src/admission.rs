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
use std::time::Duration;

use sqlx::PgPool;

use reliability::{Error, Result, TenantId};

mod seen;
use seen::Seen;
pub use seen::retry_after;

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
        Err(seen.retry_after(in_flight + 1 - limit))
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

#[cfg(test)]
mod tests {
    use super::*;

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
