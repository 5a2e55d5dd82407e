//! The consumer runtime (invariants I2 and I8): each delivered event changes
//! a consumer's state exactly once, whatever the delivery count or order.
//!
//! Per message (or per group of waiting messages: docs/adr/0009), one
//! transaction holds: the dedup record
//! `(tenant, consumer, source, message id)`, the handler's state change and
//! outbox rows, and the `consumer_offsets` advance. Commit, then ack. A
//! redelivery finds the dedup record and is acked without effect. Why a
//! high-water mark alone cannot do this: docs/adr/0002.
//!
//! Several appliers may run at once: lanes in one process and replicas on
//! any number of machines compete for one queue (docs/adr/0010). Every
//! transaction first takes a transaction-scoped advisory lock on each
//! aggregate it will change ([`Handler::lock_key`]), all of them in one
//! order, so two events of one aggregate take turns and two groups cannot
//! deadlock; rows that several aggregates share are locked in
//! [`Handler::prepare`], also in one order.
//!
//! A handler error is retried in place a bounded number of times, then the
//! message is rejected to its queue's DLQ, where an operator can inspect and
//! re-drive it (`reliability dlq`). Infrastructure errors (the database is
//! down) are retried without limit instead: an outage must not dead-letter
//! healthy messages.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::broker::QueueSpec;
use crate::failpoint::FailPoints;
use crate::health::Health;
use crate::outbox::Envelope;
use crate::{Error, Result, TenantId, TenantTx};

mod apply;
mod causes;
mod delivery;
mod gather;
mod hold;
mod kinds;
mod ordered;
mod park;
mod replay;
mod settle;
mod stats;
mod tries;

pub use causes::error_class;
pub use kinds::{Apply, Pg, Sink};
pub use park::{ParkedAggregate, ParkedEvent, first_parked, parked, skip, unpark};
pub use replay::Replayed;
pub use stats::ConsumerStats;
use stats::Counters;
pub use tries::CRASH_TRIES;

/// The ordered subscription's record-and-gate statement and its look-up
/// of the aggregates it did not advance, for a test of their plans.
#[doc(hidden)]
pub const GATE_SQL: &str = ordered::GATE_SQL;
#[doc(hidden)]
pub const STATE_SQL: &str = ordered::STATE_SQL;

/// Applies one event to a consumer's state inside the given transaction.
///
/// The handler must do all its work through `tx` (state changes and outbox
/// rows) and nothing outside it, so that the dedup record and the effect
/// commit or vanish together. Events it does not care about: return `Ok`.
pub trait Handler: Send + Sync + 'static {
    /// The aggregate `event` changes: appliers of events with the same key
    /// take turns (docs/adr/0010). The default is the envelope's aggregate;
    /// a handler whose state is keyed otherwise (the order a payment belongs
    /// to) says so. `None`: the handler is safe under any concurrency.
    fn lock_key(&self, event: &Envelope) -> Option<String> {
        Some(format!("{}:{}", event.aggregate_type, event.aggregate_id))
    }

    /// Runs once per tenant's run of fresh events in a transaction, before
    /// any of them is handled. A handler whose events change rows that
    /// several aggregates share (stock of one sku) locks them here, in one
    /// order, so that two groups touching them cannot deadlock.
    fn prepare(
        &self,
        _tx: &mut TenantTx,
        _events: &[&Envelope],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        async { Ok(()) }
    }

    fn handle(
        &self,
        tx: &mut TenantTx,
        event: &Envelope,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// A handler's own failure, kept as the error it is.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Not an event this build reads (an unknown type or version, a payload
    /// that does not fit its contract): dead-lettered at once.
    #[error(transparent)]
    Decode(#[from] contracts::DecodeError),
    /// The handler's own refusal, which retrying cannot change (an event
    /// about an order this service never had): dead-lettered at once. A
    /// message (`"no order 7".into()`) or the error that caused it.
    #[error("permanent: {0}")]
    Permanent(BoxError),
    /// May succeed on a later try (a dependency of the handler's own that
    /// timed out): retried, then dead-lettered. A message or its cause.
    #[error("transient: {0}")]
    Transient(BoxError),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A [`Sink`]'s own store cannot be reached (its server is down or
    /// restarting): waited on like a database outage, costing no try.
    #[error("store unavailable: {0}")]
    Unavailable(BoxError),
    /// A library call failed; the retry decision reads its kind (an
    /// unavailable broker waits like a database outage, anything else
    /// costs a try).
    #[error(transparent)]
    Reliability(Box<Error>),
}

impl HandlerError {
    /// Retrying cannot help: the message goes to the dead-letter queue at
    /// once instead of spending its tries.
    pub fn is_permanent(&self) -> bool {
        matches!(self, Self::Decode(_) | Self::Permanent(_))
    }
}

impl From<Error> for HandlerError {
    fn from(e: Error) -> Self {
        match e {
            Error::Database(e) => Self::Database(e),
            other => Self::Reliability(Box::new(other)),
        }
    }
}

/// What applying one message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// Seen before: nothing changed.
    Duplicate,
    /// Ordered subscriptions: put in the parked store, behind (or as the
    /// first of) its parked aggregate (docs/adr/0028).
    Parked,
}

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Handler(#[from] HandlerError),
    #[error("fail point {0} fired")]
    FailPoint(&'static str),
}

impl From<sqlx::Error> for ApplyError {
    fn from(e: sqlx::Error) -> Self {
        Self::Handler(HandlerError::Database(e))
    }
}

#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// The consumer's name: its queue, and its key in the dedup table.
    pub name: String,
    pub queue: QueueSpec,
    /// Unacked deliveries the broker may push ahead.
    pub prefetch: u16,
    /// Tries of a failing handler before the message is dead-lettered.
    pub max_attempts: u32,
    /// Delay before try n+1 is `retry_delay * n`.
    pub retry_delay: Duration,
    /// Deliveries already waiting are applied together, up to this many, in
    /// one transaction: one commit (one WAL flush) for the group. 1 turns
    /// grouping off. A group that fails falls back to one at a time.
    pub batch_max: usize,
    /// Lanes in this process: each its own connection and channel on the
    /// queue, applying its deliveries in turn, beside the others
    /// (docs/adr/0010, 0024).
    pub lanes: usize,
    /// How long one apply (a group's, or one event's) may take before the
    /// lane gives up on it and its connection, costing a try
    /// ([`APPLY_BOUND`] by default).
    pub apply_bound: Duration,
    /// How long a lane's group may wait to join the transaction of
    /// another lane that has one in flight ([`GATHER_WAIT`] by default;
    /// zero: never). A lane alone never waits (docs/adr/0039).
    pub gather_wait: Duration,
    /// How long an aggregate of a whole ordered subscription waits for a
    /// number skipped before its later events are applied over the gap
    /// ([`GAP_WAIT`] by default, docs/adr/0040).
    pub gap_wait: Duration,
    pub fail_points: FailPoints,
}

/// An apply's bound, on our side. Longer than any statement the runtime
/// role may run (`statement_timeout` 30 s) and a lock wait (`lock_timeout`
/// 5 s): a slow apply is ended by the server first, with its own error.
/// This one ends what the server cannot end: an answer lost with the link
/// to it (docs/adr/0022, amended). sqlx sets no read timeout on its
/// sockets; without it, a lane waited on TCP's retransmission for minutes.
pub const APPLY_BOUND: Duration = Duration::from_secs(40);

/// A group's wait for another lane's commit, at most: about one
/// transaction of a group on this machine, so a wait is mostly ended by
/// that commit, not by this bound (docs/adr/0039).
pub const GATHER_WAIT: Duration = Duration::from_millis(5);

/// A skipped number's wait, at most (docs/adr/0040): longer than a relay's
/// retry of a refused publish and a broker's return of what a lost
/// consumer held, short enough that an event truly gone (a dead letter)
/// holds its aggregate back for a minute, not for good.
pub const GAP_WAIT: Duration = Duration::from_secs(60);

impl ConsumerConfig {
    /// Queue `name` bound to `bindings` on `exchange`; 5 tries 200 ms apart
    /// (growing), prefetch 50 per lane, one lane, broker delivery limit 10.
    pub fn new(name: &str, exchange: &str, bindings: &[&str]) -> Self {
        Self {
            name: name.to_owned(),
            queue: QueueSpec::new(name, exchange, bindings),
            prefetch: 50,
            max_attempts: 5,
            retry_delay: Duration::from_millis(200),
            batch_max: 32,
            lanes: 1,
            apply_bound: APPLY_BOUND,
            gather_wait: GATHER_WAIT,
            gap_wait: GAP_WAIT,
            fail_points: FailPoints::none(),
        }
    }
}

/// A consumer of one subscription: what it applies (`A`, a [`Pg`] handler
/// or a [`Sink`]) and how. Its methods live beside the step they serve;
/// this is their map:
///
/// | step | methods | file |
/// | --- | --- | --- |
/// | build | `new`, `with_sink`, `with_health`, `handler`, `sink`, `stats`, `config` | `consumer/kinds.rs`, here |
/// | run | `run`: lanes, deliveries, groups, depth looks | `consumer/delivery.rs` |
/// | apply | `apply`, `apply_one`, `apply_group`: the transaction, its locks, the dedup record | `consumer/apply.rs` |
/// | settle | `settle`, `dead_letter`: ack, retry, dead letter, worn deliveries | `consumer/settle.rs` |
/// | order | `is_ordered`, `lane_queues`, `advance`, `park`: the gate | `consumer/ordered.rs` |
/// | parked | `release_loop`: unparked aggregates replayed in order | `consumer/park.rs` |
/// | replay | `replay`, `replay_between`: a view rebuilt from history | `consumer/replay.rs` |
pub struct Consumer<A> {
    amqp_url: String,
    config: ConsumerConfig,
    /// Where the consumer's state lives, and how an event changes it.
    state: A,
    stats: Arc<Counters>,
    health: Health,
    /// Groups waiting to join another lane's transaction.
    gather: gather::Gather,
    /// Held to read by every handler run, to write by a handed-back
    /// delivery's try: a try runs beside no other handler run of this
    /// consumer, so a death during it is its own (tries.rs).
    tries_alone: tokio::sync::RwLock<()>,
}

/// Where one applier adds up its progress: a lane's own `consumer_offsets`
/// stripe, so lanes and replicas do not queue on one hot row.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct Lane {
    index: usize,
    stripe: i16,
}

impl Lane {
    /// A stripe drawn at random: lanes of other processes draw theirs too,
    /// and nothing needs to know how many there are.
    fn new(index: usize) -> Self {
        let stripe = (uuid::Uuid::new_v4().as_u128() % u128::from(OFFSET_STRIPES)) as i16;
        Self { index, stripe }
    }
}

/// Progress stripes per tenant, consumer and source (docs/adr/0010).
const OFFSET_STRIPES: u16 = 64;

impl<A: Apply> Consumer<A> {
    fn build(amqp_url: &str, config: ConsumerConfig, state: A) -> Self {
        Self {
            amqp_url: amqp_url.to_owned(),
            config,
            state,
            stats: Arc::default(),
            health: Health::default(),
            gather: gather::Gather::default(),
            tries_alone: tokio::sync::RwLock::default(),
        }
    }

    /// Reports to `health` (the process's `/readyz`) as `consumer <name>`
    /// (`consumer <name> lane <i>` for each of several lanes): ready while
    /// connected, else why not.
    #[must_use]
    pub fn with_health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    fn health_part(&self, lane: usize) -> String {
        if self.config.lanes > 1 {
            format!("consumer {} lane {lane}", self.config.name)
        } else {
            format!("consumer {}", self.config.name)
        }
    }

    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }
}

/// A lock key from a payload field: `<aggregate>:<payload[field]>`, for a
/// handler whose state is keyed by an id the event carries (the order a
/// payment belongs to); the envelope's aggregate when the field is absent.
pub fn payload_lock_key(event: &Envelope, aggregate: &str, field: &str) -> String {
    match &event.payload[field] {
        serde_json::Value::Number(n) => format!("{aggregate}:{n}"),
        serde_json::Value::String(s) => format!("{aggregate}:{s}"),
        _ => format!("{}:{}", event.aggregate_type, event.aggregate_id),
    }
}

/// A transaction of `tenant` that holds the lock `consumer`'s appliers take
/// for `key` (their [`Handler::lock_key`]): for a repair that writes what
/// the handler writes, beside live appliers of the same consumer. Neither
/// sees the other's half-done work.
pub async fn begin_as_handler(
    pool: &sqlx::PgPool,
    consumer: &str,
    tenant: TenantId,
    key: &str,
) -> sqlx::Result<TenantTx> {
    TenantTx::begin_locked(pool, tenant, &[lock_id(consumer, tenant.get(), key)]).await
}

/// The advisory lock id of `key` (an aggregate's `type:id`) in
/// `consumer`'s state of `tenant`: the first 8 bytes of a SHA-256, so
/// every process computes the same, and an operator's session (or a
/// test, or a fault) can hold the lock an applier takes.
pub fn lock_id(consumer: &str, tenant: i64, key: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{consumer}\0{tenant}\0{key}").as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

fn tenant_of(event: &Envelope) -> Result<TenantId, ApplyError> {
    TenantId::new(event.tenant_id).map_err(|e| HandlerError::Permanent(e.into()).into())
}
