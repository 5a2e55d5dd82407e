//! The graph's routes: what each answers, and that no token, path or
//! parameter reaches another tenant's nodes.

use std::sync::Arc;

use graph::store::Store;
use graph::{GraphSettings, SERVICE, Settings};
use reliability::consumer::ConsumerConfig;
use serde_json::{Value, json};
use service_kit::service::{Role, ShutdownToken};
use testkit::{ApiClient, TestDb, unique};

use super::{CONSUMER, commerce, consumer, graph_url, store};

/// The service serving `store`'s graph, with `commerce()` applied.
async fn spawn() -> (ApiClient, Arc<Store>, TestDb, ShutdownToken) {
    let store = store();
    let edges = consumer(&store, ConsumerConfig::new(CONSUMER, "", &[]));
    for e in commerce() {
        edges.apply(&e).await.unwrap();
    }
    let db = TestDb::with_migrations(&graph::MIGRATIONS).await;
    let mut common = testkit::common_settings();
    common.exchange = unique("reltest.graph.");
    let mut settings = Settings {
        role: Role::Serve,
        ..Settings::local(common)
    };
    settings.service = GraphSettings {
        graph_url: graph_url(),
        graph_name: store.name().to_owned(),
        ..GraphSettings::default()
    };
    let app = testkit::serve(&SERVICE, settings, db.databases()).await;
    (app.api, store, db, app.stop)
}

/// `body` without its freshness (`as_of`, `lag_seconds`), and that.
fn fresh(mut body: Value) -> (Value, Value) {
    let map = body.as_object_mut().expect("an object");
    let freshness = json!({"as_of": map.remove("as_of"), "lag_seconds": map.remove("lag_seconds")});
    (body, freshness)
}

#[tokio::test]
async fn each_question_answers_from_the_tenants_own_graph() {
    let (api, store, db, stop) = spawn().await;

    let (status, body) = api.get(1, "/graph/orders/2").await;
    assert_eq!(status, 200, "{body}");
    let (body, freshness) = fresh(body);
    // The newest of tenant 1's events from each source, and its time (the
    // events are stamped 1_700_000_000 + their id).
    for (source, id) in [("orders", 7), ("inventory", 7), ("payments", 3)] {
        let at = &freshness["as_of"][source];
        assert_eq!(at["message_id"], id, "{source}: {freshness}");
        let occurred = chrono::DateTime::from_timestamp(1_700_000_000 + id, 0).unwrap();
        assert_eq!(at["occurred_at"], occurred.to_rfc3339(), "{freshness}");
        assert!(at["applied_at"].is_string(), "{freshness}");
    }
    assert!(
        freshness["lag_seconds"].as_f64().is_some_and(|l| l > 0.0),
        "applied long after its events' own times: {freshness}"
    );
    assert_eq!(
        body,
        json!({
            "order_id": 2, "status": "cancelled", "customer_id": "c1", "currency": "EUR",
            "total_cents": 1000, "reserved": true,
            "lines": [
                {"sku": "B", "quantity": 1, "unit_price_cents": 100, "reserved": true, "released": true},
                {"sku": "C", "quantity": 4, "unit_price_cents": 100, "reserved": true, "released": true},
            ],
            "payments": [{"payment_id": 12, "status": "failed", "amount_cents": null, "refunds": []}],
        })
    );
    let (_, body) = api.get(1, "/graph/orders/1").await;
    assert_eq!(body["status"], "confirmed");
    assert_eq!(
        body["payments"],
        json!([{"payment_id": 11, "status": "captured", "amount_cents": 1000,
                "refunds": [{"refund_id": 5, "amount_cents": 300}]}])
    );
    // Order 4 names A on two lines: one edge, the quantities added.
    let (_, body) = api.get(1, "/graph/orders/4").await;
    assert_eq!(body["lines"][0]["quantity"], 3, "{body}");

    // c1 bought A and B (order 1) and B and C (order 2); c2 bought A and D.
    let (status, body) = api.get(1, "/graph/products/B/co-purchased").await;
    assert_eq!(status, 200, "{body}");
    let (body, freshness) = fresh(body);
    assert_eq!(freshness["as_of"]["orders"]["message_id"], 7);
    assert_eq!(
        body,
        json!({"sku": "B", "products": [{"sku": "A", "customers": 1}, {"sku": "C", "customers": 1}]})
    );
    let (_, body) = api.get(1, "/graph/products/A/co-purchased?limit=1").await;
    assert_eq!(
        body["products"],
        json!([{"sku": "B", "customers": 1}]),
        "{body}"
    );

    // A is in orders 1 (confirmed), 3 (cancelled) and 4 (open, reserved).
    let (status, body) = api.get(1, "/graph/products/A/open-orders").await;
    assert_eq!(status, 200, "{body}");
    let (body, freshness) = fresh(body);
    assert_eq!(freshness["as_of"]["inventory"]["message_id"], 7);
    assert_eq!(
        body,
        json!({"sku": "A", "orders": [{"order_id": 4, "quantity": 3, "reserved": true}]})
    );
    let (_, body) = api.get(1, "/graph/products/D/open-orders").await;
    assert_eq!(fresh(body).0, json!({"sku": "D", "orders": []}));

    stop.cancel();
    store.delete().await.unwrap();
    db.cleanup().await;
}

#[tokio::test]
async fn no_token_path_or_parameter_reaches_another_tenants_nodes() {
    let (api, store, db, stop) = spawn().await;

    // Tenant 2 has an order 1 of its own, and sees only it.
    let (status, body) = api.get(2, "/graph/orders/1").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["lines"],
        json!([{"sku": "A", "quantity": 9, "unit_price_cents": 100,
                                        "reserved": true, "released": false}])
    );
    assert_eq!(
        body["payments"],
        json!([]),
        "tenant 1's payment of its order 1 stays its own"
    );
    // What only tenant 1 has looks like what nobody has.
    for path in [
        "/graph/orders/2",
        "/graph/orders/4",
        "/graph/products/B/co-purchased",
        "/graph/products/C/open-orders",
    ] {
        let (status, body) = api.get(2, path).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(body["error"]["code"], "not_found", "{path}");
    }
    let (_, body) = api.get(2, "/graph/products/A/co-purchased").await;
    let (body, freshness) = fresh(body);
    assert_eq!(
        body,
        json!({"sku": "A", "products": []}),
        "tenant 2's A, alone"
    );
    assert_eq!(
        freshness["as_of"],
        json!({
            "orders": {"message_id": 8, "occurred_at": "2023-11-14T22:13:28+00:00",
                       "applied_at": freshness["as_of"]["orders"]["applied_at"]},
            "inventory": {"message_id": 9, "occurred_at": "2023-11-14T22:13:29+00:00",
                          "applied_at": freshness["as_of"]["inventory"]["applied_at"]},
        }),
        "tenant 2's own positions, no other's"
    );
    let (_, body) = api.get(2, "/graph/products/A/open-orders").await;
    assert_eq!(
        body["orders"],
        json!([{"order_id": 1, "quantity": 9, "reserved": true}])
    );

    // Cypher in the path or the query is a value, never a statement.
    for path in [
        "/graph/orders/1%20OR%201=1",
        "/graph/orders/2%7D)%20MATCH%20(n)%20RETURN%20n%20//",
        "/graph/orders/-1",
        "/graph/products/B'%7D)--(n)RETURN(n)//'/open-orders",
        "/graph/products/B%5C'/co-purchased",
        "/graph/products/$tenant/open-orders",
    ] {
        let (status, body) = api.get(2, path).await;
        assert!(matches!(status, 404 | 422), "{path}: {status} {body}");
        assert!(!body.to_string().contains("\"C\""), "{path} leaked: {body}");
    }
    let (status, body) = api.get(2, "/graph/products/A%20B/open-orders").await;
    assert_eq!(status, 404, "not a sku: no product: {body}");
    for limit in [
        "0",
        "101",
        "-1",
        "1%20RETURN%201",
        "9223372036854775808",
        "x",
        "1&limit=2",
    ] {
        let path = format!("/graph/products/A/co-purchased?limit={limit}");
        let (status, body) = api.get(1, &path).await;
        assert_eq!(
            (status, body["error"]["code"].clone()),
            (422, json!("invalid_request")),
            "limit={limit}"
        );
    }

    // Without a token, nothing.
    let anonymous = reqwest::get(format!("{}/graph/orders/1", api.url))
        .await
        .unwrap();
    assert_eq!(anonymous.status().as_u16(), 401);
    let _: Value = anonymous.json().await.unwrap();

    stop.cancel();
    store.delete().await.unwrap();
    db.cleanup().await;
}

/// The routes reach the graph through `Store::read`: read-only on the
/// engine, so a statement that would write is refused there, whatever
/// its text, and the graph is left as it was.
#[tokio::test]
async fn a_write_sent_as_a_read_is_refused_by_the_engine() {
    use graph::store::{Cypher, Params, StoreError};
    let store = store();
    let tenant = reliability::TenantId::new(1).unwrap();
    let count = Cypher("MATCH (p:Product {tenant: $tenant, sku: 'RO-1'}) RETURN count(p) AS n");
    store
        .run(
            tenant,
            Cypher("MERGE (p:Product {tenant: $tenant, sku: 'RO-0'}) RETURN p.sku AS sku"),
            Params::new(),
        )
        .await
        .expect("a write through run");
    let refused = store
        .read(
            tenant,
            Cypher("CREATE (p:Product {tenant: $tenant, sku: 'RO-1'}) RETURN p.sku AS sku"),
            Params::new(),
        )
        .await;
    assert!(
        matches!(&refused, Err(StoreError::Query(_))),
        "the engine refuses a write in a read: {refused:?}"
    );
    let rows = store.read(tenant, count, Params::new()).await.unwrap();
    assert_eq!(rows[0]["n"], json!(0), "nothing was written");
    store.delete().await.unwrap();
}

/// A node that does not read as its answer (a status that is not text) is
/// a bug of ours: 500, never the 503 of a store that is down, which a
/// client retries as an outage (it was answered 503).
#[tokio::test]
async fn a_row_that_does_not_read_as_its_answer_is_a_500_not_an_outage() {
    use graph::store::{Cypher, Params};
    let (api, store, db, stop) = spawn().await;
    store
        .run(
            reliability::TenantId::new(1).unwrap(),
            Cypher("CREATE (o:Order {tenant: $tenant, id: 77, status: 7}) RETURN o.id AS id"),
            Params::new(),
        )
        .await
        .unwrap();
    let (status, body) = api.get(1, "/graph/orders/77").await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["error"]["code"], "internal_error", "{body}");
    stop.cancel();
    store.delete().await.unwrap();
    db.cleanup().await;
}
