//! Each order's facts across the three sources, a chunk of orders at a
//! time: four reads of at most a chunk's rows, none in a transaction.

use std::collections::HashMap;

use reliability::Result;
use sqlx::PgExecutor;

use crate::{Key, Sources};

/// One line of an order, as the orders service keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Line {
    pub sku: String,
    pub quantity: i64,
    pub unit_price_cents: i64,
}

/// An order's reservation, as inventory keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Reservation {
    /// `reserved`, `rejected`, `committed` or `released`.
    pub status: String,
    /// Why it was rejected.
    pub reason: Option<String>,
}

impl Reservation {
    /// Stock was held for the order (an `InventoryReserved` was emitted).
    pub fn held(&self) -> bool {
        matches!(self.status.as_str(), "reserved" | "committed" | "released")
    }
}

/// A refund the provider made (`succeeded`): what a `RefundIssued` says.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Refund {
    pub refund_id: i64,
    pub amount_cents: i64,
}

/// A payment of an order, with its succeeded refunds in id order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Payment {
    pub payment_id: i64,
    /// `pending`, `captured` or `failed`.
    pub status: String,
    pub amount_cents: i64,
    pub currency: String,
    pub refunds: Vec<Refund>,
}

impl Payment {
    pub fn refunded_cents(&self) -> i64 {
        self.refunds.iter().map(|r| r.amount_cents).sum()
    }
}

/// What the sources say of one order now.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Order {
    pub key: Key,
    pub customer_id: String,
    /// `pending`, `confirmed` or `cancelled`.
    pub status: String,
    pub total_cents: i64,
    pub currency: String,
    /// In line order.
    pub lines: Vec<Line>,
    /// None before inventory has seen the order.
    pub reservation: Option<Reservation>,
    /// In payment id order.
    pub payments: Vec<Payment>,
    /// Every row of it has been still for the grace period, so its events
    /// have had time to arrive: a view may trail its sources by the
    /// consumer's lag, never for longer.
    pub settled: bool,
}

/// The next `limit` orders after `after`, in key order, with what the
/// sources say of each.
pub async fn orders_after(
    sources: &Sources,
    after: Key,
    limit: i64,
    grace_secs: f64,
) -> Result<Vec<Order>> {
    let rows = order_rows(&sources.orders, after, limit, grace_secs).await?;
    let keys: Vec<Key> = rows.iter().map(|o| Key::new(o.0, o.1)).collect();
    let lines = lines(&sources.orders, &keys).await?;
    let reservations = reservations(&sources.inventory, &keys, grace_secs).await?;
    let payments = payments(&sources.payments, &keys, grace_secs).await?;
    Ok(assemble(rows, lines, reservations, payments))
}

pub(crate) type OrderRow = (i64, i64, String, String, i64, String, bool);

pub(crate) async fn order_rows<'c>(
    db: impl PgExecutor<'c>,
    after: Key,
    limit: i64,
    grace_secs: f64,
) -> Result<Vec<OrderRow>> {
    Ok(sqlx::query_as(
        "SELECT tenant_id, order_id, customer_id, status, total_cents, currency,
                updated_at < now() - make_interval(secs => $4)
         FROM orders WHERE (tenant_id, order_id) > ($1, $2)
         ORDER BY tenant_id, order_id LIMIT $3",
    )
    .bind(after.tenant_id)
    .bind(after.order_id)
    .bind(limit)
    .bind(grace_secs)
    .fetch_all(db)
    .await?)
}

pub(crate) fn assemble(
    rows: Vec<OrderRow>,
    mut lines: HashMap<Key, Vec<Line>>,
    mut reservations: HashMap<Key, (Reservation, bool)>,
    mut payments: HashMap<Key, (Vec<Payment>, bool)>,
) -> Vec<Order> {
    rows.into_iter()
        .map(
            |(tenant_id, order_id, customer_id, status, total_cents, currency, still)| {
                let key = Key::new(tenant_id, order_id);
                let reservation = reservations.remove(&key);
                let (payments, paid_still) = payments.remove(&key).unwrap_or((Vec::new(), true));
                Order {
                    key,
                    customer_id,
                    status,
                    total_cents,
                    currency,
                    lines: lines.remove(&key).unwrap_or_default(),
                    settled: still && reservation.as_ref().is_none_or(|r| r.1) && paid_still,
                    reservation: reservation.map(|r| r.0),
                    payments,
                }
            },
        )
        .collect()
}

/// What the sources say of one order now (None: no such order).
pub async fn order(sources: &Sources, key: Key, grace_secs: f64) -> Result<Option<Order>> {
    let before = key.before();
    Ok(orders_after(sources, before, 1, grace_secs)
        .await?
        .into_iter()
        .find(|o| o.key == key))
}

fn columns(keys: &[Key]) -> (Vec<i64>, Vec<i64>) {
    keys.iter().map(|k| (k.tenant_id, k.order_id)).unzip()
}

pub(crate) async fn lines<'c>(
    db: impl PgExecutor<'c>,
    keys: &[Key],
) -> Result<HashMap<Key, Vec<Line>>> {
    let (tenants, orders) = columns(keys);
    let rows: Vec<(i64, i64, String, i64, i64)> = sqlx::query_as(
        "SELECT l.tenant_id, l.order_id, l.sku, l.quantity::bigint, l.unit_price_cents
         FROM order_lines l JOIN unnest($1::bigint[], $2::bigint[]) AS k(tenant_id, order_id)
           USING (tenant_id, order_id)
         ORDER BY l.tenant_id, l.order_id, l.line_no",
    )
    .bind(&tenants)
    .bind(&orders)
    .fetch_all(db)
    .await?;
    let mut by_order: HashMap<Key, Vec<Line>> = HashMap::new();
    for (tenant_id, order_id, sku, quantity, unit_price_cents) in rows {
        by_order
            .entry(Key::new(tenant_id, order_id))
            .or_default()
            .push(Line {
                sku,
                quantity,
                unit_price_cents,
            });
    }
    Ok(by_order)
}

/// Each order's reservation, and whether it is still.
pub(crate) async fn reservations<'c>(
    db: impl PgExecutor<'c>,
    keys: &[Key],
    grace_secs: f64,
) -> Result<HashMap<Key, (Reservation, bool)>> {
    let (tenants, orders) = columns(keys);
    let rows: Vec<(i64, i64, String, Option<String>, bool)> = sqlx::query_as(
        "SELECT r.tenant_id, r.order_id, r.status, r.reason,
                r.updated_at < now() - make_interval(secs => $3)
         FROM reservations r JOIN unnest($1::bigint[], $2::bigint[]) AS k(tenant_id, order_id)
           USING (tenant_id, order_id)",
    )
    .bind(&tenants)
    .bind(&orders)
    .bind(grace_secs)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(tenant_id, order_id, status, reason, still)| {
            (
                Key::new(tenant_id, order_id),
                (Reservation { status, reason }, still),
            )
        })
        .collect())
}

/// Each order's payments with their succeeded refunds, and whether all of
/// it (every refund included) is still.
pub(crate) async fn payments<'c>(
    db: impl PgExecutor<'c>,
    keys: &[Key],
    grace_secs: f64,
) -> Result<HashMap<Key, (Vec<Payment>, bool)>> {
    let (tenants, orders) = columns(keys);
    type Row = (i64, i64, i64, String, i64, String, bool, Vec<i64>, Vec<i64>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT p.tenant_id, p.order_id, p.payment_id, p.status, p.amount_cents, p.currency,
                greatest(p.updated_at, max(r.updated_at)) < now() - make_interval(secs => $3),
                coalesce(array_agg(r.refund_id ORDER BY r.refund_id)
                         FILTER (WHERE r.status = 'succeeded'), '{}'),
                coalesce(array_agg(r.amount_cents ORDER BY r.refund_id)
                         FILTER (WHERE r.status = 'succeeded'), '{}')
         FROM payments p JOIN unnest($1::bigint[], $2::bigint[]) AS k(tenant_id, order_id)
           USING (tenant_id, order_id)
         LEFT JOIN refunds r ON r.tenant_id = p.tenant_id AND r.payment_id = p.payment_id
         GROUP BY p.tenant_id, p.order_id, p.payment_id
         ORDER BY p.tenant_id, p.order_id, p.payment_id",
    )
    .bind(&tenants)
    .bind(&orders)
    .bind(grace_secs)
    .fetch_all(db)
    .await?;
    let mut by_order: HashMap<Key, (Vec<Payment>, bool)> = HashMap::new();
    for (tenant_id, order_id, payment_id, status, amount_cents, currency, still, ids, amounts) in
        rows
    {
        let entry = by_order
            .entry(Key::new(tenant_id, order_id))
            .or_insert_with(|| (Vec::new(), true));
        entry.1 &= still;
        entry.0.push(Payment {
            payment_id,
            status,
            amount_cents,
            currency,
            refunds: ids
                .into_iter()
                .zip(amounts)
                .map(|(refund_id, amount_cents)| Refund {
                    refund_id,
                    amount_cents,
                })
                .collect(),
        });
    }
    Ok(by_order)
}
