//! Rebuilding the graph (docs/adr/0030): the sources' event history
//! (outbox and archive) replayed into a fresh graph while the live consumer
//! goes on with the old one, then the fresh graph put in its place in one
//! step, then the history replayed once more into it: what the live
//! consumer applied to the old graph meanwhile is in the history too, late
//! commits included, and everything else is a duplicate by then.

use std::sync::Arc;

use reliability::consumer::{Consumer, ConsumerConfig, Replayed};
use sqlx::PgPool;

use crate::GraphSettings;
use crate::apply::Edges;
use crate::store::Store;
use crate::verify::repair::upstream;

/// The live consumer's name: the checkpoints are its.
pub const CONSUMER: &str = contracts::topology::GRAPH_EDGES.consumer;

#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RebuildReport {
    /// Each source's history, into the fresh graph.
    pub replayed: Vec<Replayed>,
    /// Events applied after the swap: what the live consumer had applied
    /// only to the old graph while the fresh one was built.
    pub caught_up: usize,
}

/// `sources`: each source service's name and a pool on its database as
/// its owner role.
pub async fn rebuild(
    graph: &GraphSettings,
    sources: &[(String, PgPool)],
) -> reliability::Result<RebuildReport> {
    let (fresh, replayed) = build_fresh(graph, sources).await?;
    swap(&fresh, graph).await?;
    let caught_up = catch_up(graph, sources).await?;
    Ok(RebuildReport {
        replayed,
        caught_up,
    })
}

/// Step 1: the history into `<name>.rebuild`, the live graph untouched.
pub async fn build_fresh(
    graph: &GraphSettings,
    sources: &[(String, PgPool)],
) -> reliability::Result<(Arc<Store>, Vec<Replayed>)> {
    let fresh = Arc::new(Store::new(
        &graph.graph_url,
        &format!("{}.rebuild", graph.graph_name),
    ));
    // An interrupted rebuild's leftovers.
    fresh.delete().await.map_err(upstream)?;
    let replayed = replay(&fresh, sources).await?;
    Ok((fresh, replayed))
}

/// Step 2: the fresh graph in the live one's place, in one step.
pub async fn swap(fresh: &Store, graph: &GraphSettings) -> reliability::Result<()> {
    fresh.replace(&graph.graph_name).await.map_err(upstream)?;
    tracing::info!(graph = %graph.graph_name, "rebuilt graph in place; catching up");
    Ok(())
}

/// Step 3: the history once more, into the graph now live: returns how
/// many events only the old graph had had.
pub async fn catch_up(
    graph: &GraphSettings,
    sources: &[(String, PgPool)],
) -> reliability::Result<usize> {
    let live = Arc::new(graph.store());
    Ok(replay(&live, sources)
        .await?
        .iter()
        .map(|r| r.applied)
        .sum())
}

async fn replay(
    store: &Arc<Store>,
    sources: &[(String, PgPool)],
) -> reliability::Result<Vec<Replayed>> {
    replayer(store)?.replay(sources).await
}

/// The live consumer's statements into `store`, for a replay (its
/// checkpoints are the live consumer's: what it applied is a duplicate).
pub(crate) fn replayer(store: &Arc<Store>) -> reliability::Result<Consumer<Edges>> {
    Consumer::with_sink(
        "",
        ConsumerConfig::new(CONSUMER, "", &[]),
        Edges::new(store.clone(), CONSUMER),
    )
}
