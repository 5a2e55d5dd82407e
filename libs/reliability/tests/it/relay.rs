//! I1: every committed outbox row reaches the broker at least once, through
//! crashes, concurrent relays and broker outages.

use std::collections::HashMap;
use std::time::Duration;

use reliability::consumer::{Consumer, ConsumerConfig};
use reliability::failpoint::{self, Action, FailPoints};
use reliability::outbox::{self, NewEvent};
use reliability::relay::{Relay, RelayConfig};
use reliability::{Error, TenantTx};
use serde_json::json;
use testkit::{TestDb, amqp_url, wait_until};
use tokio_util::sync::CancellationToken;

use crate::support::{
    AddingHandler, Broker, DEADLINE, create_effects_table, effects, enqueue_added, tenant,
};

mod concurrent;
mod outages;

/// Runs `relay` in the background until the returned token is cancelled.
fn spawn_relay(
    relay: Relay,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<reliability::Result<()>>,
) {
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    (stop, running)
}

fn config(broker: &Broker) -> RelayConfig {
    RelayConfig::new("svc", &broker.exchange)
}

#[tokio::test]
async fn committed_rows_are_published_with_their_envelope_and_marked_processed() {
    let metrics = reliability::metrics::install();
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let a = enqueue_added(&db, 1, "agg-1", 5).await;
    let b = enqueue_added(&db, 2, "agg-2", 7).await;
    // A rolled-back transaction's event must never leave.
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    outbox::enqueue(
        &mut tx,
        &NewEvent::new("test", "ghost", "Added", &json!({"amount": 1})).unwrap(),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();

    let relay = Relay::new(db.relay.clone(), &amqp_url(), config(&broker));
    let report = relay
        .drain(&relay.publisher().await.unwrap())
        .await
        .unwrap();
    assert_eq!((report.claimed, report.published, report.failed), (2, 2, 0));

    let got = broker.take_all(&queue).await;
    let by_id: HashMap<i64, _> = got.iter().map(|e| (e.id, e)).collect();
    assert_eq!(got.len(), 2);
    assert_eq!(by_id[&a].tenant_id, 1);
    assert_eq!(by_id[&a].aggregate_id, "agg-1");
    assert_eq!(by_id[&a].routing_key(), "svc.Added");
    assert_eq!(by_id[&b].payload, json!({"amount": 7}));
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
            .fetch_one(&db.owner)
            .await
            .unwrap();
    assert_eq!(pending, 0);
    relay.update_gauges().await.unwrap();
    let text = metrics.render();
    assert!(
        text.contains(r#"outbox_published_total{source="svc"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"outbox_lag_seconds{source="svc"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"outbox_dlq_depth{source="svc"} 0"#),
        "{text}"
    );
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// The binary content mode of CloudEvents: every attribute a `ce-` header.
#[tokio::test]
async fn events_go_out_with_their_cloudevents_attributes() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let id = enqueue_added(&db, 3, "agg-9", 5).await;
    let relay = Relay::new(db.relay.clone(), &amqp_url(), config(&broker));
    relay
        .drain(&relay.publisher().await.unwrap())
        .await
        .unwrap();
    let headers = broker.take_headers(&queue).await;
    let ce = |k: &str| headers.get(k).map(String::as_str);
    assert_eq!(ce("ce-specversion"), Some("1.0"));
    assert_eq!(ce("ce-id"), Some(format!("svc:{id}").as_str()));
    assert_eq!(ce("ce-source"), Some("/commerce/svc"));
    assert_eq!(ce("ce-type"), Some("Added"));
    assert_eq!(ce("ce-subject"), Some("test/agg-9"));
    assert_eq!(ce("ce-tenantid"), Some("3"));
    assert_eq!(ce("ce-dataversion"), Some("1"));
    let time = ce("ce-time").expect("ce-time");
    assert!(chrono::DateTime::parse_from_rfc3339(time).is_ok(), "{time}");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_relay_crash_after_the_confirm_republishes_and_the_consumer_applies_once() {
    let db = TestDb::new().await;
    create_effects_table(&db).await;
    let broker = Broker::new().await;
    let consumer_cfg =
        ConsumerConfig::new(&testkit::unique("reltest.c."), &broker.exchange, &["svc.*"]);
    let queue = consumer_cfg.queue.queue.clone();
    reliability::broker::declare_queue(&broker.channel, &consumer_cfg.queue)
        .await
        .unwrap();
    for i in 0..5 {
        enqueue_added(&db, 1, &format!("agg-{i}"), 10).await;
    }

    let mut crashing = config(&broker);
    crashing.fail_points = FailPoints::none();
    crashing
        .fail_points
        .arm(failpoint::RELAY_AFTER_CONFIRM, Action::Error);
    let relay = Relay::new(db.relay.clone(), &amqp_url(), crashing);
    let publisher = relay.publisher().await.unwrap();
    let err = relay.relay_batch(&publisher).await.unwrap_err();
    assert!(
        matches!(err, Error::FailPoint(failpoint::RELAY_AFTER_CONFIRM)),
        "{err}"
    );
    drop(publisher);

    // The broker has all five, yet none is marked: the restarted relay sends them again.
    let unmarked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
            .fetch_one(&db.owner)
            .await
            .unwrap();
    assert_eq!(unmarked, 5);
    let restarted = Relay::new(db.relay.clone(), &amqp_url(), config(&broker));
    let report = restarted
        .drain(&restarted.publisher().await.unwrap())
        .await
        .unwrap();
    assert_eq!(report.published, 5);
    assert_eq!(
        broker.depth(&queue).await,
        10,
        "each message is on the queue twice"
    );

    let consumer = std::sync::Arc::new(Consumer::new(
        db.app.clone(),
        &amqp_url(),
        consumer_cfg,
        AddingHandler::default(),
    ));
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (stop, consumer) = (stop.clone(), consumer.clone());
        async move { consumer.run(stop).await }
    });
    wait_until(DEADLINE, "both copies of every message acked", || async {
        consumer.stats().finished() == 10
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(consumer.stats().applied, 5);
    assert_eq!(consumer.stats().duplicates, 5);
    for (_, _, applied, total) in effects(&db).await {
        assert_eq!((applied, total), (1, 10));
    }
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn the_relay_wakes_on_commit_instead_of_waiting_for_the_poll() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let mut cfg = config(&broker);
    cfg.poll_interval = Duration::from_secs(3600);
    let relay = Relay::new(db.relay.clone(), &amqp_url(), cfg);
    let (stop, running) = spawn_relay(relay);
    // The first batch runs at start-up; wait until the relay sits idle on LISTEN.
    enqueue_added(&db, 1, "first", 1).await;
    wait_until(DEADLINE, "first event published", || async {
        broker.depth(&queue).await == 1
    })
    .await;
    enqueue_added(&db, 1, "second", 1).await;
    // Far less than the hour-long poll: only a NOTIFY can explain delivery.
    wait_until(
        Duration::from_secs(10),
        "second event published on NOTIFY",
        || async { broker.depth(&queue).await == 2 },
    )
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn the_tenant_view_names_the_top_tenants_and_sums_the_rest_and_forgets_them_once_drained() {
    let metrics = reliability::metrics::install();
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["tenantview.*"]).await;
    // Tenant t has t pending rows: 1..=12, so 3..=12 are the top ten and
    // tenants 1 and 2 (1 + 2 rows) are "other".
    for t in 1..=12 {
        for i in 0..t {
            enqueue_added(&db, t, &format!("agg-{t}-{i}"), 1).await;
        }
    }
    let relay = Relay::new(
        db.relay.clone(),
        &amqp_url(),
        RelayConfig::new("tenantview", &broker.exchange),
    );
    relay.update_tenant_view().await.unwrap();
    let text = reliability::metrics::render(&metrics);
    assert!(
        text.contains("# HELP outbox_tenant_pending "),
        "every metric has HELP: {text}"
    );
    assert!(
        text.contains(r#"outbox_pending{source="tenantview"} 78"#),
        "{text}"
    );
    for t in 3..=12 {
        assert!(
            text.contains(&format!(
                r#"outbox_tenant_pending{{source="tenantview",tenant="{t}"}} {t}"#
            )),
            "{text}"
        );
    }
    assert!(
        text.contains(r#"outbox_tenant_pending{source="tenantview",tenant="other"} 3"#),
        "{text}"
    );
    assert!(
        !text.contains(r#"source="tenantview",tenant="1""#),
        "{text}"
    );
    assert_eq!(
        text.matches(r#"outbox_tenant_lag_seconds{source="tenantview""#)
            .count(),
        11,
        "{text}"
    );

    relay
        .drain(&relay.publisher().await.unwrap())
        .await
        .unwrap();
    relay.update_tenant_view().await.unwrap();
    let text = reliability::metrics::render(&metrics);
    assert!(
        !text.contains(r#"outbox_tenant_pending{source="tenantview""#),
        "a drained outbox leaves no tenant series: {text}"
    );
    assert!(
        text.contains(r#"outbox_pending{source="tenantview"} 0"#),
        "{text}"
    );
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// The log relay's batches (docs/adr/0038): the rows a caller names, those
/// still unpublished, over several batches with some in flight at once,
/// each published once and in id order. A batch of rows published already
/// claims none and the next is still claimed; a row nobody names stays
/// for the polling relay.
#[tokio::test]
async fn named_rows_are_published_once_over_a_window_of_batches_and_the_others_left_pending() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(enqueue_added(&db, 1, &format!("agg-{i}"), i).await);
    }
    let left = enqueue_added(&db, 2, "agg-x", 9).await;
    let mut config = config(&broker);
    config.batch_size = 2;
    let relay = Relay::new(db.relay.clone(), &amqp_url(), config);
    let publisher = relay.publisher().await.unwrap();
    let first = relay
        .relay_ids(&publisher, &[ids[1], ids[0]])
        .await
        .unwrap();
    assert_eq!((first.claimed, first.published), (2, 2));
    let report = relay.relay_ids(&publisher, &ids).await.unwrap();
    assert_eq!(
        (report.claimed, report.published),
        (5, 5),
        "published once: {report:?}"
    );
    let got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    assert_eq!(got, ids, "each once, in id order");
    let pending: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM outbox_messages WHERE processed_at IS NULL")
            .fetch_all(&db.owner)
            .await
            .unwrap();
    assert_eq!(pending, [left], "left for the polling relay");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}
