//! The graph against the real FalkorDB (`scripts/falkordb.sh` starts one
//! on 127.0.0.1:6380 when `GRAPH_URL` names none) and the real broker and
//! PostgreSQL. Each test has a graph of its own.

mod api;
mod exactly_once;
mod rebuild;
mod reproject;
mod restart;
mod verify;

use std::sync::Arc;

use contracts::event;
use graph::apply::Edges;
use graph::store::{Cypher, Params, Store};
use reliability::TenantId;
use reliability::consumer::{Consumer, ConsumerConfig};
use reliability::outbox::Envelope;
use serde_json::{Value, json};
use sqlx::PgPool;
use testkit::unique;

/// The FalkorDB server the tests use, started once per test binary if need be.
pub fn graph_url() -> String {
    graph::test_url()
}

/// A graph of the test's own.
pub fn store() -> Arc<Store> {
    Arc::new(Store::new(&graph_url(), &unique("graphtest.")))
}

pub const CONSUMER: &str = "graph.edges";

/// A consumer applying into `store` (`amqp` empty: applied by hand).
pub fn consumer(store: &Arc<Store>, config: ConsumerConfig) -> Consumer<Edges> {
    Consumer::with_sink(
        &testkit::amqp_url(),
        config,
        Edges::new(store.clone(), CONSUMER),
    )
    .unwrap()
}

/// An event at a time of its own, to the microsecond (as its outbox row
/// keeps it: a rebuild reads it back).
fn ev(source: &str, id: i64, tenant: i64, agg: (&str, i64), t: &str, payload: Value) -> Envelope {
    let mut e = testkit::event(source, id, tenant, agg, t, payload);
    e.occurred_at = chrono::DateTime::from_timestamp(1_700_000_000 + id, 0).unwrap();
    e
}

fn placed(id: i64, tenant: i64, order: i64, customer: &str, lines: Value) -> Envelope {
    let payload = json!({"order_id": order, "customer_id": customer, "currency": "EUR",
                         "total_cents": 1000, "lines": lines});
    ev(
        "orders",
        id,
        tenant,
        ("order", order),
        event::ORDER_PLACED,
        payload,
    )
}

fn line(sku: &str, quantity: i64) -> Value {
    json!({"sku": sku, "quantity": quantity, "unit_price_cents": 100})
}

/// Writes `events` into their sources' outboxes, with their own ids.
pub async fn record(sources: &[(String, PgPool)], events: &[Envelope]) {
    for e in events {
        let (_, pool) = sources.iter().find(|(s, _)| *s == e.source).unwrap();
        sqlx::query(
            "INSERT INTO outbox_messages (id, tenant_id, aggregate_type, aggregate_id, event_type,
                                          event_version, payload, occurred_at, processed_at)
             OVERRIDING SYSTEM VALUE VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now())",
        )
        .bind(e.id)
        .bind(e.tenant_id)
        .bind(&e.aggregate_type)
        .bind(&e.aggregate_id)
        .bind(&e.event_type)
        .bind(e.event_version)
        .bind(&e.payload)
        .bind(e.occurred_at)
        .execute(pool)
        .await
        .unwrap();
    }
}

/// Two tenants' commerce, every event type, ids that repeat across
/// tenants and sources: order 1 is in both tenants.
pub fn commerce() -> Vec<Envelope> {
    let o = |id, tenant, order, t: &str| {
        ev(
            "orders",
            id,
            tenant,
            ("order", order),
            t,
            json!({"order_id": order, "reason": "no stock"}),
        )
    };
    let inv = |id, tenant, order, t: &str| {
        let payload = json!({"order_id": order, "customer_id": "c1", "currency": "EUR",
                             "total_cents": 1000, "reason": "no stock"});
        ev("inventory", id, tenant, ("order", order), t, payload)
    };
    let pay = |id, tenant, order, payment: i64, t: &str, extra: Value| {
        let mut payload = json!({"order_id": order, "payment_id": payment, "amount_cents": 1000,
                                 "currency": "EUR", "reason": "declined"});
        payload
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        ev("payments", id, tenant, ("payment", payment), t, payload)
    };
    let stock = |id, tenant, sku: &str, on_hand: i64| {
        let payload = json!({"sku": sku, "delta": 1, "on_hand": on_hand, "reason": "count"});
        let mut e = ev(
            "inventory",
            id,
            tenant,
            ("product", 0),
            event::STOCK_ADJUSTED,
            payload,
        );
        e.aggregate_id = sku.to_owned();
        e
    };
    vec![
        // Tenant 1, order 1: placed, reserved, paid, confirmed, part refunded.
        placed(1, 1, 1, "c1", json!([line("A", 2), line("B", 1)])),
        inv(1, 1, 1, event::INVENTORY_RESERVED),
        pay(1, 1, 1, 11, event::PAYMENT_CAPTURED, json!({})),
        o(2, 1, 1, event::ORDER_CONFIRMED),
        pay(
            2,
            1,
            1,
            11,
            event::REFUND_ISSUED,
            json!({"refund_id": 5, "amount_cents": 300}),
        ),
        // Order 2: reserved, the payment failed, cancelled: stock released.
        placed(3, 1, 2, "c1", json!([line("B", 1), line("C", 4)])),
        inv(2, 1, 2, event::INVENTORY_RESERVED),
        pay(3, 1, 2, 12, event::PAYMENT_FAILED, json!({})),
        o(4, 1, 2, event::ORDER_CANCELLED),
        // Order 3: rejected, cancelled; order 4 open, a sku on two lines.
        placed(5, 1, 3, "c2", json!([line("A", 1), line("D", 1)])),
        inv(3, 1, 3, event::INVENTORY_REJECTED),
        o(6, 1, 3, event::ORDER_CANCELLED),
        placed(7, 1, 4, "c2", json!([line("A", 1), line("A", 2)])),
        inv(4, 1, 4, event::INVENTORY_RESERVED),
        stock(5, 1, "A", 10),
        stock(6, 1, "A", 7),
        stock(7, 1, "B", 5),
        // Tenant 2: its own order 1, customer c1 and product A.
        placed(8, 2, 1, "c1", json!([line("A", 9)])),
        inv(8, 2, 1, event::INVENTORY_RESERVED),
        stock(9, 2, "A", 99),
    ]
}

/// Every node but the checkpoints and the watermarks (their times are
/// the apply's), and every edge, of `tenant`, as sorted JSON text.
pub async fn dump(store: &Store, tenant: i64) -> Vec<String> {
    const NODES: Cypher = Cypher(
        "MATCH (n {tenant: $tenant}) WHERE NOT n:Checkpoint AND NOT n:Watermark
         RETURN labels(n) AS labels, properties(n) AS properties",
    );
    const EDGES: Cypher = Cypher(
        "MATCH (a {tenant: $tenant})-[r]->(b {tenant: $tenant})
         RETURN properties(a) AS from, type(r) AS type, properties(r) AS properties, properties(b) AS to",
    );
    let tenant = TenantId::new(tenant).unwrap();
    let mut rows = Vec::new();
    for cypher in [NODES, EDGES] {
        for row in store.run(tenant, cypher, Params::new()).await.unwrap() {
            rows.push(Value::Object(row).to_string());
        }
    }
    rows.sort();
    rows
}

#[test]
fn every_statement_of_the_service_is_scoped_to_the_tenant() {
    for cypher in graph::apply::STATEMENTS
        .iter()
        .chain(graph::http::STATEMENTS)
    {
        assert_eq!(graph::store::check(cypher.0), Ok(()), "{}", cypher.0);
    }
}

#[tokio::test]
async fn the_store_refuses_an_unscoped_statement_and_a_tenant_of_the_callers() {
    let store = store();
    let one = TenantId::new(1).unwrap();
    let unscoped = Cypher("MATCH (n) RETURN count(n) AS n");
    let err = store.run(one, unscoped, Params::new()).await.unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
    let mut params = Params::new();
    params.insert("tenant".into(), json!(2));
    let scoped = Cypher("MATCH (n:Order {tenant: $tenant}) RETURN count(n) AS n");
    let err = store.run(one, scoped, params).await.unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
    store.delete().await.unwrap();
}
