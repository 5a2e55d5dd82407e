//! Per-tenant admission of writes: a token bucket (GCRA) per tenant in each
//! serving process. Over the limit a request is answered 429 with
//! `Retry-After` before it claims its Idempotency-Key or touches the
//! database, so nothing runs and the key stays free for the retry.
//!
//! The buckets are per process: with N `serve` replicas a tenant gets up to
//! N times the limit. That is the trade docs/adr/0015 makes: no shared
//! counter on the hot path, and no coordinator of our own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::TenantId;

/// Sustained writes per second and burst per tenant; `per_sec == 0` turns
/// the limit off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub per_sec: u32,
    pub burst: u32,
}

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
