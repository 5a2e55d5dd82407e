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

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::broker::{self, QueueSpec};
use crate::failpoint::{self, FailPoints};
use crate::health::Health;
use crate::outbox::Envelope;
use crate::{Error, Result, TenantId, TenantTx};

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

#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Retrying cannot help (the payload does not decode, an unknown
    /// version): dead-lettered at once.
    #[error("permanent: {0}")]
    Permanent(String),
    /// May succeed on a later try: retried, then dead-lettered.
    #[error("transient: {0}")]
    Transient(String),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

impl From<Error> for HandlerError {
    fn from(e: Error) -> Self {
        match e {
            Error::Database(e) => Self::Database(e),
            other => Self::Transient(other.to_string()),
        }
    }
}

/// What applying one message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// Seen before: nothing changed.
    Duplicate,
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
    /// Lanes in this process: each its own channel on the queue, applying
    /// its deliveries in turn, beside the others (docs/adr/0010).
    pub lanes: usize,
    pub fail_points: FailPoints,
}

impl ConsumerConfig {
    /// Queue `name` bound to `bindings` on `exchange`; 5 tries 200 ms apart
    /// (growing), prefetch 50 per lane, one lane, broker delivery limit 10.
    pub fn new(name: &str, exchange: &str, bindings: &[&str]) -> Self {
        Self {
            name: name.to_owned(),
            queue: QueueSpec {
                queue: name.to_owned(),
                exchange: exchange.to_owned(),
                bindings: bindings.iter().map(|b| (*b).to_owned()).collect(),
                delivery_limit: 10,
            },
            prefetch: 50,
            max_attempts: 5,
            retry_delay: Duration::from_millis(200),
            batch_max: 32,
            lanes: 1,
            fail_points: FailPoints::none(),
        }
    }
}

pub struct Consumer<H> {
    /// Connects as the runtime role: the handler runs under row-level security.
    pool: PgPool,
    amqp_url: String,
    config: ConsumerConfig,
    handler: H,
    stats: Arc<Counters>,
    health: Health,
}

#[derive(Debug, Default)]
struct Counters {
    applied: AtomicU64,
    duplicates: AtomicU64,
    dead_lettered: AtomicU64,
    retries: AtomicU64,
    grouped: AtomicU64,
    fallbacks: AtomicU64,
}

/// Deliveries this consumer finished since it was built (the same figures
/// as its metrics, readable without a recorder).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerStats {
    pub applied: u64,
    pub duplicates: u64,
    pub dead_lettered: u64,
    /// Failed tries that were retried (handler errors and outages alike).
    pub retries: u64,
    /// Of the applied and duplicates, those committed as part of a group.
    pub grouped: u64,
    /// Groups that failed and were applied one at a time instead (a
    /// handler error, or two appliers deadlocked: docs/adr/0010).
    pub fallbacks: u64,
}

impl ConsumerStats {
    /// Deliveries acked or dead-lettered.
    pub fn finished(&self) -> u64 {
        self.applied + self.duplicates + self.dead_lettered
    }
}

/// Where one applier adds up its progress: a lane's own `consumer_offsets`
/// stripe, so lanes and replicas do not queue on one hot row.
#[derive(Debug, Clone, Copy)]
struct Lane {
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

impl<H: Handler> Consumer<H> {
    pub fn new(pool: PgPool, amqp_url: &str, config: ConsumerConfig, handler: H) -> Self {
        Self {
            pool,
            amqp_url: amqp_url.to_owned(),
            config,
            handler,
            stats: Arc::default(),
            health: Health::default(),
        }
    }

    /// Reports to `health` (the process's `/readyz`) as `consumer <name>`:
    /// ready while every lane is connected, else why not.
    #[must_use]
    pub fn with_health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    fn health_part(&self) -> String {
        format!("consumer {}", self.config.name)
    }

    pub fn stats(&self) -> ConsumerStats {
        ConsumerStats {
            applied: self.stats.applied.load(Ordering::Relaxed),
            duplicates: self.stats.duplicates.load(Ordering::Relaxed),
            dead_lettered: self.stats.dead_lettered.load(Ordering::Relaxed),
            retries: self.stats.retries.load(Ordering::Relaxed),
            grouped: self.stats.grouped.load(Ordering::Relaxed),
            fallbacks: self.stats.fallbacks.load(Ordering::Relaxed),
        }
    }

    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// Applies `event` once: aggregate lock, dedup record and offset,
    /// handler, commit. Safe beside running consumers of the same name (a
    /// replay, a rebuild).
    pub async fn apply(&self, event: &Envelope) -> Result<Outcome, ApplyError> {
        self.apply_one(event, Lane::new(0)).await
    }

    async fn apply_one(&self, event: &Envelope, lane: Lane) -> Result<Outcome, ApplyError> {
        let mut tx = TenantTx::begin(&self.pool, tenant_of(event)?).await?;
        self.lock_aggregates(&mut tx, &[event]).await?;
        let fresh = self.record(&mut tx, &[event], lane).await?;
        let outcome = if fresh.is_empty() {
            Outcome::Duplicate
        } else {
            self.handler.prepare(&mut tx, &[event]).await?;
            self.handle(&mut tx, event).await?;
            self.before_commit()?;
            Outcome::Applied
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Applies a group of events in one transaction; all commit or none.
    /// The group is taken tenant by tenant (a stable sort: each tenant's
    /// events keep their delivery order; different tenants share nothing),
    /// so each tenant costs one `set_config` and one statement that records
    /// all its events and advances its offsets; then the handler prepares
    /// and runs for each fresh event. A message seen twice in the group is
    /// applied the first time, a duplicate after.
    ///
    /// Lock order, the same in every applier: every aggregate of the group
    /// (sorted), then per tenant (ascending) its progress rows and what the
    /// handler's `prepare` locks. No two appliers can wait on each other in
    /// a circle.
    async fn apply_group(
        &self,
        group: &[(Delivery, Envelope)],
        lane: Lane,
    ) -> Result<Vec<Outcome>, ApplyError> {
        let mut order: Vec<usize> = (0..group.len()).collect();
        order.sort_by_key(|&i| group[i].1.tenant_id);
        let mut tx = TenantTx::begin(&self.pool, tenant_of(&group[order[0]].1)?).await?;
        let all: Vec<&Envelope> = group.iter().map(|(_, e)| e).collect();
        self.lock_aggregates(&mut tx, &all).await?;
        let mut outcomes = vec![Outcome::Duplicate; group.len()];
        for run in order.chunk_by(|&a, &b| group[a].1.tenant_id == group[b].1.tenant_id) {
            tx.rescope(tenant_of(&group[run[0]].1)?).await?;
            let events: Vec<&Envelope> = run.iter().map(|&i| &group[i].1).collect();
            let mut fresh = self.record(&mut tx, &events, lane).await?;
            let to_apply: Vec<usize> = run
                .iter()
                .copied()
                .filter(|&i| fresh.remove(&(group[i].1.source.clone(), group[i].1.id)))
                .collect();
            if to_apply.is_empty() {
                continue;
            }
            let fresh_events: Vec<&Envelope> = to_apply.iter().map(|&i| &group[i].1).collect();
            self.handler.prepare(&mut tx, &fresh_events).await?;
            for i in to_apply {
                let (delivery, event) = &group[i];
                crate::trace::scope(trace_context(delivery), self.handle(&mut tx, event)).await?;
                outcomes[i] = Outcome::Applied;
            }
        }
        if outcomes.contains(&Outcome::Applied) {
            self.before_commit()?;
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// Takes the transaction-scoped advisory lock of every aggregate the
    /// events change, in ascending key order, in one statement. A key is
    /// the consumer, the tenant and the handler's lock key, hashed: the
    /// same in every process.
    async fn lock_aggregates(
        &self,
        tx: &mut TenantTx,
        events: &[&Envelope],
    ) -> Result<(), ApplyError> {
        let mut keys: Vec<i64> = events
            .iter()
            .filter_map(|e| {
                self.handler
                    .lock_key(e)
                    .map(|k| lock_id(&self.config.name, e.tenant_id, &k))
            })
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        keys.sort_unstable();
        keys.dedup();
        // PostgreSQL evaluates volatile output expressions after ORDER BY,
        // so the locks are taken in this order.
        sqlx::query("SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) AS u(k) ORDER BY k")
            .bind(&keys)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// One statement for any number of one tenant's events: the dedup
    /// records (the ones that already exist are duplicates) and, per
    /// source, the lane's progress stripe (highest id seen, events applied,
    /// duplicates absorbed; shown by `reliability offsets` and the e2e
    /// table). Returns the `(source, id)` pairs recorded now: the events to
    /// apply.
    async fn record(
        &self,
        tx: &mut TenantTx,
        events: &[&Envelope],
        lane: Lane,
    ) -> Result<HashSet<(String, i64)>, ApplyError> {
        let sources: Vec<&str> = events.iter().map(|e| e.source.as_str()).collect();
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        let fresh: Vec<(String, i64)> = sqlx::query_as(
            "WITH seen AS (
                 SELECT * FROM unnest($3::text[], $4::bigint[]) AS s (source, message_id)
             ), fresh AS (
                 INSERT INTO processed_messages (tenant_id, consumer, source, message_id)
                 SELECT DISTINCT $1::bigint, $2::text, source, message_id FROM seen
                 ORDER BY source, message_id -- one lock order for concurrent appliers
                 ON CONFLICT DO NOTHING
                 RETURNING source, message_id
             ), progress AS (
                 SELECT source, max(message_id) AS last_seen, count(*) AS seen,
                        (SELECT count(*) FROM fresh f WHERE f.source = s.source) AS applied
                 FROM seen s GROUP BY source
             ), bumped AS (
                 INSERT INTO consumer_offsets (tenant_id, consumer, source, stripe, last_seen_id, applied_count, duplicate_count)
                 SELECT $1, $2, source, $5, last_seen, applied, seen - applied FROM progress ORDER BY source
                 ON CONFLICT (tenant_id, consumer, source, stripe) DO UPDATE
                 SET last_seen_id = GREATEST(consumer_offsets.last_seen_id, EXCLUDED.last_seen_id),
                     applied_count = consumer_offsets.applied_count + EXCLUDED.applied_count,
                     duplicate_count = consumer_offsets.duplicate_count + EXCLUDED.duplicate_count,
                     updated_at = now()
             )
             SELECT source, message_id FROM fresh",
        )
        .bind(tx.tenant().get())
        .bind(&self.config.name)
        .bind(&sources)
        .bind(&ids)
        .bind(lane.stripe)
        .fetch_all(&mut **tx)
        .await?;
        Ok(fresh.into_iter().collect())
    }

    fn before_commit(&self) -> Result<(), ApplyError> {
        match self
            .config
            .fail_points
            .check(failpoint::CONSUMER_BEFORE_COMMIT)
        {
            Err(Error::FailPoint(name)) => Err(ApplyError::FailPoint(name)),
            _ => Ok(()),
        }
    }

    /// The handler for a freshly recorded event, in `tx` (not committed).
    #[tracing::instrument(skip_all, fields(consumer = %self.config.name, message_id = %event.message_id(), event_type = %event.event_type))]
    async fn handle(&self, tx: &mut TenantTx, event: &Envelope) -> Result<(), ApplyError> {
        if let Err(Error::FailPoint(name)) =
            self.config.fail_points.check(failpoint::CONSUMER_HANDLER)
        {
            return Err(HandlerError::Transient(format!("fail point {name} fired")).into());
        }
        self.handler.handle(tx, event).await?;
        Ok(())
    }

    /// Consumes until `shutdown`, reconnecting after broker or database
    /// outages. Stops between messages, never inside one. Returns an error
    /// only when a fail point fired (the simulated crash).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let mut delay = Duration::from_millis(100);
        self.health.starting(&self.health_part());
        while !shutdown.is_cancelled() {
            match self.run_connected(&shutdown).await {
                Ok(()) => return Ok(()),
                Err(e @ Error::FailPoint(_)) => return Err(e),
                Err(e) => {
                    self.health.not_ready(&self.health_part(), &e);
                    tracing::warn!(consumer = %self.config.name, error = %e, retry_in = ?delay, "consumer lost its broker; reconnecting");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
        Ok(())
    }

    /// One connection, one channel per lane. When one lane fails the others
    /// stop too (their transactions roll back, their deliveries go back to
    /// the queue when the connection closes) and all reconnect together.
    async fn run_connected(&self, shutdown: &CancellationToken) -> Result<()> {
        let conn =
            broker::connect(&self.amqp_url, &format!("{}-consumer", self.config.name)).await?;
        self.health.ready(&self.health_part());
        let lanes = self.config.lanes.max(1);
        let stop_lanes = shutdown.child_token();
        let result = futures_util::future::try_join_all((0..lanes).map(|i| {
            let stop = stop_lanes.clone();
            let conn = &conn;
            async move {
                let r = self.consume(conn, &stop, Lane::new(i)).await;
                if r.is_err() {
                    stop.cancel();
                }
                r
            }
        }))
        .await
        .map(|_| ());
        // Closing hands unacked deliveries back to the broker now rather than
        // at the heartbeat timeout; after a simulated crash too.
        let _ = broker::bounded(conn.close(200, "consumer stopped".into())).await;
        result
    }

    async fn consume(
        &self,
        conn: &lapin::Connection,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<()> {
        let channel = broker::bounded(conn.create_channel()).await?;
        broker::bounded(broker::declare_queue(&channel, &self.config.queue)).await?;
        broker::bounded(channel.basic_qos(self.config.prefetch, BasicQosOptions { global: false }))
            .await?;
        let tag = format!("{}-{}", self.config.name, uuid::Uuid::new_v4());
        let mut deliveries = broker::bounded(channel.basic_consume(
            self.config.queue.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions {
                no_local: false,
                no_ack: false,    // ack only after the commit
                exclusive: false, // lanes and replicas compete on the queue
                nowait: false,
            },
            FieldTable::default(),
        ))
        .await?;
        tracing::info!(consumer = %self.config.name, queue = %self.config.queue.queue, lane = lane.index, "consumer connected");
        let mut gauges = tokio::time::interval(Duration::from_secs(2));
        loop {
            let delivery = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                _ = gauges.tick() => {
                    // A connection can die without the delivery stream ending:
                    // never sit on a dead channel.
                    if !channel.status().connected() || !conn.status().connected() {
                        return Err(Error::Config("consumer channel closed".into()));
                    }
                    if lane.index == 0 {
                        let dlq = broker::dead_letter_queue(&self.config.queue.queue);
                        if let Ok(depth) = broker::bounded(broker::queue_depth(&channel, &dlq)).await {
                            metrics::gauge!(crate::metrics::CONSUMER_DLQ_DEPTH, "consumer" => self.config.name.clone()).set(f64::from(depth));
                        }
                        if let Ok(depth) = broker::bounded(broker::queue_depth(&channel, &self.config.queue.queue)).await {
                            metrics::gauge!(crate::metrics::CONSUMER_QUEUE_DEPTH, "consumer" => self.config.name.clone()).set(f64::from(depth));
                        }
                    }
                    continue;
                }
                next = deliveries.next() => match next {
                    Some(d) => d?,
                    None => return Err(Error::Config("consumer stream ended".into())),
                },
            };
            // Whatever else is already waiting joins it: one commit for all.
            let mut group = vec![delivery];
            while group.len() < self.config.batch_max {
                match deliveries.next().now_or_never() {
                    Some(Some(d)) => group.push(d?),
                    _ => break,
                }
            }
            let carry_on = if group.len() == 1 {
                self.process(group.remove(0), shutdown, lane).await?
            } else {
                self.process_group(group, shutdown, lane).await?
            };
            if !carry_on {
                return Ok(());
            }
        }
    }

    /// Handles one delivery to its end (acked or dead-lettered). Returns
    /// false if shutdown came while it waited to retry (left unacked: the
    /// broker redelivers it to the next consumer).
    async fn process(
        &self,
        delivery: Delivery,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        match self.parse(&delivery).await? {
            Some(event) => self.settle_traced(delivery, event, shutdown, lane).await,
            None => Ok(true),
        }
    }

    /// The envelope, or None once a malformed delivery is dead-lettered.
    async fn parse(&self, delivery: &Delivery) -> Result<Option<Envelope>> {
        match serde_json::from_slice(&delivery.data) {
            Ok(e) => Ok(Some(e)),
            Err(e) => {
                tracing::error!(consumer = %self.config.name, error = %e, "malformed message; dead-lettering");
                self.dead_letter(delivery, "malformed").await?;
                Ok(None)
            }
        }
    }

    /// Several waiting deliveries in one transaction, acked after its commit.
    /// If any fails, the group rolls back and each goes the one-at-a-time
    /// way with its own retries and dead-lettering.
    async fn process_group(
        &self,
        group: Vec<Delivery>,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        let mut parsed = Vec::with_capacity(group.len());
        for delivery in group {
            if let Some(event) = self.parse(&delivery).await? {
                parsed.push((delivery, event));
            }
        }
        if parsed.is_empty() {
            return Ok(true);
        }
        match self.apply_group(&parsed, lane).await {
            Ok(outcomes) => {
                self.config
                    .fail_points
                    .check(failpoint::CONSUMER_AFTER_COMMIT)?;
                // One ack for the group: every earlier delivery on this
                // channel is settled already (a lane handles its deliveries
                // in turn, and each lane has a channel of its own).
                let (last, _) = parsed.last().expect("a group is never empty");
                broker::bounded(last.ack(BasicAckOptions { multiple: true })).await?;
                for outcome in outcomes {
                    self.count(outcome);
                    self.stats.grouped.fetch_add(1, Ordering::Relaxed);
                }
                Ok(true)
            }
            Err(ApplyError::FailPoint(name)) => Err(Error::FailPoint(name)),
            Err(ApplyError::Handler(e)) => {
                tracing::debug!(consumer = %self.config.name, error = %e, size = parsed.len(), "group failed; applying one at a time");
                self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(crate::metrics::CONSUMER_GROUP_FALLBACKS, "consumer" => self.config.name.clone())
                    .increment(1);
                for (delivery, event) in parsed {
                    if !self.settle_traced(delivery, event, shutdown, lane).await? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }

    async fn settle_traced(
        &self,
        delivery: Delivery,
        event: Envelope,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        let ctx = trace_context(&delivery);
        let span = tracing::info_span!("consume", consumer = %self.config.name, message_id = %event.message_id(),
                                       event_type = %event.event_type, tenant_id = event.tenant_id, trace_id = %ctx.trace_id());
        crate::trace::scope(ctx, self.settle(delivery, event, shutdown, lane))
            .instrument(span)
            .await
    }

    fn count(&self, outcome: Outcome) {
        let (label, counter) = match outcome {
            Outcome::Applied => ("applied", &self.stats.applied),
            Outcome::Duplicate => ("duplicate", &self.stats.duplicates),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metrics::CONSUMER_MESSAGES, "consumer" => self.config.name.clone(), "outcome" => label)
            .increment(1);
        metrics::gauge!(crate::metrics::CONSUMER_LAST_APPLIED, "consumer" => self.config.name.clone())
            .set(chrono::Utc::now().timestamp_millis() as f64 / 1000.0);
    }

    /// Applies, retries and finally acks or dead-letters one parsed delivery.
    async fn settle(
        &self,
        delivery: Delivery,
        event: Envelope,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        let mut tries = 0;
        let mut outage_delay = Duration::from_millis(100);
        loop {
            let failure = match self.apply_one(&event, lane).await {
                Ok(outcome) => {
                    self.config
                        .fail_points
                        .check(failpoint::CONSUMER_AFTER_COMMIT)?;
                    broker::bounded(delivery.ack(BasicAckOptions { multiple: false })).await?;
                    self.count(outcome);
                    return Ok(true);
                }
                Err(ApplyError::FailPoint(name)) => return Err(Error::FailPoint(name)),
                Err(ApplyError::Handler(e)) => e,
            };
            let wait = match &failure {
                HandlerError::Permanent(_) => None,
                HandlerError::Database(e) if is_outage(e) => {
                    outage_delay = (outage_delay * 2).min(Duration::from_secs(5));
                    Some(outage_delay)
                }
                _ => {
                    tries += 1;
                    (tries < self.config.max_attempts).then(|| self.config.retry_delay * tries)
                }
            };
            let Some(wait) = wait else {
                tracing::error!(consumer = %self.config.name, message_id = %event.message_id(), error = %failure, tries, "handler failed for good; dead-lettering");
                self.dead_letter(&delivery, "handler_failed").await?;
                return Ok(true);
            };
            tracing::warn!(consumer = %self.config.name, message_id = %event.message_id(), error = %failure, retry_in = ?wait, "handler failed; retrying");
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::metrics::CONSUMER_RETRIES, "consumer" => self.config.name.clone())
                .increment(1);
            tokio::select! {
                () = shutdown.cancelled() => return Ok(false),
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    async fn dead_letter(&self, delivery: &Delivery, reason: &'static str) -> Result<()> {
        broker::bounded(delivery.reject(BasicRejectOptions { requeue: false })).await?;
        self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metrics::CONSUMER_DEAD_LETTERED, "consumer" => self.config.name.clone(), "reason" => reason)
            .increment(1);
        Ok(())
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

/// The advisory lock id of `key` in `consumer`'s state of `tenant`: the
/// first 8 bytes of a SHA-256, so every process computes the same.
fn lock_id(consumer: &str, tenant: i64, key: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{consumer}\0{tenant}\0{key}").as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

fn tenant_of(event: &Envelope) -> Result<TenantId, ApplyError> {
    TenantId::new(event.tenant_id).map_err(|e| HandlerError::Permanent(e.to_string()).into())
}

/// The W3C trace context the message carries, or a new root.
fn trace_context(delivery: &Delivery) -> crate::trace::TraceContext {
    let header = broker::header_str(&delivery.properties, crate::trace::HEADER);
    crate::trace::TraceContext::continue_from(header.as_deref())
}

/// The database is unreachable or shedding load: not the message's fault.
fn is_outage(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            // connection exception, admin shutdown, cannot connect now, too many
            // connections, serialization failure, deadlock
            c.starts_with("08")
                || c.starts_with("57P")
                || c.starts_with("53")
                || c == "40001"
                || c == "40P01"
        }),
        _ => false,
    }
}

/// A consumer's progress per source partition (operators' view).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct OffsetRow {
    pub consumer: String,
    pub source: String,
    pub tenant_id: i64,
    pub last_seen_id: i64,
    pub applied_count: i64,
    pub duplicate_count: i64,
    pub updated_at: chrono::DateTime<chrono::Utc>,
}

/// Every consumer's progress per source and tenant, or one consumer's (as
/// the owner role): its lanes' stripes added up.
pub async fn offsets(owner: &PgPool, consumer: Option<&str>) -> Result<Vec<OffsetRow>> {
    Ok(sqlx::query_as(
        "SELECT consumer, source, tenant_id, max(last_seen_id) AS last_seen_id,
                sum(applied_count)::bigint AS applied_count, sum(duplicate_count)::bigint AS duplicate_count,
                max(updated_at) AS updated_at
         FROM consumer_offsets WHERE $1::text IS NULL OR consumer = $1
         GROUP BY consumer, source, tenant_id
         ORDER BY consumer, source, tenant_id",
    )
    .bind(consumer)
    .fetch_all(owner)
    .await?)
}

/// Forgets a consumer's offsets; with `forget_processed`, its dedup records
/// too, so that a replay applies everything again (a projection rebuild).
/// Returns (offsets, dedup records) deleted.
pub async fn reset_offsets(
    owner: &PgPool,
    consumer: &str,
    forget_processed: bool,
) -> Result<(u64, u64)> {
    let mut tx = owner.begin().await?;
    let offsets = sqlx::query("DELETE FROM consumer_offsets WHERE consumer = $1")
        .bind(consumer)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    let processed = if forget_processed {
        sqlx::query("DELETE FROM processed_messages WHERE consumer = $1")
            .bind(consumer)
            .execute(&mut *tx)
            .await?
            .rows_affected()
    } else {
        0
    };
    tx.commit().await?;
    Ok((offsets, processed))
}
