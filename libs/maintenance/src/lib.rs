#![doc = include_str!("../README.md")]

use std::time::Duration;

use chrono::Utc;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use reliability::Result;

mod partitions;
pub use partitions::{
    drop_old_archive_partitions, ensure_archive_partitions, prune_default_partition,
};

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
            metrics::gauge!(reliability::metrics::MAINTENANCE_LAST_SUCCESS, "step" => name)
                .set(now);
            Some(t)
        }
        Err(e) => {
            tracing::warn!(step = name, error = %e, "maintenance step failed; the others still run");
            metrics::counter!(reliability::metrics::MAINTENANCE_ERRORS, "step" => name)
                .increment(1);
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
                  headers, occurred_at, available_at, processed_at, attempts, last_error, aggregate_seq)
             SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload,
                    headers, occurred_at, available_at, processed_at, attempts, last_error, aggregate_seq
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

/// Deletes consumer dedup records older than `older_than`, and the causes
/// of dead letters recorded as long ago: a letter left in its DLQ that
/// long shows its cause as not recorded.
pub async fn forget_processed_messages(
    owner: &PgPool,
    older_than: Duration,
    batch: i64,
) -> Result<u64> {
    let age = Some(older_than.as_secs_f64());
    let records = delete_in_batches(
        owner,
        "DELETE FROM processed_messages WHERE ctid IN (
             SELECT ctid FROM processed_messages
             WHERE processed_at < now() - make_interval(secs => $2) LIMIT $1 FOR UPDATE SKIP LOCKED)",
        age,
        batch,
    )
    .await?;
    delete_in_batches(
        owner,
        "DELETE FROM dead_letter_causes WHERE ctid IN (
             SELECT ctid FROM dead_letter_causes
             WHERE dead_lettered_at < now() - make_interval(secs => $2) LIMIT $1 FOR UPDATE SKIP LOCKED)",
        age,
        batch,
    )
    .await?;
    Ok(records)
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
