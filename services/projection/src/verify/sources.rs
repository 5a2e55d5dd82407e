//! What the sources' current rows say each order view should be. These
//! are read-only reads, as the owner role (every tenant), of the tables the
//! orders, inventory and payments services write in the same transaction
//! as the events the view is built from (docs/adr/0035): the view's fields
//! are a function of those rows once every event of them is applied.

use std::collections::HashMap;

use reliability::{Result, db};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use super::Key;

/// The source databases, each opened as its owner role.
#[derive(Clone)]
pub struct Sources {
    pub orders: PgPool,
    pub inventory: PgPool,
    pub payments: PgPool,
}

impl Sources {
    /// From `orders=URL,inventory=URL,payments=URL`: each source's
    /// database, opened as the owner role (every tenant's rows) whatever
    /// user the URL names. The pools connect on first use, so a source
    /// that is down fails a pass, not the process.
    pub fn lazy(items: &[String]) -> Result<Self> {
        let mut named = HashMap::new();
        for item in items {
            let (name, url) = item.split_once('=').ok_or_else(|| {
                reliability::Error::Config(format!("expected name=url, got `{item}`"))
            })?;
            let base: PgConnectOptions = url
                .parse()
                .map_err(|e| reliability::Error::Config(format!("{name}'s URL: {e}")))?;
            let options = db::options_for_role(&base, db::OWNER_ROLE);
            named.insert(
                name.to_owned(),
                db::pool_options()
                    .max_connections(2)
                    .connect_lazy_with(options),
            );
        }
        let mut take = |name: &str| {
            named.remove(name).ok_or_else(|| {
                reliability::Error::Config(format!(
                    "verification needs the {name} database: {name}=postgres://…"
                ))
            })
        };
        Ok(Self {
            orders: take(contracts::source::ORDERS)?,
            inventory: take(contracts::source::INVENTORY)?,
            payments: take(contracts::source::PAYMENTS)?,
        })
    }

    /// Each source database by its name, for the event history a repair reads.
    pub fn named(&self) -> [(&'static str, &PgPool); 3] {
        [
            (contracts::source::ORDERS, &self.orders),
            (contracts::source::INVENTORY, &self.inventory),
            (contracts::source::PAYMENTS, &self.payments),
        ]
    }
}

/// An order view's fields, as the view holds them or as the sources say.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct OrderState {
    pub status: String,
    pub total_cents: Option<i64>,
    pub currency: Option<String>,
    pub payment_status: String,
    pub reservation_status: String,
    pub refunded_cents: i64,
}

/// What the sources say of one order, and whether every row of it has
/// been still for the grace period (so its events have had time to arrive).
#[derive(Debug, Clone)]
pub struct Expected {
    pub key: Key,
    pub state: OrderState,
    pub settled: bool,
}

/// The next `limit` orders after `after`, in key order, with what the
/// sources say of each.
pub async fn after(
    sources: &Sources,
    after: Key,
    limit: i64,
    grace_secs: f64,
) -> Result<Vec<Expected>> {
    let orders: Vec<(i64, i64, String, i64, String, bool)> = sqlx::query_as(
        "SELECT tenant_id, order_id, status, total_cents, currency,
                updated_at < now() - make_interval(secs => $4)
         FROM orders WHERE (tenant_id, order_id) > ($1, $2)
         ORDER BY tenant_id, order_id LIMIT $3",
    )
    .bind(after.tenant_id)
    .bind(after.order_id)
    .bind(limit)
    .bind(grace_secs)
    .fetch_all(&sources.orders)
    .await?;
    let keys: Vec<Key> = orders.iter().map(|o| Key::new(o.0, o.1)).collect();
    let (reservations, payments) = (
        reservations(sources, &keys, grace_secs).await?,
        payments(sources, &keys, grace_secs).await?,
    );
    Ok(orders
        .into_iter()
        .map(|(tenant_id, order_id, status, total, currency, still)| {
            let key = Key::new(tenant_id, order_id);
            let reservation = reservations.get(&key);
            let payment = payments.get(&key);
            let reservation_status = reservation.map_or("pending", |r| r.0.as_str());
            let payment_status = match payment.map(|p| p.0.as_str()) {
                Some(s @ ("captured" | "failed")) => s,
                // The view says pending from the reservation on: the
                // payment row comes with the charge command after it.
                _ if matches!(reservation_status, "reserved" | "committed" | "released") => {
                    "pending"
                }
                _ => "none",
            };
            Expected {
                key,
                settled: still && reservation.is_none_or(|r| r.1) && payment.is_none_or(|p| p.2),
                state: OrderState {
                    status,
                    total_cents: Some(total),
                    currency: Some(currency),
                    payment_status: payment_status.to_owned(),
                    reservation_status: reservation_status.to_owned(),
                    refunded_cents: payment.map_or(0, |p| p.1),
                },
            }
        })
        .collect())
}

fn columns(keys: &[Key]) -> (Vec<i64>, Vec<i64>) {
    keys.iter().map(|k| (k.tenant_id, k.order_id)).unzip()
}

/// Each order's reservation status, and whether it is still.
async fn reservations(
    sources: &Sources,
    keys: &[Key],
    grace_secs: f64,
) -> Result<HashMap<Key, (String, bool)>> {
    let (tenants, orders) = columns(keys);
    let rows: Vec<(i64, i64, String, bool)> = sqlx::query_as(
        "SELECT r.tenant_id, r.order_id, r.status, r.updated_at < now() - make_interval(secs => $3)
         FROM reservations r JOIN unnest($1::bigint[], $2::bigint[]) AS k(tenant_id, order_id)
           USING (tenant_id, order_id)",
    )
    .bind(&tenants)
    .bind(&orders)
    .bind(grace_secs)
    .fetch_all(&sources.inventory)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(tenant_id, order_id, status, still)| {
            (Key::new(tenant_id, order_id), (status, still))
        })
        .collect())
}

/// Each order's payment status, the sum of its succeeded refunds (what
/// `RefundIssued` events add up to), and whether all of it is still.
async fn payments(
    sources: &Sources,
    keys: &[Key],
    grace_secs: f64,
) -> Result<HashMap<Key, (String, i64, bool)>> {
    let (tenants, orders) = columns(keys);
    let rows: Vec<(i64, i64, String, i64, bool)> = sqlx::query_as(
        "SELECT p.tenant_id, p.order_id, p.status,
                coalesce(sum(r.amount_cents) FILTER (WHERE r.status = 'succeeded'), 0)::bigint,
                greatest(p.updated_at, max(r.updated_at)) < now() - make_interval(secs => $3)
         FROM payments p JOIN unnest($1::bigint[], $2::bigint[]) AS k(tenant_id, order_id)
           USING (tenant_id, order_id)
         LEFT JOIN refunds r ON r.tenant_id = p.tenant_id AND r.payment_id = p.payment_id
         GROUP BY p.tenant_id, p.order_id, p.payment_id",
    )
    .bind(&tenants)
    .bind(&orders)
    .bind(grace_secs)
    .fetch_all(&sources.payments)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(tenant_id, order_id, status, refunded, still)| {
            (Key::new(tenant_id, order_id), (status, refunded, still))
        })
        .collect())
}

/// The view of `key`, if it has one (read as the projection's owner).
pub async fn view(projection: &PgPool, key: Key) -> Result<Option<OrderState>> {
    Ok(sqlx::query_as(
        "SELECT status, total_cents, currency, payment_status, reservation_status, refunded_cents
         FROM order_views WHERE tenant_id = $1 AND order_id = $2",
    )
    .bind(key.tenant_id)
    .bind(key.order_id)
    .fetch_optional(projection)
    .await?)
}

/// The views with keys in `(after, upto]` (`upto` None: to the end).
pub async fn views_between(
    projection: &PgPool,
    after: Key,
    upto: Option<Key>,
) -> Result<HashMap<Key, OrderState>> {
    let upto = upto.unwrap_or(Key {
        tenant_id: i64::MAX,
        order_id: i64::MAX,
    });
    let rows: Vec<ViewRow> = sqlx::query_as(
        "SELECT tenant_id, order_id, status, total_cents, currency, payment_status,
                reservation_status, refunded_cents
         FROM order_views
         WHERE (tenant_id, order_id) > ($1, $2) AND (tenant_id, order_id) <= ($3, $4)",
    )
    .bind(after.tenant_id)
    .bind(after.order_id)
    .bind(upto.tenant_id)
    .bind(upto.order_id)
    .fetch_all(projection)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (Key::new(r.tenant_id, r.order_id), r.state))
        .collect())
}

#[derive(sqlx::FromRow)]
struct ViewRow {
    tenant_id: i64,
    order_id: i64,
    #[sqlx(flatten)]
    state: OrderState,
}

/// What the sources say of one order now (None: no such order).
pub async fn expected(sources: &Sources, key: Key, grace_secs: f64) -> Result<Option<Expected>> {
    let before = Key {
        order_id: key.order_id - 1,
        ..key
    };
    Ok(after(sources, before, 1, grace_secs)
        .await?
        .into_iter()
        .find(|e| e.key == key))
}
