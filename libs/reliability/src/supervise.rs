//! The one loop the long-running parts run under (the relay, each
//! consumer): run connected until shutdown; after a broker or database
//! loss, report not ready and try again after a jittered, growing delay, so
//! that many processes cut off by one outage do not come back in lockstep.
//! A fail point's simulated crash ends the loop, as a real one would.
//!
//! The payments worker uses [`Backoff`] without the loop: its provider calls
//! in flight must outlive a database blip (a restart would drop them), so it
//! keeps running and spaces its claim and LISTEN retries instead.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::{Error, Result};

/// Exponential backoff with jitter: each wait is the current step ±50%,
/// and the step doubles up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    step: Duration,
}

impl Default for Backoff {
    /// 100 ms, doubling to 5 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            first,
            max,
            step: first,
        }
    }

    /// The wait before the next try.
    pub fn next_delay(&mut self) -> Duration {
        // Random enough to spread processes apart; no cryptographic need.
        let unit = (uuid::Uuid::new_v4().as_u128() % 1_000_000) as f64 / 1_000_000.0;
        let delay = self.step.mul_f64(0.5 + unit);
        self.step = (self.step * 2).min(self.max);
        delay
    }

    /// Back to the first step (after a long healthy run).
    pub fn reset(&mut self) {
        self.step = self.first;
    }
}

/// Runs `connected` until it returns `Ok` (it saw `shutdown`) or a fail
/// point fires; after any other error marks `part` not ready in `health`,
/// logs `what` and runs it again after a [`Backoff`] delay (reset after a
/// run that lasted a minute).
pub async fn supervise<F, Fut>(
    part: &str,
    what: &str,
    health: &Health,
    shutdown: &CancellationToken,
    mut connected: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let mut backoff = Backoff::default();
    health.starting(part);
    while !shutdown.is_cancelled() {
        let started = Instant::now();
        match connected().await {
            Ok(()) => return Ok(()),
            Err(e @ Error::FailPoint(_)) => return Err(e),
            Err(e) => {
                if started.elapsed() > Duration::from_secs(60) {
                    backoff.reset();
                }
                let delay = backoff.next_delay();
                health.not_ready(part, &e);
                tracing::warn!(part, error = %e, retry_in = ?delay, "{what}; reconnecting");
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(()),
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_and_spread_around_each_step() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        for step in [100, 200, 400, 800, 800] {
            let d = b.next_delay().as_millis();
            assert!(
                (step / 2..=step * 3 / 2).contains(&d),
                "{d} ms at step {step}"
            );
        }
        let at_cap: std::collections::HashSet<u128> =
            (0..20).map(|_| b.next_delay().as_millis()).collect();
        assert!(at_cap.len() > 5, "jittered: {at_cap:?}");
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(150));
    }
}
