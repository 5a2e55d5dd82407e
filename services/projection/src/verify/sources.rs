//! What each order view should be, from the facts the `sources` crate
//! reads of the orders, inventory and payments services' current rows
//! (docs/adr/0035), and the views as the projection holds them.

use std::collections::HashMap;

use ::sources::{Key, Order, Sources};
use reliability::Result;
use sqlx::PgPool;

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
    Ok(::sources::orders_after(sources, after, limit, grace_secs)
        .await?
        .into_iter()
        .map(expected_of)
        .collect())
}

/// The view an order's facts make.
fn expected_of(order: Order) -> Expected {
    let reservation_status = order
        .reservation
        .as_ref()
        .map_or("pending", |r| r.status.as_str());
    // The view follows the order's newest payment.
    let payment = order.payments.last();
    let payment_status = match payment.map(|p| p.status.as_str()) {
        Some(s @ ("captured" | "failed")) => s,
        // The view says pending from the reservation on: the payment row
        // comes with the charge command after it.
        _ if matches!(reservation_status, "reserved" | "committed" | "released") => "pending",
        _ => "none",
    };
    Expected {
        key: order.key,
        settled: order.settled,
        state: OrderState {
            status: order.status.clone(),
            total_cents: Some(order.total_cents),
            currency: Some(order.currency.clone()),
            payment_status: payment_status.to_owned(),
            reservation_status: reservation_status.to_owned(),
            refunded_cents: payment.map_or(0, |p| p.refunded_cents()),
        },
    }
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
    let upto = upto.unwrap_or(Key::END);
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
    Ok(::sources::order(sources, key, grace_secs)
        .await?
        .map(expected_of))
}
