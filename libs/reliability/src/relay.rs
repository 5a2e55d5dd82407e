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

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::broker::{self, Outgoing, Publisher, QueueSpec, Sent};
use crate::failpoint::{self, FailPoints};
use crate::health::Health;
use crate::outbox::Envelope;
use crate::{Error, Result};

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
    /// Refused by the broker (returned or nacked): an attempt each.
    pub failed: usize,
    pub dead_lettered: usize,
    /// Not confirmed in time, or the connection went: left pending with no
    /// attempt counted (the broker blocked or went away, docs/adr/0013).
    pub unconfirmed: usize,
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.failed += other.failed;
        self.dead_lettered += other.dead_lettered;
        self.unconfirmed += other.unconfirmed;
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

    /// Claims, publishes and marks one batch of due rows.
    #[tracing::instrument(skip_all, fields(source = %self.config.source))]
    pub async fn relay_batch(&self, publisher: &Publisher) -> Result<BatchReport> {
        // A queue deleted since the publisher opened would silently miss
        // these events (the others' queues still take them, so nothing is
        // returned): check first; the reconnect declares it again.
        publisher.require_queues(&self.config.topology).await?;
        let tx = self.pool.begin().await?;
        match self.claim_and_send(tx, publisher).await? {
            Some(batch) => self.settle(batch).await,
            None => Ok(BatchReport::default()),
        }
    }

    /// Claims a batch in `tx` (which stays open, holding the rows) and
    /// publishes it without waiting for the confirms. None: nothing is due.
    async fn claim_and_send(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        publisher: &Publisher,
    ) -> Result<Option<InFlight>> {
        let rows: Vec<Claimed> = sqlx::query_as(
            "SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                    payload, headers, occurred_at
             FROM outbox_messages
             WHERE processed_at IS NULL AND available_at <= now()
             ORDER BY id
             LIMIT $1
             FOR UPDATE SKIP LOCKED",
        )
        .bind(self.config.batch_size)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(None);
        }
        self.config
            .fail_points
            .check(failpoint::RELAY_BEFORE_PUBLISH)?;
        let outgoing: Vec<Outgoing> = rows
            .iter()
            .map(|r| self.outgoing(r))
            .collect::<Result<_>>()?;
        let sent = publisher.send(&outgoing).await;
        Ok(Some(InFlight { tx, rows, sent }))
    }

    /// Awaits a sent batch's confirms and records what they say: confirmed
    /// rows processed, refused ones backed off (or moved to the DLQ table),
    /// unconfirmed ones left as they were. Then commits, releasing the rows.
    async fn settle(&self, batch: InFlight) -> Result<BatchReport> {
        let InFlight { mut tx, rows, sent } = batch;
        let results = sent.settle().await;

        // The broker has the messages; a crash from here to the commit means
        // they are published again (I1 says at least once; consumers dedup).
        self.config
            .fail_points
            .check(failpoint::RELAY_AFTER_CONFIRM)?;

        let mut done = Vec::new();
        let (mut failed_ids, mut failed_errors) = (Vec::new(), Vec::new());
        let mut unconfirmed = 0;
        for (row, result) in rows.iter().zip(results) {
            match result {
                Ok(()) => done.push(row.id),
                Err(e) if !e.is_refusal() => {
                    // Says nothing about the row: it stays as it was, due.
                    unconfirmed += 1;
                    tracing::debug!(outbox_id = row.id, error = %e, "not confirmed; left pending");
                }
                Err(e) => {
                    tracing::warn!(outbox_id = row.id, event_type = %row.event_type, error = %e, "publish failed");
                    metrics::counter!(crate::metrics::OUTBOX_PUBLISH_FAILURES, "source" => self.config.source.clone(), "event_type" => row.event_type.clone())
                        .increment(1);
                    failed_ids.push(row.id);
                    failed_errors.push(e.to_string());
                }
            }
        }

        mark_processed(&mut tx, &done).await?;
        let dead_lettered = if failed_ids.is_empty() {
            0
        } else {
            let moved = move_to_dlq(
                &mut tx,
                &failed_ids,
                &failed_errors,
                self.config.max_attempts,
            )
            .await?;
            schedule_retry(&mut tx, &failed_ids, &failed_errors, &self.config).await?;
            moved
        };
        tx.commit().await?;

        metrics::counter!(crate::metrics::OUTBOX_PUBLISHED, "source" => self.config.source.clone())
            .increment(done.len() as u64);
        if dead_lettered > 0 {
            tracing::error!(
                count = dead_lettered,
                "outbox rows moved to the DLQ table after too many attempts"
            );
        }
        if unconfirmed > 0 {
            metrics::counter!(crate::metrics::OUTBOX_UNCONFIRMED, "source" => self.config.source.clone())
                .increment(unconfirmed as u64);
        }
        Ok(BatchReport {
            claimed: rows.len(),
            published: done.len(),
            failed: failed_ids.len(),
            dead_lettered,
            unconfirmed,
        })
    }

    /// Keeps the broker busy across batches: up to `batches_in_flight`
    /// batches are claimed and published while the oldest one's confirms are
    /// awaited, and each is marked as its confirms arrive, oldest first (so
    /// a returned message is always matched to its row, see
    /// [`crate::broker::Sent::settle`]). Returns when nothing more is due
    /// and every batch is settled.
    pub async fn relay_window(&self, publisher: &Publisher) -> Result<BatchReport> {
        Ok(self.window_pass(publisher, usize::MAX).await?.0)
    }

    /// [`Relay::relay_window`], claiming at most `max_batches`; and whether
    /// more may be due (it stopped at the limit, not for lack of rows).
    async fn window_pass(
        &self,
        publisher: &Publisher,
        max_batches: usize,
    ) -> Result<(BatchReport, bool)> {
        let mut total = BatchReport::default();
        let mut window: VecDeque<InFlight> = VecDeque::new();
        let (mut more, mut claimed) = (true, 0);
        loop {
            if claimed >= max_batches && more {
                more = false;
                if window.is_empty() {
                    return Ok((total, true));
                }
            }
            if more {
                publisher.require_queues(&self.config.topology).await?;
            }
            while more
                && window.len() < self.config.batches_in_flight.max(1)
                && claimed < max_batches
            {
                // With batches in flight, never wait for a connection: the
                // pool may be full of our own (or other relays') claims,
                // released only as their confirms settle. Settle first.
                let tx = if window.is_empty() {
                    self.pool.begin().await?
                } else {
                    match self.pool.try_begin().await? {
                        Some(tx) => tx,
                        None => break,
                    }
                };
                match self.claim_and_send(tx, publisher).await? {
                    Some(batch) => {
                        more = batch.rows.len() as i64 == self.config.batch_size;
                        claimed += 1;
                        window.push_back(batch);
                    }
                    None => more = false,
                }
            }
            let Some(oldest) = window.pop_front() else {
                let at_limit = claimed >= max_batches && total.unconfirmed == 0;
                return Ok((total, at_limit));
            };
            let report = self.settle(oldest).await?;
            total.add(report);
            if report.unconfirmed > 0 {
                // Blocked or gone: claim nothing more before what is in
                // flight has settled.
                more = false;
            }
        }
    }

    /// Relays until none is due, with the window of batches in flight. For
    /// tests and one-shot tools.
    pub async fn drain(&self, publisher: &Publisher) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        loop {
            let report = self.relay_window(publisher).await?;
            total.add(report);
            if report.claimed == 0 || report.published == 0 || report.unconfirmed > 0 {
                return Ok(total);
            }
        }
    }

    /// Runs until `shutdown`: wakes on every outbox commit (LISTEN/NOTIFY),
    /// polls as a fallback, reconnects to the broker and the database after
    /// either goes away. Returns an error only when a fail point fired.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let mut delay = Duration::from_millis(100);
        self.health.starting(HEALTH_PART);
        while !shutdown.is_cancelled() {
            match self.run_connected(&shutdown).await {
                Ok(()) => return Ok(()),
                Err(e @ Error::FailPoint(_)) => return Err(e),
                Err(e) => {
                    self.health.not_ready(HEALTH_PART, &e);
                    tracing::warn!(error = %e, retry_in = ?delay, "relay lost its broker or database; reconnecting");
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

    async fn run_connected(&self, shutdown: &CancellationToken) -> Result<()> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        let publisher = self.publisher().await?;
        self.health.ready(HEALTH_PART);
        tracing::info!(source = %self.config.source, exchange = %self.config.exchange, "relay connected");
        let mut gauges_at = Instant::now() - Duration::from_secs(60);
        let mut tenants_at = gauges_at;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            // Bounded, so that gauges and shutdown get their turn under load.
            let (report, more_due) = self.window_pass(&publisher, 64).await?;
            if !publisher.is_usable() {
                return Err(Error::Config("publisher channel closed".into()));
            }
            if report.unconfirmed > 0 {
                // Blocked (a memory or disk alarm) or gone: back off and try a
                // fresh connection; the rows wait, costing no attempt.
                return Err(Error::BrokerTimeout(self.config.confirm_timeout));
            }
            if gauges_at.elapsed() >= Duration::from_secs(1) {
                self.update_gauges().await?;
                gauges_at = Instant::now();
            }
            // Counting every pending row is a scan of the backlog: less often.
            if tenants_at.elapsed() >= Duration::from_secs(10) {
                self.update_tenant_view().await?;
                tenants_at = Instant::now();
            }
            if more_due {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                n = listener.recv() => { n?; }
                () = tokio::time::sleep(self.config.poll_interval) => {}
            }
        }
    }

    /// `outbox_lag_seconds` (age of the oldest pending row), `outbox_dlq_depth`
    /// and `outbox_max_attempts` (most failures of a row still pending).
    pub async fn update_gauges(&self) -> Result<()> {
        let (lag, dlq, attempts): (f64, i64, i32) = sqlx::query_as(
            "SELECT COALESCE((SELECT EXTRACT(EPOCH FROM now() - occurred_at)::float8
                              FROM outbox_messages WHERE processed_at IS NULL
                              ORDER BY id LIMIT 1), 0),
                    (SELECT count(*) FROM outbox_messages_dlq),
                    COALESCE((SELECT max(attempts) FROM outbox_messages WHERE processed_at IS NULL AND attempts > 0), 0)",
        )
        .fetch_one(&self.pool)
        .await?;
        metrics::gauge!("outbox_max_attempts", "source" => self.config.source.clone())
            .set(f64::from(attempts));
        metrics::gauge!("outbox_lag_seconds", "source" => self.config.source.clone()).set(lag);
        metrics::gauge!("outbox_dlq_depth", "source" => self.config.source.clone()).set(dlq as f64);
        Ok(())
    }

    /// `outbox_pending` and, for the [`TOP_TENANTS`] tenants with the most
    /// pending rows, `outbox_tenant_pending` and `outbox_tenant_lag_seconds`;
    /// the others summed as `tenant="other"`, so the series stay bounded
    /// whatever the number of tenants.
    pub async fn update_tenant_view(&self) -> Result<()> {
        let rows: Vec<(i64, i64, f64)> = sqlx::query_as(
            "SELECT tenant_id, count(*), EXTRACT(EPOCH FROM now() - min(occurred_at))::float8
             FROM outbox_messages WHERE processed_at IS NULL
             GROUP BY tenant_id ORDER BY count(*) DESC, tenant_id",
        )
        .fetch_all(&self.pool)
        .await?;
        let source = &self.config.source;
        let total: i64 = rows.iter().map(|r| r.1).sum();
        metrics::gauge!(crate::metrics::OUTBOX_PENDING, "source" => source.clone())
            .set(total as f64);
        let (top, rest) = rows.split_at(rows.len().min(TOP_TENANTS));
        let mut pending: Vec<(Vec<String>, f64)> = Vec::with_capacity(top.len() + 1);
        let mut lag = pending.clone();
        for (tenant, n, age) in top {
            pending.push((vec![source.clone(), tenant.to_string()], *n as f64));
            lag.push((vec![source.clone(), tenant.to_string()], *age));
        }
        if !rest.is_empty() {
            let n: i64 = rest.iter().map(|r| r.1).sum();
            let age = rest.iter().map(|r| r.2).fold(0.0, f64::max);
            pending.push((vec![source.clone(), "other".into()], n as f64));
            lag.push((vec![source.clone(), "other".into()], age));
        }
        TENANT_PENDING.set(source, pending);
        TENANT_LAG.set(source, lag);
        Ok(())
    }

    fn outgoing(&self, row: &Claimed) -> Result<Outgoing> {
        let envelope = Envelope {
            id: row.id,
            source: self.config.source.clone(),
            tenant_id: row.tenant_id,
            aggregate_type: row.aggregate_type.clone(),
            aggregate_id: row.aggregate_id.clone(),
            event_type: row.event_type.clone(),
            event_version: row.event_version,
            occurred_at: row.occurred_at,
            payload: row.payload.clone(),
        };
        let headers = match &row.headers {
            Value::Object(map) => broker::headers_from_json(map),
            _ => Default::default(),
        };
        Ok(Outgoing {
            routing_key: envelope.routing_key(),
            message_id: envelope.message_id(),
            kind: envelope.event_type.clone(),
            headers,
            body: serde_json::to_vec(&envelope)?,
        })
    }
}

async fn mark_processed(tx: &mut sqlx::PgConnection, ids: &[i64]) -> Result<()> {
    if !ids.is_empty() {
        sqlx::query("UPDATE outbox_messages SET processed_at = now() WHERE id = ANY($1)")
            .bind(ids)
            .execute(tx)
            .await?;
    }
    Ok(())
}

/// Moves the rows whose next attempt would exceed `max_attempts` to the DLQ
/// table; returns how many.
async fn move_to_dlq(
    tx: &mut sqlx::PgConnection,
    ids: &[i64],
    errors: &[String],
    max_attempts: i32,
) -> Result<usize> {
    let moved = sqlx::query(
        "WITH failed AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS f(id, error)),
              moved AS (
                DELETE FROM outbox_messages o USING failed
                WHERE o.id = failed.id AND o.attempts + 1 > $3
                RETURNING o.*, failed.error)
         INSERT INTO outbox_messages_dlq
             (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
              payload, headers, occurred_at, attempts, last_error)
         SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                payload, headers, occurred_at, attempts + 1, error
         FROM moved",
    )
    .bind(ids)
    .bind(errors)
    .bind(max_attempts)
    .execute(tx)
    .await?;
    Ok(moved.rows_affected() as usize)
}

/// Backs the remaining failed rows off: `attempts + 1`, and due again after
/// `LEAST(attempts + 1, max_steps) * step`.
async fn schedule_retry(
    tx: &mut sqlx::PgConnection,
    ids: &[i64],
    errors: &[String],
    config: &RelayConfig,
) -> Result<()> {
    sqlx::query(
        "UPDATE outbox_messages o
         SET attempts = o.attempts + 1,
             available_at = now() + LEAST(o.attempts + 1, $3) * make_interval(secs => $4),
             last_error = f.error
         FROM unnest($1::bigint[], $2::text[]) AS f(id, error)
         WHERE o.id = f.id",
    )
    .bind(ids)
    .bind(errors)
    .bind(config.backoff_max_steps)
    .bind(config.backoff_step.as_secs_f64())
    .execute(tx)
    .await?;
    Ok(())
}

/// Puts outbox DLQ rows back in the outbox under their original id (so a
/// consumer that somehow saw them still deduplicates), attempts reset; all
/// of them when `ids` is `None`. Returns how many.
pub async fn redrive_dlq(owner: &PgPool, ids: Option<&[i64]>) -> Result<u64> {
    let moved = sqlx::query(
        "WITH moved AS (
            DELETE FROM outbox_messages_dlq WHERE $1::bigint[] IS NULL OR id = ANY($1) RETURNING *)
         INSERT INTO outbox_messages
             (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, occurred_at)
         OVERRIDING SYSTEM VALUE
         SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, occurred_at
         FROM moved",
    )
    .bind(ids)
    .execute(owner)
    .await?
    .rows_affected();
    Ok(moved)
}

/// An outbox row that exhausted its attempts, as an operator sees it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct DlqRow {
    pub id: i64,
    pub tenant_id: i64,
    pub event_type: String,
    pub aggregate_id: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub failed_at: DateTime<Utc>,
}

/// The first `limit` outbox DLQ rows by id.
pub async fn list_dlq(owner: &PgPool, limit: i64) -> Result<Vec<DlqRow>> {
    Ok(sqlx::query_as(
        "SELECT id, tenant_id, event_type, aggregate_id, attempts, last_error, failed_at
         FROM outbox_messages_dlq ORDER BY id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(owner)
    .await?)
}

/// Outbox health at a glance.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct OutboxStatus {
    pub pending: i64,
    pub oldest_pending_seconds: Option<f64>,
    pub max_attempts: Option<i32>,
    pub dlq: i64,
}

pub async fn outbox_status(owner: &PgPool) -> Result<OutboxStatus> {
    Ok(sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL) AS pending,
                (SELECT EXTRACT(EPOCH FROM now() - min(occurred_at))::float8
                 FROM outbox_messages WHERE processed_at IS NULL) AS oldest_pending_seconds,
                (SELECT max(attempts) FROM outbox_messages WHERE processed_at IS NULL) AS max_attempts,
                (SELECT count(*) FROM outbox_messages_dlq) AS dlq",
    )
    .fetch_one(owner)
    .await?)
}

/// One outbox DLQ row in full, payload included.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct DlqEntry {
    pub id: i64,
    pub tenant_id: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub payload: Value,
    pub headers: Value,
    pub occurred_at: DateTime<Utc>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub failed_at: DateTime<Utc>,
}

pub async fn show_dlq(owner: &PgPool, id: i64) -> Result<Option<DlqEntry>> {
    Ok(sqlx::query_as(
        "SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers,
                occurred_at, attempts, last_error, failed_at
         FROM outbox_messages_dlq WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(owner)
    .await?)
}

/// Deletes outbox DLQ rows for good (the given ids, or all); returns how many.
pub async fn purge_dlq(owner: &PgPool, ids: Option<&[i64]>) -> Result<u64> {
    Ok(
        sqlx::query("DELETE FROM outbox_messages_dlq WHERE $1::bigint[] IS NULL OR id = ANY($1)")
            .bind(ids)
            .execute(owner)
            .await?
            .rows_affected(),
    )
}
