//! Re-deriving one order's part of the graph from the sources' current
//! rows (docs/adr/0035), beside the live consumer:
//!
//! - Each source's part is written by one statement, guarded by that
//!   source's checkpoint of the aggregate: it writes only when the graph
//!   has applied no event of it that the snapshot did not see, and it
//!   records the events the snapshot's rows reflect, so their later
//!   delivery is a duplicate. FalkorDB runs a graph's writes one at a
//!   time, so a live event lands wholly before or after it.
//! - The counts (a customer's orders, a product's units ordered) are then
//!   counted again from the edges, which is what the live statements keep
//!   them equal to.

use std::collections::BTreeSet;

use reliability::TenantId;
use serde_json::{Value, json};
use sources::{Key, Order, Reflected, Snapshot, Sources};

use super::shape::{self, Shape};
use crate::rebuild::CONSUMER;
use crate::store::{Cypher, Params, Store, StoreError};

/// The checkpoint's guard, then the events the snapshot reflects recorded
/// on it: nothing of the aggregate applied that the snapshot did not see
/// (an id not among the snapshot's, past its floor `upto` and newer than
/// the source's retention). A re-projection's floor is kept as the
/// checkpoint's `upto`: every event at or below it is reflected.
macro_rules! guarded {
    ($change:expr) => {
        Cypher(concat!(
            "MERGE (k:Checkpoint {tenant: $tenant, consumer: $consumer, source: $source, aggregate: $aggregate})
             WITH k WHERE size([m IN coalesce(k.messages, []) WHERE NOT m IN $ids AND m > $upto AND m >= $oldest]) = 0
             SET k.messages = coalesce(k.messages, []) + [m IN $ids WHERE NOT m IN coalesce(k.messages, [])],
                 k.upto = CASE WHEN coalesce(k.upto, -1) < $upto THEN $upto ELSE k.upto END
             WITH k
             ",
            $change,
            "
             RETURN count(*) AS applied"
        ))
    };
}

/// The orders service's part: the node's fields, its customer, its lines.
const ORDER_PART: Cypher = guarded!(concat!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     SET o.status = $status, o.total_cents = $total_cents, o.currency = $currency
     WITH o
     OPTIONAL MATCH (o)-[e:CONTAINS|RESERVED|RELEASED]->(:Product {tenant: $tenant})
     DELETE e
     WITH DISTINCT o
     OPTIONAL MATCH (:Customer {tenant: $tenant})-[e:PLACED]->(o)
     DELETE e
     WITH DISTINCT o
     MERGE (c:Customer {tenant: $tenant, id: $customer_id})
     MERGE (c)-[:PLACED]->(o)
     FOREACH (l IN $lines |
         MERGE (p:Product {tenant: $tenant, sku: l.sku})
         MERGE (o)-[r:CONTAINS]->(p)
         SET r.quantity = l.quantity, r.unit_price_cents = l.unit_price_cents)
     ",
    stock_edges!()
));

/// Inventory's part: whether stock was held, or refused.
const RESERVATION_PART: Cypher = guarded!(concat!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     SET o.reserved = $reserved, o.rejected = $rejected
     WITH o
     OPTIONAL MATCH (o)-[e:RESERVED|RELEASED]->(:Product {tenant: $tenant})
     DELETE e
     WITH DISTINCT o
     ",
    stock_edges!()
));

/// Payments' part, one payment: its status and amount, its refunds.
const PAYMENT_PART: Cypher = guarded!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     MERGE (pay:Payment {tenant: $tenant, id: $payment_id})
     SET pay.status = $status, pay.amount_cents = $amount_cents, pay.currency = $currency
     MERGE (o)-[:PAID_BY]->(pay)
     WITH pay
     OPTIONAL MATCH (pay)-[e:REFUNDED]->(:Refund {tenant: $tenant})
     DELETE e
     WITH DISTINCT pay
     FOREACH (r IN $refunds |
         MERGE (rf:Refund {tenant: $tenant, id: r.refund_id})
         SET rf.amount_cents = r.amount_cents
         MERGE (pay)-[:REFUNDED]->(rf))"
);

/// An order no source has: no event of it can come.
const ORDER_GONE: Cypher = Cypher(
    "MATCH (o:Order {tenant: $tenant, id: $order_id}) DETACH DELETE o RETURN count(*) AS deleted",
);

/// A product's stock from inventory's row (a re-projection): the figure
/// stands for the newest adjustment the row reflects.
pub(crate) const STOCK_PART: Cypher = guarded!(
    "MERGE (p:Product {tenant: $tenant, sku: $sku})
     SET p.on_hand = $on_hand, p.on_hand_message = $on_hand_message"
);

const RECOUNT_CUSTOMERS: Cypher = Cypher(
    "UNWIND $names AS name
     MATCH (c:Customer {tenant: $tenant, id: name})
     WITH c, size([(c)-[:PLACED]->(x:Order {tenant: $tenant}) | x]) AS n
     SET c.orders = n
     RETURN count(*) AS recounted",
);

const RECOUNT_PRODUCTS: Cypher = Cypher(
    "UNWIND $names AS name
     MATCH (p:Product {tenant: $tenant, sku: name})
     WITH p, [(p)<-[r:CONTAINS]-(x:Order {tenant: $tenant}) | r.quantity] AS quantities
     SET p.units_ordered = reduce(s = 0, q IN quantities | s + q)
     RETURN count(*) AS recounted",
);

/// Every customer's and product's count of a tenant (a re-projection).
const RECOUNT_ALL: [Cypher; 2] = [
    Cypher(
        "MATCH (c:Customer {tenant: $tenant})
         WITH c, size([(c)-[:PLACED]->(x:Order {tenant: $tenant}) | x]) AS n
         SET c.orders = n
         RETURN count(*) AS recounted",
    ),
    Cypher(
        "MATCH (p:Product {tenant: $tenant})
         WITH p, [(p)<-[r:CONTAINS]-(x:Order {tenant: $tenant}) | r.quantity] AS quantities
         SET p.units_ordered = reduce(s = 0, q IN quantities | s + q)
         RETURN count(*) AS recounted",
    ),
];

/// Writes `key`'s facts over its part of the graph. Returns how many
/// parts were written (a part the live consumer is ahead of is left).
pub async fn order(store: &Store, sources: &Sources, key: Key) -> reliability::Result<usize> {
    let tenant = tenant_of(key.tenant_id)?;
    let before = shape::between(store, tenant, key.before().order_id, key.order_id)
        .await
        .map_err(upstream)?
        .remove(&key.order_id)
        .unwrap_or_default();
    let snapshot = sources::snapshot(sources, key).await?;
    let written = match &snapshot {
        None => {
            let mut params = Params::new();
            params.insert("order_id".into(), json!(key.order_id));
            store
                .run(tenant, ORDER_GONE, params)
                .await
                .map_err(upstream)?;
            1
        }
        Some(snapshot) => write_order(store, tenant, snapshot).await?,
    };
    let after = snapshot
        .as_ref()
        .map(|s| shape::expected(&s.order))
        .unwrap_or_default();
    recount(store, tenant, &before, &after).await?;
    Ok(written)
}

/// Each source's part of a snapshot's order, under its checkpoint's guard.
pub(crate) async fn write_order(
    store: &Store,
    tenant: TenantId,
    snapshot: &Snapshot,
) -> reliability::Result<usize> {
    let mut written = 0;
    for part in &snapshot.reflected {
        if let Some((cypher, params)) = part_of(&snapshot.order, part) {
            written += write(store, tenant, cypher, params, part).await?;
        }
    }
    Ok(written)
}

pub(crate) fn tenant_of(tenant: i64) -> reliability::Result<TenantId> {
    TenantId::new(tenant).map_err(|e| reliability::Error::Config(format!("tenant {tenant}: {e}")))
}

/// The statement and parameters of one source's part of `order`.
fn part_of(order: &Order, part: &Reflected) -> Option<(Cypher, Params)> {
    let mut params = Params::new();
    params.insert("order_id".into(), json!(order.key.order_id));
    let cypher = match part.source {
        contracts::source::ORDERS => {
            let lines: Vec<Value> = shape::merged_lines(order)
                .into_iter()
                .map(|(sku, quantity, price)| {
                    json!({"sku": sku, "quantity": quantity, "unit_price_cents": price})
                })
                .collect();
            params.insert("status".into(), json!(shape::status(&order.status)));
            params.insert("total_cents".into(), json!(order.total_cents));
            params.insert("currency".into(), json!(order.currency));
            params.insert("customer_id".into(), json!(order.customer_id));
            params.insert("lines".into(), Value::Array(lines));
            ORDER_PART
        }
        contracts::source::INVENTORY => {
            let r = order.reservation.as_ref();
            let held = r.is_some_and(|r| r.held());
            let rejected = r
                .filter(|r| r.status == "rejected")
                .map(|r| r.reason.clone().unwrap_or_default());
            params.insert(
                "reserved".into(),
                if held { json!(true) } else { Value::Null },
            );
            params.insert("rejected".into(), json!(rejected));
            RESERVATION_PART
        }
        _ => {
            let id = part.aggregate.rsplit(':').next()?.parse::<i64>().ok()?;
            let payment = order.payments.iter().find(|p| p.payment_id == id)?;
            // A payment still pending has no event, and no node.
            if payment.status == "pending" {
                return None;
            }
            let captured = payment.status == "captured";
            let refunds: Vec<Value> = payment
                .refunds
                .iter()
                .map(|r| json!({"refund_id": r.refund_id, "amount_cents": r.amount_cents}))
                .collect();
            params.insert("payment_id".into(), json!(id));
            params.insert("status".into(), json!(payment.status));
            params.insert(
                "amount_cents".into(),
                json!(captured.then_some(payment.amount_cents)),
            );
            params.insert(
                "currency".into(),
                json!(captured.then_some(&payment.currency)),
            );
            params.insert("refunds".into(), Value::Array(refunds));
            PAYMENT_PART
        }
    };
    Some((cypher, params))
}

pub(crate) async fn write(
    store: &Store,
    tenant: TenantId,
    cypher: Cypher,
    mut params: Params,
    part: &Reflected,
) -> reliability::Result<usize> {
    params.insert("consumer".into(), json!(CONSUMER));
    params.insert("source".into(), json!(part.source));
    params.insert("aggregate".into(), json!(part.aggregate));
    params.insert("ids".into(), json!(part.ids));
    params.insert("upto".into(), json!(part.upto));
    params.insert("oldest".into(), json!(part.oldest));
    let rows = store.run(tenant, cypher, params).await.map_err(upstream)?;
    let applied = rows
        .first()
        .and_then(|r| r.get("applied"))
        .and_then(Value::as_i64);
    if applied.unwrap_or(0) == 0 {
        tracing::info!(
            tenant = tenant.get(),
            source = part.source,
            aggregate = %part.aggregate,
            "graph repair: the live consumer is ahead of this snapshot; left to it"
        );
        return Ok(0);
    }
    Ok(1)
}

/// The customers and products the order touched, before and after,
/// counted again from their edges.
pub async fn recount(
    store: &Store,
    tenant: TenantId,
    before: &Shape,
    after: &Shape,
) -> reliability::Result<()> {
    let customers: BTreeSet<&String> = before.customer.iter().chain(&after.customer).collect();
    let products: BTreeSet<&String> = before
        .lines
        .iter()
        .chain(&after.lines)
        .map(|l| &l.0)
        .collect();
    names(
        store,
        tenant,
        "customers",
        customers.into_iter().cloned().collect(),
    )
    .await?;
    names(
        store,
        tenant,
        "products",
        products.into_iter().cloned().collect(),
    )
    .await
}

/// Counts again every customer's orders and product's units of `tenant`.
pub(crate) async fn recount_all(store: &Store, tenant: TenantId) -> reliability::Result<()> {
    for cypher in RECOUNT_ALL {
        store
            .run(tenant, cypher, Params::new())
            .await
            .map_err(upstream)?;
    }
    Ok(())
}

/// Counts again the given customers' orders or products' units.
pub async fn names(
    store: &Store,
    tenant: TenantId,
    view: &str,
    names: Vec<String>,
) -> reliability::Result<()> {
    if names.is_empty() {
        return Ok(());
    }
    let cypher = if view == "customers" {
        RECOUNT_CUSTOMERS
    } else {
        RECOUNT_PRODUCTS
    };
    let mut params = Params::new();
    params.insert("names".into(), json!(names));
    store.run(tenant, cypher, params).await.map_err(upstream)?;
    Ok(())
}

pub(crate) fn upstream(e: StoreError) -> reliability::Error {
    reliability::Error::Upstream(e.to_string())
}
