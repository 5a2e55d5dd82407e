//! Orders' facts as of one moment per source, with the outbox ids of the
//! events those rows reflect: a view written from the facts records the
//! events as applied, so a later delivery of one of them is a duplicate,
//! not a second count. Each source is read in one `REPEATABLE READ`
//! transaction: the rows and the outbox as of the same snapshot, and an
//! event commits with its rows (the transactional outbox), so the ids are
//! exactly the events the rows reflect.
//!
//! Two uses: one order's repair (every id the source still holds), and a
//! chunk of a re-projection (the ids past the source's [`floor`]: every
//! event at or below it is in every snapshot read after it was taken).
//!
//! [`floor`]: crate::floor

use std::collections::HashMap;

use reliability::Result;
use sqlx::{PgConnection, PgPool};

use crate::orders::{assemble, lines, order_rows, payments, reservations};
use crate::{Key, Order, Sources};

/// The events of one aggregate of one source that its rows reflect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reflected {
    pub source: &'static str,
    /// `<aggregate_type>:<aggregate_id>`, as the events carry it.
    pub aggregate: String,
    /// The outbox ids past `upto` the source holds (outbox and archive), in order.
    pub ids: Vec<i64>,
    /// Every event of the aggregate at or below it is reflected too: the
    /// floor of a re-projection, -1 for a repair.
    pub upto: i64,
    /// The source's oldest id still held: an event below it is older than
    /// the archive's retention, and reflected in the rows whatever it was.
    pub oldest: i64,
}

/// One order's facts and the events behind them, per source.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub order: Order,
    pub reflected: Vec<Reflected>,
}

/// Each source's floor for a re-projection, or none (a repair).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Floors {
    pub orders: i64,
    pub inventory: i64,
    pub payments: i64,
}

impl Floors {
    /// No floor: every id a source holds is read.
    pub const NONE: Floors = Floors {
        orders: -1,
        inventory: -1,
        payments: -1,
    };

    pub fn of(&self, source: &str) -> i64 {
        match source {
            contracts::source::ORDERS => self.orders,
            contracts::source::INVENTORY => self.inventory,
            _ => self.payments,
        }
    }
}

/// `key`'s facts, each source's read in one snapshot of its own (None: no
/// such order).
pub async fn snapshot(sources: &Sources, key: Key) -> Result<Option<Snapshot>> {
    let before = key.before();
    Ok(chunk(sources, before, 1, Floors::NONE)
        .await?
        .into_iter()
        .find(|s| s.order.key == key))
}

/// The next `limit` orders after `after`, in key order, each with the
/// events past `floors` its rows reflect.
pub async fn chunk(
    sources: &Sources,
    after: Key,
    limit: i64,
    floors: Floors,
) -> Result<Vec<Snapshot>> {
    use contracts::aggregate::{ORDER, PAYMENT};
    use contracts::source::{INVENTORY, ORDERS, PAYMENTS};

    let mut tx = begin(&sources.orders).await?;
    let rows = order_rows(&mut *tx, after, limit, 0.0).await?;
    let keys: Vec<Key> = rows.iter().map(|r| Key::new(r.0, r.1)).collect();
    let order_ids: Vec<(i64, String)> = keys
        .iter()
        .map(|k| (k.tenant_id, k.order_id.to_string()))
        .collect();
    let lines = lines(&mut *tx, &keys).await?;
    let placed = events(&mut tx, ORDER, &order_ids, floors.orders).await?;
    tx.commit().await?;

    let mut tx = begin(&sources.inventory).await?;
    let held = reservations(&mut *tx, &keys, 0.0).await?;
    let reserved = events(&mut tx, ORDER, &order_ids, floors.inventory).await?;
    tx.commit().await?;

    let mut tx = begin(&sources.payments).await?;
    let paid = payments(&mut *tx, &keys, 0.0).await?;
    let payment_ids: Vec<(i64, String)> = paid
        .iter()
        .flat_map(|(k, (p, _))| p.iter().map(|p| (k.tenant_id, p.payment_id.to_string())))
        .collect();
    let charged = events(&mut tx, PAYMENT, &payment_ids, floors.payments).await?;
    tx.commit().await?;

    let part = |events: &Events, source: &'static str, aggregate_type: &str, tenant, id: String| {
        let (ids, oldest) = events.of(tenant, &id);
        Reflected {
            source,
            aggregate: format!("{aggregate_type}:{id}"),
            ids,
            upto: floors.of(source),
            oldest,
        }
    };
    Ok(assemble(rows, lines, held, paid)
        .into_iter()
        .map(|order| {
            let (tenant, id) = (order.key.tenant_id, order.key.order_id.to_string());
            let mut reflected = vec![
                part(&placed, ORDERS, ORDER, tenant, id.clone()),
                part(&reserved, INVENTORY, ORDER, tenant, id),
            ];
            for p in &order.payments {
                reflected.push(part(
                    &charged,
                    PAYMENTS,
                    PAYMENT,
                    tenant,
                    p.payment_id.to_string(),
                ));
            }
            Snapshot { order, reflected }
        })
        .collect())
}

pub(crate) async fn begin(pool: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// Outbox ids by aggregate, and the source's oldest id held.
pub(crate) struct Events {
    by_aggregate: HashMap<(i64, String), Vec<i64>>,
    oldest: i64,
}

impl Events {
    pub(crate) fn of(&self, tenant: i64, aggregate_id: &str) -> (Vec<i64>, i64) {
        let ids = self
            .by_aggregate
            .get(&(tenant, aggregate_id.to_owned()))
            .cloned()
            .unwrap_or_default();
        (ids, self.oldest)
    }
}

/// The ids past `after` of the given aggregates (tenant, aggregate id) of
/// one type. Past a floor, a range of the outbox's primary key; with no
/// floor (a repair, one order), a full scan of outbox and archive: a
/// repair is rare, and an index by aggregate would cost every insert.
pub(crate) async fn events(
    tx: &mut PgConnection,
    aggregate_type: &str,
    aggregates: &[(i64, String)],
    after: i64,
) -> Result<Events> {
    let (tenants, ids): (Vec<i64>, Vec<String>) = aggregates.iter().cloned().unzip();
    let rows: Vec<(i64, String, Vec<i64>)> = sqlx::query_as(
        "SELECT h.tenant_id, h.aggregate_id, array_agg(h.id ORDER BY h.id)
         FROM (SELECT id, tenant_id, aggregate_type, aggregate_id FROM outbox_messages WHERE id > $1
               UNION ALL
               SELECT id, tenant_id, aggregate_type, aggregate_id FROM outbox_messages_archive
               WHERE id > $1) h
         JOIN unnest($3::bigint[], $4::text[]) AS k(tenant_id, aggregate_id)
           ON k.tenant_id = h.tenant_id AND k.aggregate_id = h.aggregate_id
         WHERE h.aggregate_type = $2
         GROUP BY h.tenant_id, h.aggregate_id",
    )
    .bind(after)
    .bind(aggregate_type)
    .bind(&tenants)
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?;
    let oldest: Option<i64> = sqlx::query_scalar(
        "SELECT least((SELECT min(id) FROM outbox_messages),
                      (SELECT min(id) FROM outbox_messages_archive))",
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(Events {
        by_aggregate: rows
            .into_iter()
            .map(|(tenant, id, ids)| ((tenant, id), ids))
            .collect(),
        // Nothing held: every event is older than the retention.
        oldest: oldest.unwrap_or(i64::MAX),
    })
}
