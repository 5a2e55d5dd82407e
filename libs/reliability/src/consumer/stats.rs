//! What a consumer finished since it was built: the same figures as its
//! metrics, readable without a recorder.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Apply, Consumer};

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) applied: AtomicU64,
    pub(super) duplicates: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) parked: AtomicU64,
    pub(super) retries: AtomicU64,
    pub(super) grouped: AtomicU64,
    pub(super) fallbacks: AtomicU64,
    pub(super) gathered: AtomicU64,
    pub(super) redelivered: AtomicU64,
    pub(super) lane_restarts: AtomicU64,
}

/// Deliveries this consumer finished since it was built (the same figures
/// as its metrics, readable without a recorder).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerStats {
    pub applied: u64,
    pub duplicates: u64,
    pub dead_lettered: u64,
    /// Ordered subscriptions: events put in the parked store.
    pub parked: u64,
    /// Failed tries that were retried (handler errors and outages alike).
    pub retries: u64,
    /// Of the applied and duplicates, those committed as part of a group.
    pub grouped: u64,
    /// Groups that failed and were applied one at a time instead (a
    /// handler error, or two appliers deadlocked: docs/adr/0010).
    pub fallbacks: u64,
    /// Of the grouped, those committed in another lane's transaction
    /// (gather.rs).
    pub gathered: u64,
    /// Deliveries that came back: a channel or connection (this process's
    /// or another's) closed before acking them. Each counts toward the
    /// queue's delivery limit, so blips must not return what they need not.
    pub redelivered: u64,
    /// Lanes that lost their connection or channel and reconnected on
    /// their own, the others going on.
    pub lane_restarts: u64,
}

impl ConsumerStats {
    /// Deliveries acked (applied, duplicate or parked) or dead-lettered.
    pub fn finished(&self) -> u64 {
        self.applied + self.duplicates + self.parked + self.dead_lettered
    }
}

impl<A: Apply> Consumer<A> {
    pub fn stats(&self) -> ConsumerStats {
        ConsumerStats {
            applied: self.stats.applied.load(Ordering::Relaxed),
            duplicates: self.stats.duplicates.load(Ordering::Relaxed),
            dead_lettered: self.stats.dead_lettered.load(Ordering::Relaxed),
            parked: self.stats.parked.load(Ordering::Relaxed),
            retries: self.stats.retries.load(Ordering::Relaxed),
            grouped: self.stats.grouped.load(Ordering::Relaxed),
            fallbacks: self.stats.fallbacks.load(Ordering::Relaxed),
            gathered: self.stats.gathered.load(Ordering::Relaxed),
            redelivered: self.stats.redelivered.load(Ordering::Relaxed),
            lane_restarts: self.stats.lane_restarts.load(Ordering::Relaxed),
        }
    }
}
