//! Group commit across lanes (docs/adr/0039). A lane's group that finds
//! another lane of its consumer with a transaction in flight waits for
//! that commit to end, at most [`ConsumerConfig::gather_wait`]; then the
//! first waiting lane to go takes every group waiting, from any lane, into
//! its one transaction. Each lane still acks its own deliveries on its own
//! channel, after that commit, and handles a failed group one delivery at
//! a time, as before.
//!
//! Why: lanes split a queue's flow, so at moderate load each lane finds
//! one delivery waiting and commits it alone; four lanes paid four
//! transactions where one would do. PostgreSQL's `commit_delay` with
//! `commit_siblings` makes the same trade for its WAL flushes: wait only
//! where another commit is on its way. A lane alone never waits.
//!
//! [`ConsumerConfig::gather_wait`]: super::ConsumerConfig::gather_wait

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use lapin::message::Delivery;
use tokio::sync::{Notify, oneshot};

use crate::outbox::Envelope;
use crate::{Error, Result};

use super::{Apply, ApplyError, Consumer, Lane, Outcome};

/// A lane's parsed deliveries, in delivery order.
pub(super) type Parsed = Vec<(Delivery, Envelope)>;

/// What became of a lane's group.
pub(super) enum Joined {
    /// Committed: each event's outcome, in the group's order.
    Applied(Parsed, Vec<Outcome>),
    /// The transaction rolled back (why): each delivery goes the
    /// one-at-a-time way, with its own retries.
    Failed(Parsed, String),
    /// A fail point fired: the simulated crash stops every lane.
    Crashed(&'static str),
}

/// The groups waiting to be taken into a transaction, and how many of
/// this consumer's lanes have one in flight.
#[derive(Default)]
pub(super) struct Gather {
    waiting: Mutex<Vec<Waiting>>,
    applying: AtomicUsize,
    ended: Notify,
    next: AtomicU64,
}

struct Waiting {
    id: u64,
    parsed: Parsed,
    reply: oneshot::Sender<Joined>,
}

impl Gather {
    /// Every group waiting, if `id`'s is still among them (else a lane
    /// took it, and answers it).
    fn take_if_waiting(&self, id: u64) -> Option<Vec<Waiting>> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting
            .iter()
            .any(|w| w.id == id)
            .then(|| std::mem::take(&mut *waiting))
    }

    /// Groups waiting now (for tests that stage a gathering).
    pub(super) fn waiting(&self) -> usize {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Counts a transaction in flight while it lives, and wakes the groups
/// waiting for it when it ends (or is dropped half way).
struct InFlight<'a>(&'a Gather);

impl<'a> InFlight<'a> {
    fn start(gather: &'a Gather) -> Self {
        gather.applying.fetch_add(1, Ordering::SeqCst);
        Self(gather)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.applying.fetch_sub(1, Ordering::SeqCst);
        self.0.ended.notify_waiters();
    }
}

impl<A: Apply> Consumer<A> {
    /// Applies `parsed` in one transaction, with the groups of other lanes
    /// that are waiting (see the module's doc).
    pub(super) async fn apply_gathered(&self, parsed: Parsed, lane: Lane) -> Result<Joined> {
        let gather = &self.gather;
        let wait = self.config.gather_wait;
        let alone = parsed.len() >= self.config.batch_max || wait.is_zero();
        let id = gather.next.fetch_add(1, Ordering::Relaxed);
        let (reply, mut answer) = oneshot::channel();
        // Listening before the look at `applying`: a commit that ends in
        // between still wakes this group.
        let ended = gather.ended.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        gather
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Waiting { id, parsed, reply });
        if !alone && gather.applying.load(Ordering::SeqCst) > 0 {
            tokio::select! {
                joined = &mut answer => return joined.map_err(|_| lost()),
                () = &mut ended => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
        match gather.take_if_waiting(id) {
            Some(groups) => Ok(self.commit_gathered(groups, id, lane).await),
            None => answer.await.map_err(|_| lost()),
        }
    }

    /// One transaction for `groups`; each lane's answer sent, `mine`'s
    /// returned.
    async fn commit_gathered(&self, groups: Vec<Waiting>, mine: u64, lane: Lane) -> Joined {
        let sizes: Vec<usize> = groups.iter().map(|w| w.parsed.len()).collect();
        let mut all = Vec::with_capacity(sizes.iter().sum());
        let mut replies = Vec::with_capacity(groups.len());
        for w in groups {
            all.extend(w.parsed);
            replies.push((w.id, w.reply));
        }
        let result = {
            let _in_flight = InFlight::start(&self.gather);
            let _others = self.beside_others().await;
            self.bounded(A::group(self, &all, lane)).await
        };
        let mut all = all.into_iter();
        let mut outcomes = result.as_deref().unwrap_or_default().iter().copied();
        let mut own = None;
        for ((id, reply), n) in replies.into_iter().zip(sizes) {
            let parsed: Parsed = all.by_ref().take(n).collect();
            let joined = match &result {
                Ok(_) => Joined::Applied(parsed, outcomes.by_ref().take(n).collect()),
                Err(ApplyError::FailPoint(name)) => Joined::Crashed(name),
                Err(e) => Joined::Failed(parsed, e.to_string()),
            };
            if id == mine {
                own = Some(joined);
            } else {
                if matches!(joined, Joined::Applied(..)) {
                    self.count_gathered(n);
                }
                // A lane that stopped waiting has left its deliveries
                // unacked: its channel's close hands them back.
                let _ = reply.send(joined);
            }
        }
        own.expect("the committing lane's group is among those it took")
    }

    fn count_gathered(&self, n: usize) {
        self.stats.gathered.fetch_add(n as u64, Ordering::Relaxed);
        metrics::counter!(crate::metrics::CONSUMER_GATHERED, "consumer" => self.config.name.clone())
            .increment(n as u64);
    }

    /// Groups waiting to join another lane's transaction now. For tests
    /// that stage a gathering.
    #[doc(hidden)]
    pub fn gathering(&self) -> usize {
        self.gather.waiting()
    }
}

/// The lane that took a group into its transaction went away without an
/// answer (its future was dropped): the group's deliveries are gone with
/// it, unacked. The lane restarts, and its channel's close hands them back.
fn lost() -> Error {
    Error::ChannelClosed("a gathered group's answer")
}
