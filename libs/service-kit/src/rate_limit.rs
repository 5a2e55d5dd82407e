//! Per-tenant admission: a token bucket (GCRA) per tenant in each serving
//! process, one for writes and one for reads. Over the write limit a
//! request is answered 429 with `Retry-After` before it claims its
//! Idempotency-Key or touches the database, so nothing runs and the key
//! stays free for the retry. Over the read limit a read (`GET`, `HEAD`)
//! is answered the same before its handler runs ([`read_budget`]).
//!
//! The buckets are per process: with N `serve` replicas a tenant gets up to
//! N times the limit. That is the trade docs/adr/0015 makes: no shared
//! counter on the hot path, and no coordinator of our own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::JwtKeys;
use crate::http::ApiError;
use reliability::TenantId;

/// Sustained writes per second and burst per tenant; `per_sec == 0` turns
/// the limit off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub per_sec: u32,
    pub burst: u32,
}

/// The read budget's default, per tenant and serving process: reads are
/// cheaper than writes and come in bursts (a page and its parts), so
/// twice the writes' 1000/s and 2000.
pub const READ_RATE_LIMIT: RateLimit = RateLimit {
    per_sec: 2000,
    burst: 4000,
};

/// Buckets stop being tracked this long after they are full again.
const FORGET_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct RateLimiter {
    limit: RateLimit,
    /// Per tenant, the theoretical arrival time of the next request.
    tat: Arc<Mutex<HashMap<TenantId, Instant>>>,
}

impl RateLimiter {
    pub fn new(limit: RateLimit) -> Self {
        Self {
            limit,
            tat: Arc::default(),
        }
    }

    pub fn unlimited() -> Self {
        Self::new(RateLimit {
            per_sec: 0,
            burst: 0,
        })
    }

    pub fn is_off(&self) -> bool {
        self.limit.per_sec == 0
    }

    /// Admits one request of `tenant`, or says how long until one would be.
    pub fn check(&self, tenant: TenantId) -> Result<(), Duration> {
        self.check_at(tenant, Instant::now())
    }

    fn check_at(&self, tenant: TenantId, now: Instant) -> Result<(), Duration> {
        if self.limit.per_sec == 0 {
            return Ok(());
        }
        let interval = Duration::from_secs(1) / self.limit.per_sec;
        let tolerance = interval * self.limit.burst.max(1).saturating_sub(1);
        let mut tat = self
            .tat
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if tat.len() > 10_000 {
            tat.retain(|_, t| *t + FORGET_AFTER > now);
        }
        let next = tat.get(&tenant).copied().unwrap_or(now).max(now);
        let earliest = next.checked_sub(tolerance).unwrap_or(now);
        if earliest > now {
            return Err(earliest - now);
        }
        tat.insert(tenant, next + interval);
        Ok(())
    }
}

/// The answer over a limit, counted under `scope` (a write's route scope,
/// or `read`).
pub fn rate_limited(scope: &str, wait: Duration) -> ApiError {
    metrics::counter!(crate::metrics::HTTP_RATE_LIMITED, "scope" => scope.to_owned()).increment(1);
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        "too many requests for this tenant; retry later",
    )
    .with_retry_after(u32::try_from(wait.as_secs() + 1).unwrap_or(u32::MAX))
}

/// What [`read_budget`] needs: the keys that name a request's tenant, and
/// the tenants' read buckets.
#[derive(Debug, Clone)]
pub struct ReadBudget {
    pub keys: JwtKeys,
    pub limiter: RateLimiter,
}

/// The read budget, a layer on every route: a read (`GET`, `HEAD`) whose
/// token names a tenant is counted in that tenant's read bucket, and over
/// it answered 429 before its handler runs. The tenant it verified is left
/// for the handler's [`TenantId`] extractor, so a token is verified once.
/// A request without a valid token passes: its route refuses it, or needs
/// none. Writes are counted by their own bucket, where their key is
/// claimed (`Idempotent`), not here.
pub async fn read_budget(
    State(budget): State<ReadBudget>,
    mut req: Request,
    next: Next,
) -> Response {
    if !req.method().is_safe() || budget.limiter.is_off() {
        return next.run(req).await;
    }
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(|t| t.trim().to_owned());
    let Some(token) = token else {
        return next.run(req).await;
    };
    let Ok(tenant) = budget.keys.verify(&token).await else {
        return next.run(req).await;
    };
    if let Err(wait) = budget.limiter.check(tenant) {
        return rate_limited("read", wait).into_response();
    }
    req.extensions_mut().insert(tenant);
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_gets_its_burst_then_its_rate_and_others_are_unaffected() {
        let limiter = RateLimiter::new(RateLimit {
            per_sec: 10,
            burst: 5,
        });
        let (a, b) = (TenantId::new(1).unwrap(), TenantId::new(2).unwrap());
        let t0 = Instant::now();
        for _ in 0..5 {
            assert!(limiter.check_at(a, t0).is_ok());
        }
        let wait = limiter.check_at(a, t0).unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        assert!(
            limiter.check_at(b, t0).is_ok(),
            "another tenant has its own bucket"
        );
        assert!(
            limiter.check_at(a, t0 + wait).is_ok(),
            "admitted once the wait is over"
        );
        assert!(limiter.check_at(a, t0 + wait).is_err());
        assert!(limiter.check_at(a, t0 + Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn zero_is_unlimited() {
        let limiter = RateLimiter::unlimited();
        let t = TenantId::new(1).unwrap();
        assert!((0..10_000).all(|_| limiter.check(t).is_ok()));
    }
}
