//! Operators' view of a consumer's progress (`reliability offsets`), and
//! its reset: the owner role's reads and deletes of the library's
//! `consumer_offsets`.

use sqlx::PgPool;

use reliability::Result;

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
        // A replay from the start: ordered positions start again too.
        sqlx::query("DELETE FROM aggregate_positions WHERE consumer = $1")
            .bind(consumer)
            .execute(&mut *tx)
            .await?;
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
