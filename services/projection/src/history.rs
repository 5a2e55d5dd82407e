//! Each order's and each product's events in the order they happened
//! (`GET /history/{aggregate_type}/{aggregate_id}`). Unlike the order view,
//! this is not a function of the set of events but of their sequence, so
//! its subscription is ordered (docs/adr/0028): one aggregate's events
//! arrive one at a time, in outbox order, and the library parks an
//! aggregate whose event fails for good instead of applying past it.

use reliability::TenantTx;
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::Envelope;

pub const CONSUMER: &str = contracts::topology::PROJECTION_HISTORY.consumer;

pub struct History;

impl Handler for History {
    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        // Only events the contract knows, in a version it knows: anything
        // else fails for good, and parks its aggregate.
        e.event()?;
        // The next position of the aggregate; its primary key refuses a
        // second applier writing the same one. The tenant is named as well
        // as enforced by row-level security: two tenants' products share
        // SKUs, and a statement read by the owner would not be filtered.
        sqlx::query(
            "INSERT INTO aggregate_history
                 (tenant_id, aggregate_type, aggregate_id, position, aggregate_seq, source, message_id, event_type, occurred_at, payload)
             SELECT $1, $2, $3, coalesce(max(position), 0) + 1, $4, $5, $6, $7, $8, $9
             FROM aggregate_history WHERE tenant_id = $1 AND aggregate_type = $2 AND aggregate_id = $3",
        )
        .bind(tx.tenant().get())
        .bind(&e.aggregate_type)
        .bind(&e.aggregate_id)
        .bind(e.aggregate_seq)
        .bind(&e.source)
        .bind(e.id)
        .bind(&e.event_type)
        .bind(e.occurred_at)
        .bind(&e.payload)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// One aggregate's history, oldest first (empty if none of its events arrived).
pub async fn read(
    conn: &mut sqlx::PgConnection,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<Vec<Entry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT position, event_type, source, occurred_at, payload FROM aggregate_history
         WHERE aggregate_type = $1 AND aggregate_id = $2 ORDER BY position",
    )
    .bind(aggregate_type)
    .bind(aggregate_id)
    .fetch_all(conn)
    .await
}

#[derive(Debug, PartialEq, serde::Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Entry {
    /// 1, 2, 3...: the order the events happened in.
    pub position: i32,
    #[serde(rename = "type")]
    pub event_type: String,
    pub source: String,
    pub occurred_at: chrono::DateTime<chrono::Utc>,
    pub payload: serde_json::Value,
}
