//! Housekeeping of the reliability tables, each runnable once or on a
//! schedule, all in bounded batches so no job holds long locks or bloats
//! WAL in one go. Runs as the owner role (it spans every tenant, and
//! partitions need DDL).
//!
//! Each step runs whatever the others did: one that fails (a partition
//! created by another process at the same moment, a lock) is logged and
//! counted on its own (`maintenance_errors_total{step}`), and
//! `maintenance_last_success_timestamp_seconds{step}` tells an operator
//! which step has not succeeded lately (docs/adr/0014).

use std::time::Duration;

use chrono::{Datelike, NaiveDate, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::Result;

#[derive(Debug, Clone)]
pub struct MaintenanceConfig {
    /// Processed outbox rows older than this move to the archive.
    pub archive_after: Duration,
    /// Archive partitions entirely older than this are dropped.
    pub drop_archive_after: Duration,
    /// Monthly partitions created ahead of now.
    pub months_ahead: u32,
    /// Dedup records older than this are deleted; far beyond any redelivery.
    pub forget_processed_after: Duration,
    pub batch_size: i64,
    pub interval: Duration,
}

impl Default for MaintenanceConfig {
    /// Archive after 7 days, drop archive partitions after 90, 3 months of
    /// partitions ahead, forget dedup records after 30 days, batches of
    /// 1000, every 10 minutes.
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        Self {
            archive_after: Duration::from_secs(7 * DAY),
            drop_archive_after: Duration::from_secs(90 * DAY),
            months_ahead: 3,
            forget_processed_after: Duration::from_secs(30 * DAY),
            batch_size: 1000,
            interval: Duration::from_secs(600),
        }
    }
}

#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MaintenanceReport {
    pub partitions_created: Vec<String>,
    pub partitions_dropped: Vec<String>,
    pub archived: u64,
    /// Archive rows older than the retention deleted from the default
    /// partition (which no partition drop ever removes).
    pub default_partition_pruned: u64,
    pub expired_keys_deleted: u64,
    pub processed_records_deleted: u64,
    /// The steps that failed, each with its error; the others ran.
    pub errors: Vec<(String, String)>,
}

/// Runs every job once; a step's failure is recorded in the report and
/// does not keep the next steps from running.
pub async fn run_once(owner: &PgPool, config: &MaintenanceConfig) -> Result<MaintenanceReport> {
    let mut report = MaintenanceReport::default();
    let mut errors = Vec::new();
    if let Some(created) = step(
        owner,
        &mut errors,
        "partitions",
        ensure_archive_partitions(owner, config.months_ahead),
    )
    .await
    {
        report.partitions_created = created;
    }
    if let Some(n) = step(
        owner,
        &mut errors,
        "archive",
        archive_processed(owner, config.archive_after, config.batch_size),
    )
    .await
    {
        report.archived = n;
    }
    if let Some(dropped) = step(
        owner,
        &mut errors,
        "drop_partitions",
        drop_old_archive_partitions(owner, config.drop_archive_after),
    )
    .await
    {
        report.partitions_dropped = dropped;
    }
    if let Some(n) = step(
        owner,
        &mut errors,
        "prune_default",
        prune_default_partition(owner, config.drop_archive_after, config.batch_size),
    )
    .await
    {
        report.default_partition_pruned = n;
    }
    if let Some(n) = step(
        owner,
        &mut errors,
        "idempotency_keys",
        delete_expired_idempotency_keys(owner, config.batch_size),
    )
    .await
    {
        report.expired_keys_deleted = n;
    }
    if let Some(n) = step(
        owner,
        &mut errors,
        "processed_messages",
        forget_processed_messages(owner, config.forget_processed_after, config.batch_size),
    )
    .await
    {
        report.processed_records_deleted = n;
    }
    report.errors = errors;
    if report.errors.is_empty() {
        tracing::info!(?report, "maintenance done");
    } else {
        tracing::warn!(?report, "maintenance done; some steps failed");
    }
    Ok(report)
}

/// Runs one step: its outcome in the metrics, its error in `errors`.
async fn step<T>(
    owner: &PgPool,
    errors: &mut Vec<(String, String)>,
    name: &'static str,
    job: impl Future<Output = Result<T>>,
) -> Option<T> {
    let outcome = job.await;
    let error = outcome.as_ref().err().map(ToString::to_string);
    // Best effort: a database that failed the step may fail this too.
    let _ = sqlx::query(
        "INSERT INTO maintenance_runs AS r (step, last_success_at, last_failure_at, last_error)
         VALUES ($1, CASE WHEN $2::text IS NULL THEN now() END, CASE WHEN $2::text IS NOT NULL THEN now() END, $2)
         ON CONFLICT (step) DO UPDATE SET
           last_success_at = COALESCE(EXCLUDED.last_success_at, r.last_success_at),
           last_failure_at = COALESCE(EXCLUDED.last_failure_at, r.last_failure_at),
           last_error = COALESCE(EXCLUDED.last_error, r.last_error)",
    )
    .bind(name)
    .bind(error.as_deref())
    .execute(owner)
    .await;
    match outcome {
        Ok(t) => {
            let now = Utc::now().timestamp() as f64;
            metrics::gauge!(crate::metrics::MAINTENANCE_LAST_SUCCESS, "step" => name).set(now);
            Some(t)
        }
        Err(e) => {
            tracing::warn!(step = name, error = %e, "maintenance step failed; the others still run");
            metrics::counter!(crate::metrics::MAINTENANCE_ERRORS, "step" => name).increment(1);
            errors.push((name.to_owned(), e.to_string()));
            None
        }
    }
}

/// A maintenance step's last success and failure (operators' view).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct StepRun {
    pub step: String,
    pub last_success_at: Option<chrono::DateTime<Utc>>,
    pub last_failure_at: Option<chrono::DateTime<Utc>>,
    pub last_error: Option<String>,
}

/// Every step's last runs, as the owner role.
pub async fn last_runs(owner: &PgPool) -> Result<Vec<StepRun>> {
    Ok(sqlx::query_as(
        "SELECT step, last_success_at, last_failure_at, last_error FROM maintenance_runs ORDER BY step",
    )
    .fetch_all(owner)
    .await?)
}

/// Runs every job each `config.interval` until `shutdown`.
pub async fn run(owner: PgPool, config: MaintenanceConfig, shutdown: CancellationToken) {
    loop {
        if let Err(e) = run_once(&owner, &config).await {
            tracing::warn!(error = %e, "maintenance failed; will try again next interval");
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(config.interval) => {}
        }
    }
}

fn month_start(date: NaiveDate) -> NaiveDate {
    date.with_day(1).expect("day 1 exists")
}

fn next_month(date: NaiveDate) -> NaiveDate {
    month_start(date)
        .checked_add_months(chrono::Months::new(1))
        .expect("date in range")
}

fn partition_name(month: NaiveDate) -> String {
    format!(
        "outbox_messages_archive_y{:04}m{:02}",
        month.year(),
        month.month()
    )
}

/// Creates the archive partitions of the current month and `months_ahead`
/// after it; returns those it created. Months are UTC months, whatever the
/// server's time zone. Rows of the month already in the default partition
/// move into the new one in the same transaction; each new partition gets
/// the parent's row-level security and grants.
pub async fn ensure_archive_partitions(owner: &PgPool, months_ahead: u32) -> Result<Vec<String>> {
    let mut created = Vec::new();
    let mut month = month_start(Utc::now().date_naive());
    for _ in 0..=months_ahead {
        let name = partition_name(month);
        let attached: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                            WHERE i.inhparent = 'outbox_messages_archive'::regclass AND c.relname = $1)",
        )
        .bind(&name)
        .fetch_one(owner)
        .await?;
        if !attached {
            create_partition(owner, &name, month).await?;
            created.push(name);
        }
        month = next_month(month);
    }
    Ok(created)
}

async fn create_partition(owner: &PgPool, name: &str, month: NaiveDate) -> Result<()> {
    // Name and bounds are computed from dates: nothing to inject. Bounds
    // carry their offset, so the session's time zone cannot shift them.
    let (from, to) = (
        format!("{month} 00:00:00+00"),
        format!("{} 00:00:00+00", next_month(month)),
    );
    let mut tx = owner.begin().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {name} (LIKE outbox_messages_archive INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
    )))
    .execute(&mut *tx)
    .await?;
    let moved = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH moved AS (
             DELETE FROM outbox_messages_archive_default
             WHERE occurred_at >= $1::timestamptz AND occurred_at < $2::timestamptz RETURNING *)
         INSERT INTO {name} SELECT * FROM moved"
    )))
    .bind(&from)
    .bind(&to)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE outbox_messages_archive ATTACH PARTITION {name} FOR VALUES FROM ('{from}') TO ('{to}')"
    )))
    .execute(&mut *tx)
    .await?;
    sqlx::query("SELECT secure_archive_partition($1::regclass)")
        .bind(name)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    if moved > 0 {
        tracing::info!(partition = %name, moved, "archive rows moved out of the default partition");
    }
    Ok(())
}

/// Deletes default-partition rows older than `older_than` (what a dropped
/// monthly partition would have taken with it), `batch` per statement.
pub async fn prune_default_partition(
    owner: &PgPool,
    older_than: Duration,
    batch: i64,
) -> Result<u64> {
    delete_in_batches(
        owner,
        "DELETE FROM outbox_messages_archive_default WHERE ctid IN (
             SELECT ctid FROM outbox_messages_archive_default
             WHERE occurred_at < now() - make_interval(secs => $2) LIMIT $1 FOR UPDATE SKIP LOCKED)",
        Some(older_than.as_secs_f64()),
        batch,
    )
    .await
}

/// Drops monthly archive partitions whose whole month ended more than
/// `older_than` ago; returns their names.
pub async fn drop_old_archive_partitions(
    owner: &PgPool,
    older_than: Duration,
) -> Result<Vec<String>> {
    let cutoff = (Utc::now()
        - chrono::Duration::from_std(older_than).unwrap_or(chrono::TimeDelta::MAX))
    .date_naive();
    let children: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i
         JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'outbox_messages_archive'::regclass",
    )
    .fetch_all(owner)
    .await?;
    let mut dropped = Vec::new();
    for name in children {
        let Some(month) = parse_partition_month(&name) else {
            continue;
        };
        if next_month(month) <= cutoff {
            // The name matched our own pattern: nothing to inject.
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {name}")))
                .execute(owner)
                .await?;
            dropped.push(name);
        }
    }
    Ok(dropped)
}

fn parse_partition_month(name: &str) -> Option<NaiveDate> {
    let rest = name.strip_prefix("outbox_messages_archive_y")?;
    let (year, month) = rest.split_once('m')?;
    NaiveDate::from_ymd_opt(year.parse().ok()?, month.parse().ok()?, 1)
}

/// Moves processed rows older than `older_than` to the archive, `batch`
/// rows per transaction; returns how many moved.
pub async fn archive_processed(owner: &PgPool, older_than: Duration, batch: i64) -> Result<u64> {
    let mut total = 0;
    loop {
        let moved = sqlx::query(
            "WITH moved AS (
                DELETE FROM outbox_messages WHERE id IN (
                    SELECT id FROM outbox_messages
                    WHERE processed_at < now() - make_interval(secs => $1)
                    ORDER BY processed_at
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED)
                RETURNING *)
             INSERT INTO outbox_messages_archive
                 (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload,
                  headers, occurred_at, available_at, processed_at, attempts, last_error)
             SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload,
                    headers, occurred_at, available_at, processed_at, attempts, last_error
             FROM moved",
        )
        .bind(older_than.as_secs_f64())
        .bind(batch)
        .execute(owner)
        .await?
        .rows_affected();
        total += moved;
        if moved < batch as u64 {
            return Ok(total);
        }
    }
}

/// Deletes expired idempotency keys, `batch` per statement.
pub async fn delete_expired_idempotency_keys(owner: &PgPool, batch: i64) -> Result<u64> {
    delete_in_batches(
        owner,
        "DELETE FROM idempotency_keys WHERE ctid IN (
             SELECT ctid FROM idempotency_keys WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED)",
        None,
        batch,
    )
    .await
}

/// Deletes consumer dedup records older than `older_than`.
pub async fn forget_processed_messages(
    owner: &PgPool,
    older_than: Duration,
    batch: i64,
) -> Result<u64> {
    delete_in_batches(
        owner,
        "DELETE FROM processed_messages WHERE ctid IN (
             SELECT ctid FROM processed_messages
             WHERE processed_at < now() - make_interval(secs => $2) LIMIT $1 FOR UPDATE SKIP LOCKED)",
        Some(older_than.as_secs_f64()),
        batch,
    )
    .await
}

async fn delete_in_batches(
    owner: &PgPool,
    sql: &'static str,
    age_secs: Option<f64>,
    batch: i64,
) -> Result<u64> {
    let mut total = 0;
    loop {
        let mut q = sqlx::query(sql).bind(batch);
        if let Some(age) = age_secs {
            q = q.bind(age);
        }
        let deleted = q.execute(owner).await?.rows_affected();
        total += deleted;
        if deleted < batch as u64 {
            return Ok(total);
        }
    }
}
