//! What an order's node and edges should be, from its facts, and what the
//! graph holds: one canonical form for both, so a difference is `!=`.

use std::collections::BTreeMap;

use reliability::TenantId;
use serde_json::{Value, json};
use sources::Order;

use crate::store::{Cypher, Params, Row, Store, StoreError};

/// An order as the graph draws it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Shape {
    /// `placed`, `confirmed` or `cancelled`.
    pub status: String,
    pub total_cents: Option<i64>,
    pub currency: Option<String>,
    pub customer: Option<String>,
    /// One per product: sku, the units its lines add up to, the first
    /// line's unit price. By sku.
    pub lines: Vec<(String, i64, Option<i64>)>,
    pub reserved: bool,
    pub rejected: bool,
    /// The products with a RESERVED and with a RELEASED edge, by sku.
    pub reserved_skus: Vec<String>,
    pub released_skus: Vec<String>,
    /// Each payment that a capture or a failure drew: id, status, amount
    /// (a capture's). By id.
    pub payments: Vec<(i64, String, Option<i64>)>,
    /// Each refund: payment id, refund id, amount. By refund id.
    pub refunds: Vec<(i64, i64, i64)>,
}

/// The status the graph gives an order the orders service calls `status`.
pub fn status(status: &str) -> &str {
    match status {
        "pending" => "placed",
        s => s,
    }
}

/// The lines as `OrderPlaced`'s statement merges them: one per sku, the
/// quantities added up, the first line's price.
pub fn merged_lines(order: &Order) -> Vec<(String, i64, Option<i64>)> {
    let mut by_sku: BTreeMap<&str, (i64, i64)> = BTreeMap::new();
    for l in &order.lines {
        by_sku
            .entry(&l.sku)
            .and_modify(|e| e.0 += l.quantity)
            .or_insert((l.quantity, l.unit_price_cents));
    }
    by_sku
        .into_iter()
        .map(|(sku, (q, price))| (sku.to_owned(), q, Some(price)))
        .collect()
}

/// The graph an order's facts make once every event of it is applied.
pub fn expected(order: &Order) -> Shape {
    let lines = merged_lines(order);
    let reserved = order.reservation.as_ref().is_some_and(|r| r.held());
    let skus: Vec<String> = lines.iter().map(|l| l.0.clone()).collect();
    let mut refunds: Vec<(i64, i64, i64)> = order
        .payments
        .iter()
        .flat_map(|p| {
            p.refunds
                .iter()
                .map(|r| (p.payment_id, r.refund_id, r.amount_cents))
        })
        .collect();
    refunds.sort_by_key(|r| r.1);
    Shape {
        status: status(&order.status).to_owned(),
        total_cents: Some(order.total_cents),
        currency: Some(order.currency.clone()),
        customer: Some(order.customer_id.clone()),
        reserved,
        rejected: order
            .reservation
            .as_ref()
            .is_some_and(|r| r.status == "rejected"),
        reserved_skus: if reserved { skus.clone() } else { Vec::new() },
        released_skus: if reserved && order.status == "cancelled" {
            skus
        } else {
            Vec::new()
        },
        payments: order
            .payments
            .iter()
            .filter(|p| p.status != "pending")
            .map(|p| {
                let amount = (p.status == "captured").then_some(p.amount_cents);
                (p.payment_id, p.status.clone(), amount)
            })
            .collect(),
        refunds,
        lines,
    }
}

/// A tenant's orders with ids in `(lower, upper]`, as the graph draws them.
const ORDERS_BETWEEN: Cypher = Cypher(
    "MATCH (o:Order {tenant: $tenant}) WHERE o.id > $lower AND o.id <= $upper
     RETURN o.id AS id, coalesce(o.status, 'placed') AS status, o.total_cents AS total_cents,
            o.currency AS currency, coalesce(o.reserved, false) AS reserved,
            o.rejected IS NOT NULL AS rejected,
            head([(c:Customer {tenant: $tenant})-[:PLACED]->(o) | c.id]) AS customer,
            [(o)-[r:CONTAINS]->(p:Product {tenant: $tenant}) | [p.sku, r.quantity, r.unit_price_cents]] AS lines,
            [(o)-[:RESERVED]->(x:Product {tenant: $tenant}) | x.sku] AS reserved_skus,
            [(o)-[:RELEASED]->(y:Product {tenant: $tenant}) | y.sku] AS released_skus,
            [(o)-[:PAID_BY]->(pay:Payment {tenant: $tenant}) | [pay.id, pay.status, pay.amount_cents]] AS payments,
            [(o)-[:PAID_BY]->(pp:Payment {tenant: $tenant})-[:REFUNDED]->(rf:Refund {tenant: $tenant}) | [pp.id, rf.id, rf.amount_cents]] AS refunds",
);

/// Read-only, within the store's server-side bound.
pub async fn between(
    store: &Store,
    tenant: TenantId,
    lower: i64,
    upper: i64,
) -> Result<BTreeMap<i64, Shape>, StoreError> {
    let mut params = Params::new();
    params.insert("lower".into(), json!(lower));
    params.insert("upper".into(), json!(upper));
    let rows = store.read(tenant, ORDERS_BETWEEN, params).await?;
    rows.iter()
        .map(|row| Ok((int(row, "id")?, shape(row)?)))
        .collect()
}

fn shape(row: &Row) -> Result<Shape, StoreError> {
    let triples =
        |v: &Value| -> Vec<Vec<Value>> { serde_json::from_value(v.clone()).unwrap_or_default() };
    let text = |v: &Value| v.as_str().map(str::to_owned);
    let mut lines: Vec<(String, i64, Option<i64>)> = triples(&row["lines"])
        .iter()
        .map(|l| {
            (
                text(&l[0]).unwrap_or_default(),
                l[1].as_i64().unwrap_or(-1),
                l[2].as_i64(),
            )
        })
        .collect();
    lines.sort();
    let mut payments: Vec<(i64, String, Option<i64>)> = triples(&row["payments"])
        .iter()
        .map(|p| {
            (
                p[0].as_i64().unwrap_or(-1),
                text(&p[1]).unwrap_or_default(),
                p[2].as_i64(),
            )
        })
        .collect();
    payments.sort();
    let mut refunds: Vec<(i64, i64, i64)> = triples(&row["refunds"])
        .iter()
        .map(|r| {
            let n = |v: &Value| v.as_i64().unwrap_or(-1);
            (n(&r[0]), n(&r[1]), n(&r[2]))
        })
        .collect();
    refunds.sort_by_key(|r| r.1);
    let skus = |v: &Value| -> Vec<String> {
        let mut s: Vec<String> = serde_json::from_value(v.clone()).unwrap_or_default();
        s.sort();
        s
    };
    Ok(Shape {
        status: text(&row["status"]).unwrap_or_default(),
        total_cents: row["total_cents"].as_i64(),
        currency: text(&row["currency"]),
        customer: text(&row["customer"]),
        lines,
        reserved: row["reserved"].as_bool().unwrap_or(false),
        rejected: row["rejected"].as_bool().unwrap_or(false),
        reserved_skus: skus(&row["reserved_skus"]),
        released_skus: skus(&row["released_skus"]),
        payments,
        refunds,
    })
}

fn int(row: &Row, column: &str) -> Result<i64, StoreError> {
    row.get(column)
        .and_then(Value::as_i64)
        .ok_or_else(|| StoreError::Query(format!("a row without an integer `{column}`")))
}

/// A tenant's customers and their order counts.
const CUSTOMERS: Cypher = Cypher(
    "MATCH (c:Customer {tenant: $tenant}) RETURN c.id AS name, coalesce(c.orders, 0) AS count",
);

/// A tenant's products and the units ordered of each.
const PRODUCTS: Cypher = Cypher(
    "MATCH (p:Product {tenant: $tenant}) RETURN p.sku AS name, coalesce(p.units_ordered, 0) AS count",
);

/// Each customer's order count (`customers`) or each product's units
/// ordered (`products`), the zeros left out.
pub async fn counts(
    store: &Store,
    tenant: TenantId,
    view: &str,
) -> Result<BTreeMap<String, i64>, StoreError> {
    let cypher = if view == "customers" {
        CUSTOMERS
    } else {
        PRODUCTS
    };
    let rows = store.read(tenant, cypher, Params::new()).await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            Some((
                r.get("name")?.as_str()?.to_owned(),
                r.get("count")?.as_i64()?,
            ))
        })
        .filter(|(_, n)| *n != 0)
        .collect())
}
