//! What one serving process knows of one tenant's work in flight: the
//! last count, the drain rate between counts, and from them the bound and
//! `Retry-After`.

use std::time::{Duration, Instant};

use super::{DERIVED_FLOOR, MAX_RETRY_AFTER_SECS};

/// What one process knows of one tenant.
#[derive(Debug, Default)]
pub(super) struct Seen {
    /// Work in flight at the last count, and the service's mark of the
    /// newest work then (the query counts what was created after it).
    pub(super) in_flight: i64,
    /// Work stuck at the last count.
    pub(super) stuck: i64,
    pub(super) mark: Option<i64>,
    pub(super) at: Option<Instant>,
    /// Work decided per second, smoothed over the counts.
    pub(super) drain_per_sec: f64,
    /// The first count, or the last one that found work decided or none
    /// in flight before it: since then, work has waited undecided.
    pub(super) progress_at: Option<Instant>,
    /// Admitted by this process since the last count.
    pub(super) admitted: i64,
    pub(super) refreshing: bool,
}

impl Seen {
    /// Work that became stuck since the last count left `in_flight`
    /// undecided: it counts here as decided, a small overestimate of the
    /// drain rate only while it ages out.
    pub(super) fn update(&mut self, in_flight: i64, created: i64, mark: i64, stuck: i64) {
        let now = Instant::now();
        if let (Some(at), Some(_)) = (self.at, self.mark) {
            let secs = now.duration_since(at).as_secs_f64().max(0.001);
            let decided = (self.in_flight + created - in_flight).max(0) as f64;
            // Nothing in flight at the last count: what is in flight now
            // came since, so nothing has waited long; and if none of it
            // was decided, the tenant was idle, which says nothing of the
            // pipeline's rate.
            if decided > 0.0 || self.in_flight == 0 {
                self.progress_at = Some(now);
            }
            if decided > 0.0 || self.in_flight > 0 {
                let sample = decided / secs;
                self.drain_per_sec = if self.drain_per_sec == 0.0 {
                    sample
                } else {
                    0.5 * self.drain_per_sec + 0.5 * sample
                };
            }
        }
        self.in_flight = in_flight;
        self.stuck = stuck;
        self.mark = Some(mark);
        self.progress_at.get_or_insert(now);
        self.at = Some(now);
        self.admitted = 0;
    }

    /// What the tenant may have in flight: `fixed`, or under a `horizon`
    /// what the pipeline decides of its work in that long (Little's law:
    /// the work in flight that keeps its decisions `horizon` behind), within
    /// [`DERIVED_FLOOR`] and `fixed`. The drain rate is itself bounded by
    /// the limit, so a horizon shorter than an order's time in flight at
    /// this load decays to the floor (ADR 0027, amended in session 35).
    pub(super) fn limit(&self, fixed: u32, horizon: Duration) -> i64 {
        let fixed = i64::from(fixed);
        if horizon.is_zero() {
            return fixed;
        }
        let derived = (self.drain_per_sec * horizon.as_secs_f64()).ceil() as i64;
        derived.max(i64::from(DERIVED_FLOOR)).min(fixed)
    }

    /// `Retry-After` for `excess` units of work over the bound.
    pub(super) fn retry_after(&self, excess: i64) -> u32 {
        let waited = self.progress_at.map_or(Duration::ZERO, |at| at.elapsed());
        retry_after(excess, self.drain_per_sec, waited)
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

    /// A tenant back after a quiet spell, with nothing in flight then, is
    /// not behind a stalled pipeline; work in flight that nothing decides
    /// for as long is.
    #[test]
    fn an_idle_tenant_is_not_a_stalled_pipeline() {
        let then = Instant::now()
            .checked_sub(Duration::from_secs(90))
            .expect("a monotonic clock 90 s past its start");
        let counted = |in_flight| Seen {
            in_flight,
            mark: Some(1),
            at: Some(then),
            progress_at: Some(then),
            ..Seen::default()
        };
        let mut idle = counted(0);
        idle.update(40, 40, 2, 0);
        assert_eq!(idle.retry_after(10), 1, "a burst after 90 s of nothing");
        let mut stalled = counted(40);
        stalled.update(40, 0, 1, 0);
        assert_eq!(stalled.retry_after(10), MAX_RETRY_AFTER_SECS);
    }
}
