//! `graph verify` against real source databases and a real FalkorDB: the
//! graph of every event agrees with the sources' rows; drift of each kind
//! is named and repaired; a repair records the events it reflects, so a
//! late delivery counts nothing twice; and it leaves an aggregate the
//! live consumer is ahead of.

use std::collections::BTreeSet;
use std::time::Duration;

use contracts::event;
use graph::store::{Cypher, Params, Store};
use graph::verify::{Report, Verifier};
use reliability::TenantId;
use reliability::consumer::{ConsumerConfig, Outcome};
use serde_json::json;
use sources::Sources;
use testkit::TestDb;

use super::{CONSUMER, commerce, consumer, record, store};

/// The three source databases, their rows what `commerce()`'s events
/// say (`testkit::seeded_sources`), and the events in their outboxes.
pub(super) async fn sources() -> (Vec<TestDb>, Sources) {
    let dbs = testkit::seeded_sources().await;
    let history = vec![
        ("orders".to_owned(), dbs.orders.owner.clone()),
        ("inventory".to_owned(), dbs.inventory.owner.clone()),
        ("payments".to_owned(), dbs.payments.owner.clone()),
    ];
    record(&history, &commerce()).await;
    let sources = Sources {
        orders: dbs.orders.owner.clone(),
        inventory: dbs.inventory.owner.clone(),
        payments: dbs.payments.owner.clone(),
    };
    (vec![dbs.orders, dbs.inventory, dbs.payments], sources)
}

fn verifier(store: &std::sync::Arc<Store>, sources: &Sources) -> Verifier {
    // A chunk of 2: the walk crosses chunks and tenants.
    Verifier::new(store.clone(), sources.clone(), Duration::ZERO, 2)
}

fn found(report: &Report) -> BTreeSet<(String, i64, String)> {
    report
        .differences
        .iter()
        .map(|d| (d.view.to_owned(), d.tenant_id, d.entity.clone()))
        .collect()
}

async fn change(store: &Store, tenant: i64, cypher: &'static str) {
    store
        .run(
            TenantId::new(tenant).unwrap(),
            Cypher(cypher),
            Params::new(),
        )
        .await
        .unwrap();
}

async fn count(store: &Store, cypher: &'static str) -> i64 {
    let rows = store
        .run(TenantId::new(1).unwrap(), Cypher(cypher), Params::new())
        .await
        .unwrap();
    rows[0]["n"].as_i64().unwrap()
}

#[tokio::test]
async fn a_graph_that_drifted_is_named_and_repaired() {
    let (dbs, sources) = sources().await;
    let store = store();
    let live = consumer(&store, ConsumerConfig::new(CONSUMER, "", &[]));
    for e in commerce() {
        live.apply(&e).await.unwrap();
    }
    let verify = verifier(&store, &sources);
    let clean = verify.run_once(false).await.unwrap();
    assert!(clean.differences.is_empty(), "{:#?}", clean.differences);
    assert_eq!(clean.orders_checked, 5);

    // An edge deleted, a status flipped, a line changed, a count bumped, a node lost.
    change(&store, 1, "MATCH (o:Order {tenant: $tenant, id: 1})-[r:CONTAINS]->(p:Product {tenant: $tenant, sku: 'B'}) DELETE r").await;
    change(
        &store,
        1,
        "MATCH (o:Order {tenant: $tenant, id: 4}) SET o.status = 'confirmed'",
    )
    .await;
    change(&store, 2, "MATCH (o:Order {tenant: $tenant, id: 1})-[r:CONTAINS]->(p:Product {tenant: $tenant}) SET r.quantity = 5").await;
    change(
        &store,
        1,
        "MATCH (c:Customer {tenant: $tenant, id: 'c1'}) SET c.orders = 7",
    )
    .await;
    change(
        &store,
        1,
        "MATCH (o:Order {tenant: $tenant, id: 3}) DETACH DELETE o",
    )
    .await;
    change(
        &store,
        1,
        "MATCH (p:Product {tenant: $tenant, sku: 'C'}) SET p.units_ordered = 0",
    )
    .await;

    let drift = verify.run_once(false).await.unwrap();
    let named: BTreeSet<_> = [
        ("orders", 1, "1"),
        ("orders", 1, "3"),
        ("orders", 1, "4"),
        ("orders", 2, "1"),
        ("customers", 1, "c1"),
        ("products", 1, "C"),
    ]
    .into_iter()
    .map(|(v, t, e)| (v.to_owned(), t, e.to_owned()))
    .collect();
    assert_eq!(found(&drift), named, "{:#?}", drift.differences);
    assert!(drift.differences.iter().all(|d| !d.repaired));

    let repaired = verify.run_once(true).await.unwrap();
    assert!(
        repaired.differences.iter().all(|d| d.repaired),
        "{:#?}",
        repaired.differences
    );
    let after = verify.run_once(false).await.unwrap();
    assert!(after.differences.is_empty(), "{:#?}", after.differences);
    // The lost order's customer counts it again, once.
    assert_eq!(
        count(
            &store,
            "MATCH (c:Customer {tenant: $tenant, id: 'c2'}) RETURN c.orders AS n"
        )
        .await,
        2
    );

    store.delete().await.unwrap();
    for db in dbs {
        db.cleanup().await;
    }
}

#[tokio::test]
async fn a_repair_records_the_events_it_reflects_so_a_late_delivery_counts_nothing_twice() {
    let (dbs, sources) = sources().await;
    let store = store();
    let live = consumer(&store, ConsumerConfig::new(CONSUMER, "", &[]));
    // Order 4's placement and reservation are late: the graph has not got them.
    let is_late = |e: &reliability::outbox::Envelope| {
        e.aggregate_id == "4" && e.event_type != event::STOCK_ADJUSTED && e.tenant_id == 1
    };
    let events = commerce();
    for e in events.iter().filter(|e| !is_late(e)) {
        live.apply(e).await.unwrap();
    }
    let verify = verifier(&store, &sources);
    let repaired = verify.run_once(true).await.unwrap();
    assert_eq!(
        found(&repaired),
        [("orders".to_owned(), 1, "4".to_owned())].into(),
        "{:#?}",
        repaired.differences
    );
    assert!(repaired.differences[0].repaired);

    // The late events arrive: the repair has them already.
    for e in events.iter().filter(|e| is_late(e)) {
        assert_eq!(
            live.apply(e).await.unwrap(),
            Outcome::Duplicate,
            "{}",
            e.event_type
        );
    }
    let after = verify.run_once(false).await.unwrap();
    assert!(after.differences.is_empty(), "{:#?}", after.differences);
    assert_eq!(
        count(
            &store,
            "MATCH (c:Customer {tenant: $tenant, id: 'c2'}) RETURN c.orders AS n"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            &store,
            "MATCH (p:Product {tenant: $tenant, sku: 'A'}) RETURN p.units_ordered AS n"
        )
        .await,
        6
    );

    store.delete().await.unwrap();
    for db in dbs {
        db.cleanup().await;
    }
}

#[tokio::test]
async fn a_repair_leaves_an_aggregate_the_live_consumer_is_ahead_of() {
    let (dbs, sources) = sources().await;
    let store = store();
    let live = consumer(&store, ConsumerConfig::new(CONSUMER, "", &[]));
    for e in commerce() {
        live.apply(&e).await.unwrap();
    }
    // A cancellation the graph applied and the snapshot does not see (as
    // if it committed after the snapshot was read).
    let mut cancelled = testkit::event(
        "orders",
        100,
        1,
        ("order", 4),
        event::ORDER_CANCELLED,
        json!({"order_id": 4, "reason": "changed mind"}),
    );
    cancelled.occurred_at = chrono::Utc::now();
    assert_eq!(live.apply(&cancelled).await.unwrap(), Outcome::Applied);

    let verify = verifier(&store, &sources);
    let report = verify.run_once(true).await.unwrap();
    let order = report
        .differences
        .iter()
        .find(|d| d.view == "orders")
        .expect("order 4 differs");
    assert_eq!((order.tenant_id, order.entity.as_str()), (1, "4"));
    assert!(
        !order.repaired,
        "a repair wrote an older state over a newer one"
    );
    let status = store
        .run(
            TenantId::new(1).unwrap(),
            Cypher("MATCH (o:Order {tenant: $tenant, id: 4}) RETURN o.status AS status"),
            Params::new(),
        )
        .await
        .unwrap();
    assert_eq!(status[0]["status"], json!("cancelled"));

    store.delete().await.unwrap();
    for db in dbs {
        db.cleanup().await;
    }
}
