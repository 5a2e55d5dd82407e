//! The outbox archive's monthly partitions: made ahead, the default one\n//! pruned, old ones dropped.

use std::time::Duration;

use chrono::{Datelike, NaiveDate, Utc};
use sqlx::PgPool;

use reliability::Result;

use super::delete_in_batches;

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
