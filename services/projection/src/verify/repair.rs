//! Repairs, each under the lock the live appliers of the same consumer take
//! for the same entity (`consumer::begin_as_handler`), so a repair and a
//! live event take turns, and each is idempotent: run twice, or beside a
//! second verifier, it lands on the same rows.

use reliability::Result;
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::Envelope;
use sqlx::PgPool;

use super::{Key, Sources};
use crate::views::{self, Views};
use crate::{facts, reproject};

/// Re-derives one order view from the sources: every event of the order
/// that a source still holds (its outbox and archive) is stored through
/// the live handler (a no-op for those already stored), an event stored
/// that no source ever emitted is dropped when the sources hold the
/// order's whole history, the facts its rows state replace its facts
/// (`facts`: what the view keeps once the events are gone), and the view
/// is recomputed. Returns whether the sources held the whole history
/// (`OrderPlaced` included).
pub async fn order(projection: &PgPool, sources: &Sources, key: Key) -> Result<bool> {
    // Read before the projection's transaction: none is held across a
    // call to another database.
    let mut events = Vec::new();
    for (name, pool) in sources.named() {
        events.extend(history_of(pool, name, key).await?);
    }
    let rows = ::sources::order(sources, key, 0.0).await?;
    let whole = events
        .iter()
        .any(|e| e.event_type == contracts::event::ORDER_PLACED);
    let mut tx = reproject::lock(projection, key).await?;
    if whole {
        let (sources, ids): (Vec<&str>, Vec<i64>) =
            events.iter().map(|e| (e.source.as_str(), e.id)).unzip();
        sqlx::query(
            "DELETE FROM order_view_events v WHERE tenant_id = $1 AND order_id = $2
               AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::bigint[]) AS s(source, id)
                               WHERE s.source = v.source AND s.id = v.message_id)",
        )
        .bind(key.tenant_id)
        .bind(key.order_id)
        .bind(&sources)
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
    }
    for event in &events {
        match Views.handle(&mut tx, event).await {
            Ok(()) => {}
            Err(HandlerError::Database(e)) => return Err(e.into()),
            // The live consumer refuses it too (it is in the DLQ): what the
            // view shows without it is what it would show anyway.
            Err(e) => {
                tracing::warn!(order = key.order_id, message_id = %event.message_id(), error = %e, "repair: event not applicable")
            }
        }
    }
    if let Some(rows) = &rows {
        facts::replace(&mut tx, rows).await?;
    }
    views::recompute(&mut tx, key.order_id).await?;
    tx.commit().await?;
    Ok(whole)
}

/// The events of one order that `source` still holds, outbox and archive.
/// A full scan of both: a repair is rare and names few orders, and an
/// index for it would cost every insert of the outbox.
async fn history_of(owner: &PgPool, source: &str, key: Key) -> Result<Vec<Envelope>> {
    Ok(sqlx::query_as(
        "SELECT id, $3::text AS source, tenant_id, aggregate_type, aggregate_id, event_type,
                event_version, occurred_at, payload, aggregate_seq
         FROM (SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                      occurred_at, payload, aggregate_seq
               FROM outbox_messages
               UNION ALL
               SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                      occurred_at, payload, aggregate_seq
               FROM outbox_messages_archive) h
         WHERE tenant_id = $1 AND payload->>'order_id' = $2::text
         ORDER BY id",
    )
    .bind(key.tenant_id)
    .bind(key.order_id.to_string())
    .bind(source)
    .fetch_all(owner)
    .await?)
}
