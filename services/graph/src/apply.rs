//! Events into the graph, each exactly once: one statement per event
//! records its message on its aggregate's checkpoint node and makes its
//! change, atomically (docs/adr/0030). A message the checkpoint holds
//! already changes nothing. Every change is a MERGE or a SET that any
//! delivery order brings to the same graph: statuses by precedence, stock
//! by the newest message, the reservation's edges derived by whichever of
//! the order's events comes last.

use std::sync::Arc;

use contracts::AnyEvent;
use reliability::TenantId;
use reliability::consumer::{HandlerError, Outcome, Sink};
use reliability::outbox::Envelope;
use serde_json::{Value, json};

use crate::store::{Cypher, Params, Store, StoreError};

/// The tenant's watermark of the event's source, after a fresh event's
/// checkpoint: the highest message applied and its time, and when the
/// graph applied one last (`freshness.rs` reads them as `as_of`).
macro_rules! watermark {
    () => {
        "MERGE (w:Watermark {tenant: $tenant, source: $source})
         SET w.newer = coalesce(w.message, -1) < $message, w.applied_at = timestamp()
         WITH w
         SET w.message = CASE WHEN w.newer THEN $message ELSE w.message END,
             w.occurred_at = CASE WHEN w.newer THEN $occurred_at ELSE w.occurred_at END
         WITH w
         "
    };
}

/// The checkpoint (a message it lists, or at or below its `upto`, the
/// floor of a re-projection from the sources' rows, is a duplicate), then
/// the tenant's watermark of the event's source (the
/// highest message applied, its time, and when: what answers give as
/// `as_of`), then the event's change, then whether it was applied (1) or
/// already seen (0): every change keeps its one row. Each read of
/// a property that a write depends on is in that write's own SET (`fresh`
/// is written, then used): Neo4j locks a node before such a read, where a
/// value read by an earlier clause could be stale by the write (read
/// committed). FalkorDB runs a graph's writes one at a time anyway, but
/// folds adjacent SET clauses into one (the second would not see the
/// first's `fresh`), hence the `WITH k` between them.
macro_rules! once {
    ($change:expr) => {
        Cypher(concat!(
            "MERGE (k:Checkpoint {tenant: $tenant, consumer: $consumer, source: $source, aggregate: $aggregate})
             SET k.fresh = NOT ($message IN coalesce(k.messages, [])) AND $message > coalesce(k.upto, -1)
             WITH k
             SET k.messages = CASE WHEN k.fresh THEN coalesce(k.messages, []) + [$message] ELSE k.messages END
             WITH k.fresh AS fresh WHERE fresh
             MERGE (:Tenant {tenant: $tenant})
             ",
            watermark!(),
            $change,
            "
             RETURN count(*) AS applied"
        ))
    };
}

/// An order's RESERVED edges (stock held for each product it contains)
/// and RELEASED edges (held, then given back as it was cancelled), from
/// what its node knows now: placed, reserved and cancelled arrive in any
/// order, and the last of them draws the edges.
macro_rules! stock_edges {
    () => {
        "WITH o
         OPTIONAL MATCH (o)-[:CONTAINS]->(p:Product {tenant: $tenant})
         WITH o, collect(p) AS products
         FOREACH (p IN CASE WHEN o.reserved THEN products ELSE [] END | MERGE (o)-[:RESERVED]->(p))
         FOREACH (p IN CASE WHEN o.reserved AND o.status = 'cancelled' THEN products ELSE [] END | MERGE (o)-[:RELEASED]->(p))"
    };
}

/// Counts too: the customer's orders and the units ordered of each
/// product, which only the checkpoint keeps from counting twice.
const ORDER_PLACED: Cypher = once!(concat!(
    "MERGE (c:Customer {tenant: $tenant, id: $customer_id})
     SET c.orders = coalesce(c.orders, 0) + 1
     MERGE (o:Order {tenant: $tenant, id: $order_id})
     SET o.currency = $currency, o.total_cents = $total_cents,
         o.status = coalesce(o.status, 'placed'), o.placed_at = $occurred_at
     MERGE (c)-[:PLACED]->(o)
     FOREACH (l IN $lines |
         MERGE (p:Product {tenant: $tenant, sku: l.sku})
         SET p.units_ordered = coalesce(p.units_ordered, 0) + l.quantity
         MERGE (o)-[r:CONTAINS]->(p)
         SET r.quantity = l.quantity, r.unit_price_cents = l.unit_price_cents)
     ",
    stock_edges!()
));

const ORDER_CONFIRMED: Cypher = once!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     SET o.status = 'confirmed'"
);

const ORDER_CANCELLED: Cypher = once!(concat!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     SET o.status = 'cancelled', o.cancel_reason = $reason
     ",
    stock_edges!()
));

const INVENTORY_RESERVED: Cypher = once!(concat!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     SET o.reserved = true
     ",
    stock_edges!()
));

const INVENTORY_REJECTED: Cypher = once!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     SET o.rejected = $reason"
);

/// The stock figure of the newest adjustment (outbox ids grow with each
/// adjustment of a product, taken one at a time under its row's lock).
///
/// Not [`once!`]: a product's history has no end, and a checkpoint listing
/// every message id grew with it, and each write's cost with it (past a
/// size, every write of the one graph all tenants share outran the
/// store's 5 s bound). This checkpoint keeps the last [`STOCK_WINDOW`] ids:
/// a redelivery within them is seen; one older than them (a DLQ re-drive
/// of an old letter) changes nothing anyway, since only an adjustment
/// newer than the figure's own (`on_hand_message`) sets it.
const STOCK_ADJUSTED: Cypher = Cypher(concat!(
    "MERGE (k:Checkpoint {tenant: $tenant, consumer: $consumer, source: $source, aggregate: $aggregate})
     SET k.fresh = NOT ($message IN coalesce(k.messages, [])) AND $message > coalesce(k.upto, -1)
     WITH k
     SET k.messages = CASE WHEN k.fresh THEN coalesce(k.messages, [])[-63..] + [$message] ELSE k.messages END
     WITH k.fresh AS fresh WHERE fresh
     MERGE (:Tenant {tenant: $tenant})
     ",
    watermark!(),
    "MERGE (p:Product {tenant: $tenant, sku: $sku})
     SET p.on_hand = CASE WHEN coalesce(p.on_hand_message, 0) < $message THEN $on_hand ELSE p.on_hand END
     SET p.on_hand_message = CASE WHEN coalesce(p.on_hand_message, 0) < $message THEN $message ELSE p.on_hand_message END
     RETURN count(*) AS applied"
));

/// How many message ids a product's checkpoint keeps (the `-63..` slice
/// above, plus the new one).
pub const STOCK_WINDOW: usize = 64;

const PAYMENT_CAPTURED: Cypher = once!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     MERGE (pay:Payment {tenant: $tenant, id: $payment_id})
     SET pay.amount_cents = $amount_cents, pay.currency = $currency, pay.status = 'captured'
     MERGE (o)-[:PAID_BY]->(pay)"
);

/// A capture outranks a failure, whichever arrives last.
const PAYMENT_FAILED: Cypher = once!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     MERGE (pay:Payment {tenant: $tenant, id: $payment_id})
     SET pay.status = CASE WHEN pay.status = 'captured' THEN pay.status ELSE 'failed' END,
         pay.failure = $reason
     MERGE (o)-[:PAID_BY]->(pay)"
);

const REFUND_ISSUED: Cypher = once!(
    "MERGE (o:Order {tenant: $tenant, id: $order_id})
     MERGE (pay:Payment {tenant: $tenant, id: $payment_id})
     MERGE (o)-[:PAID_BY]->(pay)
     MERGE (r:Refund {tenant: $tenant, id: $refund_id})
     SET r.amount_cents = $amount_cents
     MERGE (pay)-[:REFUNDED]->(r)"
);

/// Every statement the consumer runs, for the scoping test.
pub const STATEMENTS: &[Cypher] = &[
    ORDER_PLACED,
    ORDER_CONFIRMED,
    ORDER_CANCELLED,
    INVENTORY_RESERVED,
    INVENTORY_REJECTED,
    STOCK_ADJUSTED,
    PAYMENT_CAPTURED,
    PAYMENT_FAILED,
    REFUND_ISSUED,
];

/// The graph consumer's [`Sink`]: each event's change and checkpoint in
/// one statement, in delivery order.
pub struct Edges {
    store: Arc<Store>,
    consumer: String,
}

impl Edges {
    /// Applies for `consumer` (its checkpoints' key) into `store`.
    pub fn new(store: Arc<Store>, consumer: &str) -> Self {
        Self {
            store,
            consumer: consumer.to_owned(),
        }
    }

    async fn apply_one(&self, event: &Envelope) -> Result<Outcome, HandlerError> {
        let tenant =
            TenantId::new(event.tenant_id).map_err(|e| HandlerError::Permanent(e.into()))?;
        let (cypher, mut params) = statement(event)?;
        params.insert("consumer".into(), json!(self.consumer));
        params.insert("source".into(), json!(event.source));
        params.insert("aggregate".into(), json!(event.aggregate_key()));
        params.insert("message".into(), json!(event.id));
        params.insert("occurred_at".into(), json!(event.occurred_at.to_rfc3339()));
        let rows = self
            .store
            .run(tenant, cypher, params)
            .await
            .map_err(|e| match e {
                StoreError::Unavailable(_) => HandlerError::Unavailable(e.into()),
                StoreError::Query(_) => HandlerError::Transient(e.into()),
                StoreError::Unscoped(_) => HandlerError::Permanent(e.into()),
            })?;
        let applied = rows
            .first()
            .and_then(|r| r.get("applied"))
            .and_then(Value::as_i64);
        Ok(match applied {
            Some(n) if n > 0 => Outcome::Applied,
            _ => Outcome::Duplicate,
        })
    }
}

impl Sink for Edges {
    async fn apply(&self, events: &[&Envelope]) -> Result<Vec<Outcome>, HandlerError> {
        let mut outcomes = Vec::with_capacity(events.len());
        for event in events {
            outcomes.push(self.apply_one(event).await?);
        }
        Ok(outcomes)
    }
}

/// The statement of `event`'s type and its parameters.
fn statement(event: &Envelope) -> Result<(Cypher, Params), HandlerError> {
    let params = |v: Value| match v {
        Value::Object(map) => map,
        _ => Params::new(),
    };
    Ok(match event.event()? {
        AnyEvent::OrderPlaced(e) => {
            // One CONTAINS edge per product: a sku on two lines adds up.
            let mut lines: Vec<(String, i64, i64)> = Vec::new();
            for l in e.lines {
                match lines.iter_mut().find(|(sku, ..)| *sku == l.sku) {
                    Some(line) => line.1 += l.quantity,
                    None => lines.push((l.sku, l.quantity, l.unit_price_cents)),
                }
            }
            let lines: Vec<Value> = lines
                .into_iter()
                .map(|(sku, quantity, unit_price_cents)| {
                    json!({"sku": sku, "quantity": quantity, "unit_price_cents": unit_price_cents})
                })
                .collect();
            (
                ORDER_PLACED,
                params(json!({
                    "order_id": e.order_id, "customer_id": e.customer_id, "currency": e.currency,
                    "total_cents": e.total_cents, "lines": lines,
                })),
            )
        }
        AnyEvent::OrderConfirmed(e) => (ORDER_CONFIRMED, params(json!({"order_id": e.order_id}))),
        AnyEvent::OrderCancelled(e) => (
            ORDER_CANCELLED,
            params(json!({"order_id": e.order_id, "reason": e.reason})),
        ),
        AnyEvent::InventoryReserved(e) => {
            (INVENTORY_RESERVED, params(json!({"order_id": e.order_id})))
        }
        AnyEvent::InventoryRejected(e) => (
            INVENTORY_REJECTED,
            params(json!({"order_id": e.order_id, "reason": e.reason})),
        ),
        AnyEvent::StockAdjusted(e) => (
            STOCK_ADJUSTED,
            params(json!({"sku": e.sku, "on_hand": e.on_hand})),
        ),
        AnyEvent::PaymentCaptured(e) => (
            PAYMENT_CAPTURED,
            params(json!({"order_id": e.order_id, "payment_id": e.payment_id,
                          "amount_cents": e.amount_cents, "currency": e.currency})),
        ),
        AnyEvent::PaymentFailed(e) => (
            PAYMENT_FAILED,
            params(json!({"order_id": e.order_id, "payment_id": e.payment_id, "reason": e.reason})),
        ),
        AnyEvent::RefundIssued(e) => (
            REFUND_ISSUED,
            params(json!({"order_id": e.order_id, "payment_id": e.payment_id,
                          "refund_id": e.refund_id, "amount_cents": e.amount_cents})),
        ),
    })
}
