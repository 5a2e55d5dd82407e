//! Each event changes the graph once, whatever the delivery: competing
//! consumers, shuffled and repeated deliveries, and a crash between the
//! graph's write and the broker's ack.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use reliability::broker::{self, QueueSpec};
use reliability::consumer::{ConsumerConfig, Outcome, Sink};
use reliability::failpoint::{self, Action, FailPoints};
use reliability::{Error, TenantId};
use testkit::{amqp_url, delete_broker_objects, race, unique, wait_until};
use tokio_util::sync::CancellationToken;

use super::{CONSUMER, commerce, consumer, dump, graph_url, line, placed, store};
use graph::apply::Edges;
use graph::store::{Cypher, Params, Store};

#[tokio::test]
async fn competing_consumers_with_shuffled_repeated_deliveries_build_the_graph_one_in_order_builds()
{
    let events = commerce();
    let in_order = store();
    let single = consumer(&in_order, ConsumerConfig::new(CONSUMER, "", &[]));
    for e in &events {
        assert_eq!(
            single.apply(e).await.unwrap(),
            Outcome::Applied,
            "{}",
            e.message_id()
        );
    }
    for e in &events {
        assert_eq!(
            single.apply(e).await.unwrap(),
            Outcome::Duplicate,
            "{}",
            e.message_id()
        );
    }
    let expected = (dump(&in_order, 1).await, dump(&in_order, 2).await);
    for edge in [
        "\"PLACED\"",
        "\"CONTAINS\"",
        "\"RESERVED\"",
        "\"RELEASED\"",
        "\"PAID_BY\"",
        "\"REFUNDED\"",
    ] {
        assert!(
            expected.0.iter().any(|r| r.contains(edge)),
            "tenant 1 has a {edge} edge: {expected:#?}"
        );
    }

    for round in 0..3 {
        let competing = store();
        let waves = [events.clone()];
        let stats = race(CONSUMER, &waves, round, |config| {
            consumer(&competing, config)
        })
        .await;
        assert_eq!(
            (stats.applied, stats.dead_lettered),
            (events.len() as u64, 0),
            "round {round}: each event applied once: {stats:?}"
        );
        let actual = (dump(&competing, 1).await, dump(&competing, 2).await);
        assert_eq!(
            actual, expected,
            "round {round}: competing (left) and in order (right) differ"
        );
        competing.delete().await.unwrap();
    }
    in_order.delete().await.unwrap();
}

/// Two replicas' first statements, on a graph that has none yet: FalkorDB
/// plans a statement before it takes the write lock, and a label it does
/// not know yet plans as "no node", so without the schema declared first
/// both missed the checkpoint and both applied (docs/adr/0030).
#[tokio::test]
async fn two_replicas_of_one_event_on_a_fresh_graph_apply_it_once() {
    let event = placed(1, 1, 1, "c1", serde_json::json!([line("A", 2)]));
    for attempt in 0..20 {
        let name = unique("graphtest.");
        let replicas = [
            Arc::new(Store::new(&graph_url(), &name)),
            Arc::new(Store::new(&graph_url(), &name)),
        ];
        let [a, b] = replicas.clone().map(|store| Edges::new(store, CONSUMER));
        let one = [&event];
        let (x, y) = tokio::join!(a.apply(&one), b.apply(&one));
        let mut outcomes = [x.unwrap()[0], y.unwrap()[0]];
        outcomes.sort_by_key(|o| *o != Outcome::Applied);
        assert_eq!(
            outcomes,
            [Outcome::Applied, Outcome::Duplicate],
            "attempt {attempt}"
        );
        assert_eq!(
            counts(&replicas[0]).await,
            (vec![("A".into(), 2)], 1, 1),
            "attempt {attempt}: counted once"
        );
        replicas[0].delete().await.unwrap();
    }
}

/// The key of each label is unique in the graph: a second node of one key
/// is a refused write, never a second count.
#[tokio::test]
async fn the_graph_refuses_a_second_node_of_one_key() {
    const CONSTRAINTS: Cypher = Cypher(
        "CALL db.constraints() YIELD label, status WHERE status = 'OPERATIONAL' RETURN count(label) AS n",
    );
    const CHECKPOINT: Cypher = Cypher(
        "CREATE (:Checkpoint {tenant: $tenant, consumer: 'c', source: 's', aggregate: 'order:1'})",
    );
    let store = store();
    let one = TenantId::new(1).unwrap();
    wait_until(
        Duration::from_secs(10),
        "every label's constraint is in force",
        || async {
            let rows = store.run(one, CONSTRAINTS, Params::new()).await.unwrap();
            rows[0]["n"].as_i64() == Some(graph::schema::KEYS.len() as i64)
        },
    )
    .await;
    store.run(one, CHECKPOINT, Params::new()).await.unwrap();
    let second = store.run(one, CHECKPOINT, Params::new()).await;
    assert!(
        matches!(&second, Err(graph::store::StoreError::Query(e)) if e.contains("constraint")),
        "{second:?}"
    );
    store.delete().await.unwrap();
}

#[tokio::test]
async fn a_crash_between_the_graphs_write_and_the_ack_counts_nothing_twice() {
    let store = store();
    let exchange = unique("reltest.graph.x.");
    let queue = unique("reltest.graph.q.");
    let mut config = ConsumerConfig::new(CONSUMER, &exchange, &[]);
    config.queue = QueueSpec::new(&queue, &exchange, &[]);
    let conn = broker::connect(&amqp_url(), "graph-tests").await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    broker::declare_queue(&channel, &config.queue)
        .await
        .unwrap();
    let order = placed(
        1,
        1,
        1,
        "c1",
        serde_json::json!([line("A", 2), line("B", 1)]),
    );
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            &serde_json::to_vec(&order).unwrap(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    config.fail_points = FailPoints::none();
    config
        .fail_points
        .arm(failpoint::CONSUMER_AFTER_COMMIT, Action::Error);
    let crashing = consumer(&store, config.clone());
    let result = crashing.run(CancellationToken::new()).await;
    assert!(
        matches!(
            result,
            Err(Error::FailPoint(failpoint::CONSUMER_AFTER_COMMIT))
        ),
        "{result:?}"
    );
    let once = counts(&store).await;
    assert_eq!(
        once,
        (vec![("A".into(), 2), ("B".into(), 1)], 1, 2),
        "written before the crash"
    );

    // Unacked, so handed back: the restarted consumer finds its checkpoint.
    config.fail_points = FailPoints::none();
    let restarted = Arc::new(consumer(&store, config));
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (c, stop) = (restarted.clone(), stop.clone());
        async move { c.run(stop).await }
    });
    wait_until(
        Duration::from_secs(30),
        "the redelivery settled",
        || async { restarted.stats().finished() == 1 },
    )
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    let stats = restarted.stats();
    assert_eq!((stats.applied, stats.duplicates), (0, 1), "{stats:?}");
    assert_eq!(counts(&store).await, once, "the redelivery changed nothing");

    let _ = conn.close(200, "done".into()).await;
    delete_broker_objects(&[queue], &exchange).await;
    store.delete().await.unwrap();
}

/// Units ordered per sku, customer c1's orders, and CONTAINS edges, of tenant 1.
async fn counts(store: &Store) -> (Vec<(String, i64)>, i64, i64) {
    const UNITS: Cypher = Cypher(
        "MATCH (p:Product {tenant: $tenant}) RETURN p.sku AS sku, p.units_ordered AS units ORDER BY sku",
    );
    const ORDERS: Cypher =
        Cypher("MATCH (c:Customer {tenant: $tenant, id: 'c1'}) RETURN c.orders AS orders");
    const EDGES: Cypher = Cypher(
        "MATCH (:Order {tenant: $tenant})-[r:CONTAINS]->(:Product {tenant: $tenant}) RETURN count(r) AS edges",
    );
    let one = TenantId::new(1).unwrap();
    let run = |cypher| store.run(one, cypher, Params::new());
    let units = run(UNITS)
        .await
        .unwrap()
        .into_iter()
        .map(|r| {
            (
                r["sku"].as_str().unwrap().to_owned(),
                r["units"].as_i64().unwrap(),
            )
        })
        .collect();
    let first = |rows: Vec<graph::store::Row>, column: &str| rows[0][column].as_i64().unwrap_or(-1);
    let orders = first(run(ORDERS).await.unwrap(), "orders");
    let edges = first(run(EDGES).await.unwrap(), "edges");
    (units, orders, edges)
}

/// A product's checkpoint does not grow with its history: after many
/// stock adjustments it keeps the last `STOCK_WINDOW` message ids, so a
/// write costs the same at the thousandth adjustment as at the first. A
/// redelivery is still seen, and an old adjustment changes nothing.
#[tokio::test]
async fn a_products_checkpoint_keeps_a_bounded_window_of_its_history() {
    use graph::apply::STOCK_WINDOW;
    const N: i64 = 1_000;
    let store = store();
    let edges = consumer(&store, ConsumerConfig::new(CONSUMER, "", &[]));
    let adjusted = |id: i64, on_hand: i64| {
        let mut e = testkit::event(
            "inventory",
            id,
            1,
            ("product", 0),
            contracts::event::STOCK_ADJUSTED,
            serde_json::json!({"sku": "HOT", "delta": 1, "on_hand": on_hand, "reason": "count"}),
        );
        e.aggregate_id = "HOT".into();
        e
    };
    for id in 1..=N {
        assert_eq!(
            edges.apply(&adjusted(id, id)).await.unwrap(),
            Outcome::Applied
        );
    }
    assert_eq!(
        edges.apply(&adjusted(N, N)).await.unwrap(),
        Outcome::Duplicate,
        "a redelivery of the newest is seen"
    );
    // An old adjustment delivered again, beyond the window: no effect.
    edges.apply(&adjusted(3, 3)).await.unwrap();
    let tenant = TenantId::new(1).unwrap();
    let rows = store
        .run(
            tenant,
            Cypher(
                "MATCH (k:Checkpoint {tenant: $tenant, aggregate: 'product:HOT'})
                 MATCH (p:Product {tenant: $tenant, sku: 'HOT'})
                 RETURN size(k.messages) AS kept, p.on_hand AS on_hand",
            ),
            Params::new(),
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["kept"], serde_json::json!(STOCK_WINDOW), "{rows:?}");
    assert_eq!(rows[0]["on_hand"], serde_json::json!(N), "{rows:?}");
    store.delete().await.unwrap();
}
