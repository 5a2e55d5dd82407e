//! The outbox and its DLQ table as operators use them (`reliability
//! outbox …`, and `status`): the relay moves a row to the DLQ table after
//! its attempts (`reliability::relay`); what is done with it after is the
//! operator's.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;

use reliability::Result;

/// Puts outbox DLQ rows back in the outbox under their original id (so a
/// consumer that somehow saw them still deduplicates), attempts reset; all
/// of them when `ids` is `None`. Returns how many.
pub async fn redrive_dlq(owner: &PgPool, ids: Option<&[i64]>) -> Result<u64> {
    let moved = sqlx::query(
        "WITH moved AS (
            DELETE FROM outbox_messages_dlq WHERE $1::bigint[] IS NULL OR id = ANY($1) RETURNING *)
         INSERT INTO outbox_messages
             (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, occurred_at,
              aggregate_seq)
         OVERRIDING SYSTEM VALUE
         SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, occurred_at,
                aggregate_seq
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
    /// When the oldest row in the DLQ table got there.
    pub dlq_oldest_at: Option<DateTime<Utc>>,
}

pub async fn outbox_status(owner: &PgPool) -> Result<OutboxStatus> {
    Ok(sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL) AS pending,
                (SELECT EXTRACT(EPOCH FROM now() - min(occurred_at))::float8
                 FROM outbox_messages WHERE processed_at IS NULL) AS oldest_pending_seconds,
                (SELECT max(attempts) FROM outbox_messages WHERE processed_at IS NULL) AS max_attempts,
                (SELECT count(*) FROM outbox_messages_dlq) AS dlq,
                (SELECT min(failed_at) FROM outbox_messages_dlq) AS dlq_oldest_at",
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
