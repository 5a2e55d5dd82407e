//! Rebuilding the projection (docs/adr/0006): forget every view, dedup
//! record and offset of the projection's consumer, then replay each source
//! service's event history (its outbox and archive) through the same
//! handler. The live consumer may keep running: the reset is one
//! transaction, the dedup records make the two meet without double
//! counting, and both take the same per-order lock (docs/adr/0010) before
//! they recompute a view.

use reliability::consumer::{Consumer, ConsumerConfig};
use service_kit::service::Databases;
use sqlx::PgPool;

use crate::views::{CONSUMER, Views};

/// How many events each source replayed.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RebuildReport {
    pub replayed: Vec<(String, usize)>,
}

/// `sources`: each source service's name and a pool on its database as its
/// owner role (the only one that reads the archive).
pub async fn rebuild(
    dbs: &Databases,
    sources: &[(String, PgPool)],
) -> reliability::Result<RebuildReport> {
    // One transaction: an event the live consumer applies while this runs
    // either lands before the reset (and loses its view row and its dedup
    // record together, so the replay applies it again) or after it (and
    // the replay finds its dedup record). Never one without the other.
    let mut reset = dbs.owner.begin().await?;
    // Every table the live consumer writes, in the order it writes them
    // (dedup and progress rows, then the view's events, then the view): taken
    // all at once, before anything, the reset and a live transaction wait on
    // each other one way only, never in a circle.
    sqlx::raw_sql(
        "LOCK TABLE processed_messages, consumer_offsets, order_view_events, order_view_facts,
                    order_views
         IN ACCESS EXCLUSIVE MODE",
    )
    .execute(&mut *reset)
    .await?;
    // The facts go too: this rebuild is the events' alone.
    sqlx::raw_sql("TRUNCATE order_view_events, order_view_facts, order_views")
        .execute(&mut *reset)
        .await?;
    sqlx::query("DELETE FROM processed_messages WHERE consumer = $1")
        .bind(CONSUMER)
        .execute(&mut *reset)
        .await?;
    sqlx::query("DELETE FROM consumer_offsets WHERE consumer = $1")
        .bind(CONSUMER)
        .execute(&mut *reset)
        .await?;
    reset.commit().await?;
    tracing::info!("projection reset; replaying sources");

    let replayer = Consumer::new(
        dbs.app.clone(),
        "",
        ConsumerConfig::new(CONSUMER, "", &[]),
        Views,
    );
    let replayed = replayer.replay(sources).await?;
    Ok(RebuildReport {
        replayed: replayed.into_iter().map(|r| (r.source, r.events)).collect(),
    })
}
