//! Where a consumer's state lives: a [`Handler`]'s in PostgreSQL ([`Pg`]),
//! or a [`Sink`]'s in a store of its own (docs/adr/0030); and [`Apply`],
//! the steps in which the two differ.

use std::future::Future;

use lapin::message::Delivery;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::outbox::Envelope;
use crate::{Error, Result};

use super::apply::apply_span;
use super::{ApplyError, Consumer, ConsumerConfig, Handler, HandlerError, Lane, Outcome};

/// A [`Handler`]'s state in PostgreSQL: each event's dedup record, effect
/// and offsets in one transaction of the runtime role (row-level security
/// applies to the handler).
pub struct Pg<H> {
    pub(super) pool: PgPool,
    pub(super) handler: H,
}

/// A consumer's state kept outside PostgreSQL (a graph, a search index).
/// The store records each event as seen in the same atomic write as the
/// event's effect, keyed where the state lives, so a redelivery, a replay
/// or a second applier changes nothing (docs/adr/0030): a checkpoint
/// written apart from the effect would be lost or early after a crash
/// between the two. Order-free subscriptions only: the parked store of an
/// ordered one lives in PostgreSQL.
pub trait Sink: Send + Sync + 'static {
    /// Applies `events` (delivery order, any tenants), each at most once:
    /// for each, [`Outcome::Applied`] or [`Outcome::Duplicate`]. On an
    /// error some may have been applied: they are duplicates when the
    /// events come again.
    fn apply(
        &self,
        events: &[&Envelope],
    ) -> impl Future<Output = Result<Vec<Outcome>, HandlerError>> + Send;
}

/// How a consumer applies: [`Pg`] (a [`Handler`] in PostgreSQL) or any
/// [`Sink`]. The lanes, retries, dead-lettering and acks are the same for
/// both; only these steps differ.
pub trait Apply: Send + Sync + Sized + 'static {
    #[doc(hidden)]
    fn one(
        c: &Consumer<Self>,
        event: &Envelope,
        lane: Lane,
    ) -> impl Future<Output = Result<Outcome, ApplyError>> + Send;
    #[doc(hidden)]
    fn group(
        c: &Consumer<Self>,
        group: &[(Delivery, Envelope)],
        lane: Lane,
    ) -> impl Future<Output = Result<Vec<Outcome>, ApplyError>> + Send;
    /// Ordered subscriptions: `event` failed for good; park its aggregate.
    #[doc(hidden)]
    fn park(
        c: &Consumer<Self>,
        event: &Envelope,
        error: &HandlerError,
        lane: Lane,
    ) -> impl Future<Output = Result<Outcome, ApplyError>> + Send;
    /// Ordered subscriptions: the parked gauges and released aggregates.
    #[doc(hidden)]
    fn release(c: &Consumer<Self>, stop: &CancellationToken) -> impl Future<Output = ()> + Send;
    /// Whether the tries of a handed-back delivery are counted (tries.rs).
    #[doc(hidden)]
    const COUNTS_TRIES: bool;
    /// One more try of `event`, committed: the tries so far.
    #[doc(hidden)]
    fn record_try(c: &Consumer<Self>, event: &Envelope)
    -> impl Future<Output = Result<i32>> + Send;
    /// `event` is settled: its tries are forgotten.
    #[doc(hidden)]
    fn forget_tries(c: &Consumer<Self>, event: &Envelope) -> impl Future<Output = ()> + Send;
    /// `event` is about to be dead-lettered for `error`: why is kept
    /// (causes.rs).
    #[doc(hidden)]
    fn record_cause(
        c: &Consumer<Self>,
        event: &Envelope,
        reason: &str,
        error: &HandlerError,
    ) -> impl Future<Output = ()> + Send;
}

impl<H: Handler> Apply for Pg<H> {
    async fn one(c: &Consumer<Self>, event: &Envelope, lane: Lane) -> Result<Outcome, ApplyError> {
        c.apply_one(event, lane).await
    }
    async fn group(
        c: &Consumer<Self>,
        group: &[(Delivery, Envelope)],
        lane: Lane,
    ) -> Result<Vec<Outcome>, ApplyError> {
        c.apply_group(group, lane).await
    }
    async fn park(
        c: &Consumer<Self>,
        event: &Envelope,
        error: &HandlerError,
        lane: Lane,
    ) -> Result<Outcome, ApplyError> {
        c.park_failed(event, error, lane).await
    }
    async fn release(c: &Consumer<Self>, stop: &CancellationToken) {
        c.release_loop(stop).await;
    }
    const COUNTS_TRIES: bool = true;
    async fn record_try(c: &Consumer<Self>, event: &Envelope) -> Result<i32> {
        c.record_try_pg(event).await
    }
    async fn forget_tries(c: &Consumer<Self>, event: &Envelope) {
        c.forget_tries_pg(event).await;
    }
    async fn record_cause(c: &Consumer<Self>, event: &Envelope, reason: &str, e: &HandlerError) {
        c.record_cause_pg(event, reason, e).await;
    }
}

impl<S: Sink> Apply for S {
    async fn one(c: &Consumer<Self>, event: &Envelope, _: Lane) -> Result<Outcome, ApplyError> {
        let outcomes = c.state.apply(&[event]).await?;
        Ok(outcomes.first().copied().unwrap_or(Outcome::Duplicate))
    }
    async fn group(
        c: &Consumer<Self>,
        group: &[(Delivery, Envelope)],
        _: Lane,
    ) -> Result<Vec<Outcome>, ApplyError> {
        let events: Vec<&Envelope> = group.iter().map(|(_, e)| e).collect();
        // One step per event, as the one-at-a-time way traces it; the
        // sink's one call is all of theirs.
        let mut steps: Vec<_> = group
            .iter()
            .map(|(delivery, event)| apply_span(&c.config, delivery, event))
            .collect();
        let outcomes = match c.state.apply(&events).await {
            Ok(outcomes) => outcomes,
            Err(e) => {
                for step in &mut steps {
                    step.fail(&e);
                }
                return Err(e.into());
            }
        };
        if outcomes.len() != events.len() {
            let why = format!(
                "a sink answered {} outcomes for {} events",
                outcomes.len(),
                events.len()
            );
            return Err(HandlerError::Permanent(why.into()).into());
        }
        Ok(outcomes)
    }
    async fn park(
        _: &Consumer<Self>,
        _: &Envelope,
        _: &HandlerError,
        _: Lane,
    ) -> Result<Outcome, ApplyError> {
        Err(HandlerError::Permanent("a sink cannot park: it consumes order-free".into()).into())
    }
    async fn release(_: &Consumer<Self>, _: &CancellationToken) {}
    // A sink has no table to count tries in: a handed-back delivery is
    // dead-lettered by the queue's delivery limit alone.
    const COUNTS_TRIES: bool = false;
    async fn record_try(_: &Consumer<Self>, _: &Envelope) -> Result<i32> {
        Ok(0)
    }
    async fn forget_tries(_: &Consumer<Self>, _: &Envelope) {}
    // A sink has no table here either: its letters show no recorded cause.
    async fn record_cause(_: &Consumer<Self>, _: &Envelope, _: &str, _: &HandlerError) {}
}

impl<H: Handler> Consumer<Pg<H>> {
    pub fn new(pool: PgPool, amqp_url: &str, config: ConsumerConfig, handler: H) -> Self {
        Self::build(amqp_url, config, Pg { pool, handler })
    }

    pub fn handler(&self) -> &H {
        &self.state.handler
    }
}

impl<S: Sink> Consumer<S> {
    /// A consumer whose state `sink` keeps. Refused for an ordered
    /// subscription: parking needs PostgreSQL.
    pub fn with_sink(amqp_url: &str, config: ConsumerConfig, sink: S) -> Result<Self> {
        if config.queue.is_ordered() {
            return Err(Error::Config(format!(
                "consumer {}: an ordered subscription keeps its state in PostgreSQL, not in a sink",
                config.name
            )));
        }
        Ok(Self::build(amqp_url, config, sink))
    }

    pub fn sink(&self) -> &S {
        &self.state
    }
}
