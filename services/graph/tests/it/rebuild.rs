//! The graph rebuilt from the sources' history while the live consumer
//! goes on: the same graph as the events applied in order.

use std::sync::Arc;

use graph::GraphSettings;
use graph::rebuild::{build_fresh, catch_up, swap};
use graph::store::Store;
use reliability::consumer::ConsumerConfig;
use testkit::{TestDb, unique};

use super::{CONSUMER, commerce, consumer, dump, graph_url, line, placed, record};

#[tokio::test]
async fn a_rebuild_beside_the_live_consumer_ends_with_the_graph_of_every_event() {
    let mut dbs = Vec::new();
    let mut sources = Vec::new();
    for source in ["orders", "inventory", "payments"] {
        let db = TestDb::new().await;
        sources.push((source.to_owned(), db.owner.clone()));
        dbs.push(db);
    }
    let mut events = commerce();
    // Committed after the fresh graph was built: only the catch-up brings it.
    let late = placed(100, 1, 9, "c3", serde_json::json!([line("B", 5)]));
    events.push(late.clone());

    let expected = Arc::new(Store::new(&graph_url(), &unique("graphtest.")));
    let in_order = consumer(&expected, ConsumerConfig::new(CONSUMER, "", &[]));
    for e in &events {
        in_order.apply(e).await.unwrap();
    }

    // The live graph: half the history, and a node no event made.
    let settings = GraphSettings {
        graph_url: graph_url(),
        graph_name: unique("graphtest."),
        ..GraphSettings::default()
    };
    let live_store = Arc::new(settings.store());
    let live = consumer(&live_store, ConsumerConfig::new(CONSUMER, "", &[]));
    let history = &events[..events.len() - 1];
    record(&sources, history).await;
    for e in &history[..history.len() / 2] {
        live.apply(e).await.unwrap();
    }
    let stray = placed(999, 1, 77, "nobody", serde_json::json!([line("Z", 1)]));
    live.apply(&stray).await.unwrap();

    let (fresh, replayed) = build_fresh(&settings, &sources).await.unwrap();
    let total: usize = replayed.iter().map(|r| r.events).sum();
    assert_eq!(total, history.len(), "{replayed:?}");
    // Meanwhile the live consumer goes on with the old graph: the rest of
    // the history, and the late event as it commits.
    for e in &history[history.len() / 2..] {
        live.apply(e).await.unwrap();
    }
    record(&sources, std::slice::from_ref(&late)).await;
    live.apply(&late).await.unwrap();

    swap(&fresh, &settings).await.unwrap();
    assert_eq!(
        catch_up(&settings, &sources).await.unwrap(),
        1,
        "the late event"
    );
    for tenant in [1, 2] {
        assert_eq!(
            dump(&live_store, tenant).await,
            dump(&expected, tenant).await,
            "tenant {tenant}: rebuilt (left) and in order (right) differ"
        );
    }

    live_store.delete().await.unwrap();
    expected.delete().await.unwrap();
    for db in dbs {
        db.cleanup().await;
    }
}
