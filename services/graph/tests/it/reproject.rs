//! The graph re-projected from the sources' current rows, with no event
//! history left (as past the archive): it equals what the rows say, and a
//! live delivery of an event at or below the floor counts nothing twice
//! while one past it is applied once. The floor waits for a transaction
//! that took an id before it.

use std::time::Duration;

use graph::GraphSettings;
use graph::reproject::reproject;
use graph::store::{Cypher, Params};
use graph::verify::Verifier;
use reliability::TenantId;
use reliability::consumer::{ConsumerConfig, Outcome};
use serde_json::json;
use testkit::{TestDb, unique};

use super::verify::sources;
use super::{CONSUMER, commerce, consumer, graph_url, line, placed};

#[tokio::test]
async fn a_graph_re_projected_from_the_rows_alone_equals_its_sources() {
    let (dbs, sources) = sources().await;
    for (db, stock) in [(&dbs[1], true), (&dbs[0], false), (&dbs[2], false)] {
        if stock {
            sqlx::query(
                "INSERT INTO products (tenant_id, sku, on_hand) VALUES (1, 'A', 7), (1, 'B', 5), (2, 'A', 99)",
            )
            .execute(&db.owner)
            .await
            .unwrap();
        }
        // The history is gone, as past the archive's retention; the
        // sequence is where the ids it handed out left it.
        sqlx::raw_sql(
            "DELETE FROM outbox_messages;
             SELECT setval(pg_get_serial_sequence('outbox_messages', 'id'), 100)",
        )
        .execute(&db.owner)
        .await
        .unwrap();
    }
    let settings = GraphSettings {
        graph_url: graph_url(),
        graph_name: unique("graphtest."),
        ..GraphSettings::default()
    };
    let live_store = std::sync::Arc::new(settings.store());
    let live = consumer(&live_store, ConsumerConfig::new(CONSUMER, "", &[]));
    // The old graph: a node no source has.
    let stray = placed(999, 1, 77, "nobody", json!([line("Z", 1)]));
    live.apply(&stray).await.unwrap();

    let report = reproject(&settings, &sources).await.unwrap();
    assert_eq!((report.orders, report.products), (5, 3), "{report:?}");
    assert_eq!(report.floors.orders, 100);
    // The graph swapped in holds the schema: the rebuild's first step
    // deleted the graph it had declared it on, and every MERGE after the
    // swap was a scan with no unique constraint behind it.
    let mut labels: Vec<&str> = graph::schema::KEYS.iter().map(|(l, _)| *l).collect();
    labels.sort_unstable();
    assert_eq!(constrained(&settings.graph_name).await, labels);

    let verify = Verifier::new(live_store.clone(), sources.clone(), Duration::ZERO, 500);
    let clean = verify.run_once(false).await.unwrap();
    assert!(clean.differences.is_empty(), "{:#?}", clean.differences);
    let one = TenantId::new(1).unwrap();
    let on_hand = live_store
        .run(
            one,
            Cypher("MATCH (p:Product {tenant: $tenant, sku: 'A'}) RETURN p.on_hand AS n"),
            Params::new(),
        )
        .await
        .unwrap();
    assert_eq!(on_hand[0]["n"], json!(7));

    // Every event at or below the floor is in the rows: a late delivery is a duplicate.
    for e in commerce() {
        assert_eq!(
            live.apply(&e).await.unwrap(),
            Outcome::Duplicate,
            "{}",
            e.event_type
        );
    }
    // One past it is applied, once.
    sqlx::query(
        "INSERT INTO orders (tenant_id, order_id, customer_id, currency, total_cents, created_at, updated_at)
         VALUES (1, 5, 'c1', 'EUR', 1000, now() - interval '1 minute', now() - interval '1 minute')",
    )
    .execute(&sources.orders)
    .await
    .unwrap();
    sqlx::query("INSERT INTO order_lines VALUES (1, 5, 1, 'A', 1, 100)")
        .execute(&sources.orders)
        .await
        .unwrap();
    let next = placed(101, 1, 5, "c1", json!([line("A", 1)]));
    assert_eq!(live.apply(&next).await.unwrap(), Outcome::Applied);
    assert_eq!(live.apply(&next).await.unwrap(), Outcome::Duplicate);
    let after = verify.run_once(false).await.unwrap();
    assert!(after.differences.is_empty(), "{:#?}", after.differences);

    live_store.delete().await.unwrap();
    for db in dbs {
        db.cleanup().await;
    }
}

#[tokio::test]
async fn the_floor_waits_for_a_transaction_that_took_an_id_before_it() {
    let db = TestDb::new().await;
    let mut open = db.owner.begin().await.unwrap();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload)
         VALUES (1, 'order', '1', 'OrderPlaced', '{}') RETURNING id",
    )
    .fetch_one(&mut *open)
    .await
    .unwrap();

    let err = sources::floor(&db.owner, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("still open"), "{err}");

    let pool = db.owner.clone();
    let mut floor =
        tokio::spawn(async move { sources::floor(&pool, Duration::from_secs(20)).await });
    // A bounded wait for what must not happen: the floor ending while the
    // transaction that took an id below it is open.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut floor)
            .await
            .is_err(),
        "the floor did not wait for the open transaction"
    );
    open.commit().await.unwrap();
    let floor = floor.await.unwrap().unwrap();
    assert!(
        floor >= id,
        "floor {floor} below an id taken before it ({id})"
    );
    db.cleanup().await;
}

/// The labels graph `name` holds a unique constraint on, in order.
async fn constrained(name: &str) -> Vec<String> {
    let url = graph_url().replacen("falkor://", "redis://", 1);
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let (_, rows, _): (Vec<String>, Vec<Vec<String>>, Vec<String>) = redis::cmd("GRAPH.QUERY")
        .arg(name)
        .arg("CALL db.constraints() YIELD label RETURN label ORDER BY label")
        .query_async(&mut conn)
        .await
        .unwrap();
    rows.into_iter().flatten().collect()
}
