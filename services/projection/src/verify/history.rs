//! The ordered history against the order it must have: within an
//! aggregate, the relay's numbers (`aggregate_seq`) one after another, and
//! events a relay published without a number (before numbering began)
//! before the numbered ones, in outbox order. The gate applies nothing
//! out of order (docs/adr/0028), in flight or not, so that needs no grace
//! period and no look at the sources.
//!
//! A number skipped is a defect here because this subscription binds every
//! event its sources number in an aggregate (`orders.*`; inventory's
//! product aggregate has one event, `StockAdjusted`): a relay numbers all
//! of an aggregate's events. The gate lets a number go by (an ordered
//! subscription that binds fewer events sees them skipped by design), so
//! a dead-lettered event leaves a gap that only this check names.

use reliability::consumer::begin_as_handler;
use reliability::{Result, TenantId};
use sqlx::PgPool;

use crate::history::CONSUMER;

/// An aggregate's place in the keyset.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Aggregate {
    pub tenant_id: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
}

/// What is wrong with one aggregate's history. Numbers run from 1 with
/// none missing, whatever order they were applied in.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finding {
    pub aggregate: Aggregate,
    /// An event applied before one that comes earlier.
    pub out_of_order: bool,
    /// A number skipped: an event never applied.
    pub gap: bool,
}

/// The next `limit` aggregates after `after`: how many were looked at,
/// the last of them, and those whose history is wrong.
pub async fn after(
    projection: &PgPool,
    after: &Aggregate,
    limit: i64,
) -> Result<(usize, Option<Aggregate>, Vec<Finding>)> {
    let rows: Vec<(i64, String, String, bool, bool)> = sqlx::query_as(
        "WITH a AS (SELECT DISTINCT tenant_id, aggregate_type, aggregate_id FROM aggregate_history
                    WHERE (tenant_id, aggregate_type, aggregate_id) > ($1, $2, $3)
                    ORDER BY 1, 2, 3 LIMIT $4),
              p AS (SELECT h.tenant_id, h.aggregate_type, h.aggregate_id,
                           h.aggregate_seq AS seq, h.message_id AS id,
                           lag(h.aggregate_seq) OVER w AS prev_seq, lag(h.message_id) OVER w AS prev_id
                    FROM aggregate_history h JOIN a USING (tenant_id, aggregate_type, aggregate_id)
                    WINDOW w AS (PARTITION BY h.tenant_id, h.aggregate_type, h.aggregate_id ORDER BY h.position))
         SELECT tenant_id, aggregate_type, aggregate_id,
                coalesce(bool_or(CASE WHEN prev_id IS NULL THEN false
                                      WHEN seq IS NOT NULL AND prev_seq IS NOT NULL THEN seq <= prev_seq
                                      WHEN seq IS NULL AND prev_seq IS NOT NULL THEN true
                                      WHEN seq IS NULL THEN id < prev_id
                                      ELSE false END), false),
                coalesce(min(seq) > 1 OR max(seq) - min(seq) + 1 <> count(seq), false)
         FROM p GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
    )
    .bind(after.tenant_id)
    .bind(&after.aggregate_type)
    .bind(&after.aggregate_id)
    .bind(limit)
    .fetch_all(projection)
    .await?;
    let looked = rows.len();
    let mut last = None;
    let mut findings = Vec::new();
    for (tenant_id, aggregate_type, aggregate_id, out_of_order, gap) in rows {
        let aggregate = Aggregate {
            tenant_id,
            aggregate_type,
            aggregate_id,
        };
        if out_of_order || gap {
            findings.push(Finding {
                aggregate: aggregate.clone(),
                out_of_order,
                gap,
            });
        }
        last = Some(aggregate);
    }
    Ok((looked, last, findings))
}

/// Puts an aggregate's applied events back in their order (unnumbered by
/// outbox id first, then by number), under the lock the ordered consumer
/// takes for the aggregate. A gap stays a gap: the missing event is in the
/// broker or parked, and only its delivery fills it.
pub async fn reorder(projection: &PgPool, aggregate: &Aggregate) -> Result<()> {
    let tenant = TenantId::new(aggregate.tenant_id)
        .map_err(|e| reliability::Error::Config(format!("history key: {e}")))?;
    let key = format!("{}:{}", aggregate.aggregate_type, aggregate.aggregate_id);
    let mut tx = begin_as_handler(projection, CONSUMER, tenant, &key).await?;
    // Through negative positions: the primary key is checked row by row.
    sqlx::query(
        "UPDATE aggregate_history h SET position = -n.rn
         FROM (SELECT position, row_number() OVER (ORDER BY aggregate_seq IS NOT NULL, aggregate_seq, message_id)::int AS rn
               FROM aggregate_history WHERE tenant_id = $1 AND aggregate_type = $2 AND aggregate_id = $3) n
         WHERE h.tenant_id = $1 AND h.aggregate_type = $2 AND h.aggregate_id = $3 AND h.position = n.position",
    )
    .bind(aggregate.tenant_id)
    .bind(&aggregate.aggregate_type)
    .bind(&aggregate.aggregate_id)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE aggregate_history SET position = -position
         WHERE tenant_id = $1 AND aggregate_type = $2 AND aggregate_id = $3",
    )
    .bind(aggregate.tenant_id)
    .bind(&aggregate.aggregate_type)
    .bind(&aggregate.aggregate_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}
