//! The outbox relay (invariant I1): every committed outbox row reaches the
//! broker at least once.
//!
//! A batch is claimed with `FOR UPDATE SKIP LOCKED` (so relays can run side
//! by side without publishing the same row twice), published with pipelined
//! confirms, and marked `processed_at` only after the broker confirmed it. The
//! claim's transaction stays open across the publish, bounded by the confirm
//! timeout: if the relay dies anywhere before its commit the rows unlock and
//! are published again; consumers deduplicate (docs/adr/0001).
//!
//! Failures back off (`LEAST(attempts + 1, max_steps) * step`) and after
//! `max_attempts` failures a row moves to `outbox_messages_dlq`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;

use crate::broker::{self, Publisher, QueueSpec, Sent};
use crate::failpoint::FailPoints;
use crate::health::Health;
use crate::trace::Span;
use crate::{Error, Result};

mod claim;
mod message;
mod order;
mod publish;
mod record;
mod run;

/// The relay's name in `/readyz`.
const HEALTH_PART: &str = "relay";

/// The channel the outbox trigger notifies on commit.
pub const NOTIFY_CHANNEL: &str = "outbox_messages";

/// Tenants shown one by one in the per-tenant outbox view; the rest are "other".
pub const TOP_TENANTS: usize = 10;

static TENANT_PENDING: crate::metrics::Family =
    crate::metrics::Family::new(&crate::metrics::OUTBOX_TENANT_PENDING_METRIC);
static TENANT_LAG: crate::metrics::Family =
    crate::metrics::Family::new(&crate::metrics::OUTBOX_TENANT_LAG_METRIC);

#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The publishing service's name: first part of every routing key.
    pub source: String,
    pub exchange: String,
    /// Rows claimed and published per transaction.
    pub batch_size: i64,
    /// Batches published and awaiting confirms at once (each holds its
    /// claim's transaction): the next is claimed and sent while the
    /// broker confirms the previous, so it never waits on us.
    pub batches_in_flight: usize,
    /// Poll even without a notification (a NOTIFY can be missed while the
    /// listener reconnects).
    pub poll_interval: Duration,
    /// Wake on the outbox's commit notifications; off for the polling
    /// relay that sweeps beside a log relay (docs/adr/0038), which hears
    /// of each commit from the log instead.
    pub listens: bool,
    /// Backoff after a failed publish: `LEAST(attempts + 1, backoff_max_steps) * backoff_step`.
    pub backoff_step: Duration,
    pub backoff_max_steps: i32,
    /// A row that failed more often than this moves to the DLQ table.
    pub max_attempts: i32,
    /// How long the batch waits for the broker's confirms (and so the
    /// longest the claim's transaction stays open).
    pub confirm_timeout: Duration,
    /// Every subscriber queue the published events must reach: declared
    /// when the publisher opens and checked before each batch; a batch is
    /// not claimed while one is missing (docs/adr/0012).
    pub topology: Vec<QueueSpec>,
    pub fail_points: FailPoints,
}

impl RelayConfig {
    /// The platform defaults: batches of 500, 1 s poll, 30 s backoff steps up
    /// to 8, DLQ after 10 attempts, 10 s confirm timeout.
    pub fn new(source: &str, exchange: &str) -> Self {
        Self {
            source: source.to_owned(),
            exchange: exchange.to_owned(),
            batch_size: 500,
            batches_in_flight: 3,
            poll_interval: Duration::from_secs(1),
            listens: true,
            backoff_step: Duration::from_secs(30),
            backoff_max_steps: 8,
            max_attempts: 10,
            confirm_timeout: Duration::from_secs(10),
            topology: Vec::new(),
            fail_points: FailPoints::none(),
        }
    }
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    pub claimed: usize,
    pub published: usize,
    /// Refused by the broker (returned: no queue for it): an attempt each.
    pub failed: usize,
    pub dead_lettered: usize,
    /// Not confirmed in time, or the connection went: left pending with no
    /// attempt counted (the broker blocked or went away, docs/adr/0013).
    pub unconfirmed: usize,
    /// Nacked (a queue without its quorum, say): due again after one
    /// backoff step, no attempt counted (docs/adr/0023).
    pub deferred: usize,
    /// Claimed but held back: an earlier event of the same aggregate was
    /// still in another batch in flight (ordered subscribers only,
    /// docs/adr/0028). Published by a later pass.
    pub held: usize,
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.failed += other.failed;
        self.dead_lettered += other.dead_lettered;
        self.unconfirmed += other.unconfirmed;
        self.deferred += other.deferred;
        self.held += other.held;
    }
}

pub struct Relay {
    /// Connects as the relay role: the only role that sees every tenant's rows.
    pool: PgPool,
    amqp_url: String,
    config: RelayConfig,
    health: Health,
}

/// A claimed batch whose messages are with the broker, confirms pending.
struct InFlight {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    rows: Vec<Claimed>,
    sent: Sent,
    /// Each traced row's publish step, ended at its confirm.
    steps: Vec<Option<Span>>,
    /// Rows the claim took, and of them those held back (not in `rows`).
    claimed: usize,
    held: usize,
}

#[derive(sqlx::FromRow)]
struct Claimed {
    id: i64,
    tenant_id: i64,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    event_version: i32,
    payload: Value,
    headers: Value,
    occurred_at: DateTime<Utc>,
    aggregate_seq: Option<i64>,
}

impl Relay {
    pub fn new(pool: PgPool, amqp_url: &str, config: RelayConfig) -> Self {
        Self {
            pool,
            amqp_url: amqp_url.to_owned(),
            config,
            health: Health::default(),
        }
    }

    /// Reports to `health` (the process's `/readyz`): ready while connected
    /// with its topology declared, else why not.
    #[must_use]
    pub fn with_health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Opens a confirmed publisher on the configured exchange and declares
    /// the topology: every subscriber queue exists before the first publish.
    pub async fn publisher(&self) -> Result<Publisher> {
        let conn =
            broker::connect(&self.amqp_url, &format!("{}-relay", self.config.source)).await?;
        let publisher = Publisher::new(&conn, &self.config.exchange, self.config.confirm_timeout)
            .await?
            .with_fail_points(self.config.fail_points.clone());
        publisher
            .declare_topology(&self.config.topology)
            .await
            .map_err(|e| Error::Topology(format!("cannot declare the subscriber queues: {e}")))?;
        Ok(publisher)
    }
}
