//! Re-projecting the order views from the sources' current rows
//! (docs/adr/0035, amended), at any age: the rows outlive the outbox's
//! archive, which `rebuild` replays.
//!
//! In place, beside the live consumer, with no reset: each order's facts
//! (`facts`) replace what its rows no longer state, and its view is
//! recomputed from its facts and whatever events it has, under the lock
//! the live appliers take for the order. A fact stays true once the rows
//! state it, so no reader sees a view go back, and an event that arrives
//! later counts nothing twice. What was applied meanwhile stays: the
//! live consumer is the tail.
//!
//! The ordered histories (`history`) are sequences of events, which the
//! rows do not keep: they are left as they are.

use contracts::aggregate;
use reliability::consumer::begin_as_handler;
use reliability::{Result, TenantId};
use sources::{Key, Order, Sources};
use sqlx::PgPool;

use crate::{facts, views};

#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Reprojected {
    /// Orders whose view was written from their rows.
    pub orders: usize,
}

/// Every order view again from `sources`' rows, a chunk of orders at a
/// time. `projection` is the projection's database as its owner.
pub async fn reproject(projection: &PgPool, sources: &Sources) -> Result<Reprojected> {
    let (mut after, mut report) = (Key::default(), Reprojected::default());
    loop {
        // Read before any transaction of the projection: none is held
        // across a call to another database.
        let chunk = sources::orders_after(sources, after, sources::verify::CHUNK, 0.0).await?;
        for order in &chunk {
            write(projection, order).await?;
        }
        report.orders += chunk.len();
        match chunk.last() {
            Some(last) if chunk.len() as i64 == sources::verify::CHUNK => after = last.key,
            _ => return Ok(report),
        }
    }
}

/// One order's view from its rows: its facts, then the view recomputed,
/// in one transaction under the order's lock.
pub(crate) async fn write(projection: &PgPool, order: &Order) -> Result<()> {
    let mut tx = lock(projection, order.key).await?;
    facts::replace(&mut tx, order).await?;
    views::recompute(&mut tx, order.key.order_id).await?;
    tx.commit().await?;
    Ok(())
}

/// A transaction of the order's tenant, holding the lock its live
/// appliers take (`Views::lock_key`).
pub(crate) async fn lock(projection: &PgPool, key: Key) -> Result<reliability::TenantTx> {
    let tenant = TenantId::new(key.tenant_id)
        .map_err(|e| reliability::Error::Config(format!("order view key: {e}")))?;
    let lock = format!("{}:{}", aggregate::ORDER, key.order_id);
    Ok(begin_as_handler(projection, views::CONSUMER, tenant, &lock).await?)
}
