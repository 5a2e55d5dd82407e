//! Re-projecting the graph from the sources' current rows (docs/adr/0035),
//! at any age: the rows outlive the outbox's archive.
//!
//! 1. Each source's floor (`sources::floor`): an outbox id at or below
//!    which every event is in every snapshot read from now on, decided by
//!    PostgreSQL (the transactions open when it was read are waited out).
//! 2. Into a fresh graph beside the live one, a chunk of orders at a time,
//!    each source read in one snapshot: each order's parts, as a repair
//!    writes them, with the events past the floor that the rows reflect
//!    and the floor itself on each checkpoint. Then each product's stock,
//!    and every count from the edges.
//! 3. The tail, the events past the floors, replayed into the fresh graph
//!    up to a new position taken as the floors are (every event at or
//!    below it committed); again from there while a pass finds more than
//!    [`SHORT_TAIL`] events, at most [`TAIL_PASSES`] times: the load goes
//!    on meanwhile. What a snapshot reflected is a duplicate, the rest is
//!    applied once.
//! 4. The fresh graph in the live one's place, in one step; then a last
//!    position, taken after the swap, and the tail up to it once more into
//!    the graph now live: what the live consumer applied to the old graph
//!    since step 3 was committed before the swap, so it is at or below
//!    that position; what it applies from now on lands in the new graph.
//!    Readers keep the old graph until the new one is built and caught up
//!    to the last pass of step 3.
//!
//! Afterwards a live delivery of any event at or below a floor is a
//! duplicate (the checkpoint's `upto`), whatever the archive still holds.

use std::collections::BTreeSet;
use std::sync::Arc;

use reliability::consumer::Replayed;
use serde_json::json;
use sources::{Floors, Key, Sources};
use sqlx::PgPool;

use crate::GraphSettings;
use crate::rebuild::{replayer, swap};
use crate::store::{Params, Store};
use crate::verify::repair::{STOCK_PART, recount_all, tenant_of, upstream, write, write_order};

#[derive(Debug, Clone, serde::Serialize)]
pub struct Reprojected {
    pub floors: Floors,
    /// Orders and products written from the sources' rows.
    pub orders: usize,
    pub products: usize,
    /// Events of the tail past the floors, into the fresh graph.
    pub tail: usize,
    /// Events applied after the swap: what only the old graph had had.
    pub caught_up: usize,
}

/// The graph again from `sources`' current rows, then their tail.
pub async fn reproject(
    graph: &GraphSettings,
    sources: &Sources,
) -> reliability::Result<Reprojected> {
    let fresh = Arc::new(Store::new(
        &graph.graph_url,
        &format!("{}.rebuild", graph.graph_name),
    ));
    // An interrupted rebuild's leftovers.
    fresh.delete().await.map_err(upstream)?;
    let floors = sources::floors(sources, sources::FLOOR_WAIT).await?;
    tracing::info!(?floors, "re-projecting the graph from the sources' rows");
    let mut tenants = BTreeSet::new();
    let orders = write_orders(&fresh, sources, floors, &mut tenants).await?;
    let products = write_stock(&fresh, sources, floors.inventory, &mut tenants).await?;
    for tenant in tenants {
        recount_all(&fresh, tenant_of(tenant)?).await?;
    }
    let history: Vec<(String, PgPool)> = sources
        .named()
        .into_iter()
        .map(|(name, pool)| (name.to_owned(), pool.clone()))
        .collect();
    let mut from = floors;
    let mut tail = 0;
    for _ in 0..TAIL_PASSES {
        let to = sources::floors(sources, sources::FLOOR_WAIT).await?;
        let pass: usize = replay_tail(&fresh, &history, from, to)
            .await?
            .iter()
            .map(|r| r.events)
            .sum();
        tail += pass;
        from = to;
        if pass <= SHORT_TAIL {
            break;
        }
    }
    swap(&fresh, graph).await?;
    let to = sources::floors(sources, sources::FLOOR_WAIT).await?;
    let live = Arc::new(graph.store());
    let caught_up = replay_tail(&live, &history, from, to)
        .await?
        .iter()
        .map(|r| r.applied)
        .sum();
    Ok(Reprojected {
        floors,
        orders,
        products,
        tail,
        caught_up,
    })
}

async fn write_orders(
    fresh: &Store,
    sources: &Sources,
    floors: Floors,
    tenants: &mut BTreeSet<i64>,
) -> reliability::Result<usize> {
    let (mut after, mut written) = (Key::default(), 0);
    loop {
        let chunk = sources::chunk(sources, after, sources::verify::CHUNK, floors).await?;
        for snapshot in &chunk {
            let tenant = snapshot.order.key.tenant_id;
            tenants.insert(tenant);
            write_order(fresh, tenant_of(tenant)?, snapshot).await?;
        }
        written += chunk.len();
        match chunk.last() {
            Some(last) if chunk.len() as i64 == sources::verify::CHUNK => after = last.order.key,
            _ => return Ok(written),
        }
    }
}

async fn write_stock(
    fresh: &Store,
    sources: &Sources,
    floor: i64,
    tenants: &mut BTreeSet<i64>,
) -> reliability::Result<usize> {
    let (mut after, mut written) = ((0, String::new()), 0);
    loop {
        let chunk =
            sources::stock_after(sources, (after.0, &after.1), sources::verify::CHUNK, floor)
                .await?;
        for stock in &chunk {
            tenants.insert(stock.tenant_id);
            let part = &stock.reflected;
            let mut params = Params::new();
            params.insert("sku".into(), json!(stock.sku));
            params.insert("on_hand".into(), json!(stock.on_hand));
            // The row stands for its newest adjustment: an older one's
            // figure never replaces it.
            let newest = part.ids.last().copied().unwrap_or(floor);
            params.insert("on_hand_message".into(), json!(newest));
            write(fresh, tenant_of(stock.tenant_id)?, STOCK_PART, params, part).await?;
        }
        written += chunk.len();
        match chunk.last() {
            Some(last) if chunk.len() as i64 == sources::verify::CHUNK => {
                after = (last.tenant_id, last.sku.clone())
            }
            _ => return Ok(written),
        }
    }
}

/// A pass of the tail that finds at most this many events is the last
/// before the swap.
pub const SHORT_TAIL: usize = 200;
/// At most this many passes of the tail before the swap, however busy the
/// sources: the last position's events then arrive just after it.
pub const TAIL_PASSES: usize = 5;

/// The events in `(from, to]` of each source, into `store`.
async fn replay_tail(
    store: &Arc<Store>,
    history: &[(String, PgPool)],
    from: Floors,
    to: Floors,
) -> reliability::Result<Vec<Replayed>> {
    replayer(store)?
        .replay_between(history, |source| (from.of(source).max(0), to.of(source)))
        .await
}
