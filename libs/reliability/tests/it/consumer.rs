//! I2 and I8: a consumer applies each event once whatever the delivery
//! count or order, and poison ends in its DLQ where an operator can re-drive it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use reliability::Error;
use reliability::broker;
use reliability::consumer::{Consumer, ConsumerConfig, ConsumerStats};
use reliability::db;
use reliability::failpoint::{self, Action};
use reliability::testing::{TcpProxy, TestDb, amqp_url, postgres_addr, unique, wait_until};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::support::{
    AddingHandler, Broker, DEADLINE, Rng, create_effects_table, effects, envelope,
};

async fn setup() -> (TestDb, Broker, ConsumerConfig) {
    let db = TestDb::new().await;
    create_effects_table(&db).await;
    let broker = Broker::new().await;
    let mut cfg = ConsumerConfig::new(&unique("reltest.c."), &broker.exchange, &["svc.*"]);
    cfg.retry_delay = Duration::from_millis(10);
    cfg.max_attempts = 3;
    broker::declare_queue(&broker.channel, &cfg.queue)
        .await
        .unwrap();
    (db, broker, cfg)
}

type Running = (
    CancellationToken,
    Arc<Consumer<AddingHandler>>,
    JoinHandle<reliability::Result<()>>,
);

/// Runs a consumer until it has settled `n` deliveries, stops it, and
/// returns what it counted.
async fn consume(db: &TestDb, cfg: ConsumerConfig, n: u64) -> ConsumerStats {
    let (stop, consumer, task) = start(db, cfg, AddingHandler::default());
    wait_until(DEADLINE, &format!("{n} deliveries settled"), || async {
        consumer.stats().finished() == n
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    consumer.stats()
}

fn start(db: &TestDb, cfg: ConsumerConfig, handler: AddingHandler) -> Running {
    let consumer = Arc::new(Consumer::new(db.app.clone(), &amqp_url(), cfg, handler));
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (stop, consumer) = (stop.clone(), consumer.clone());
        async move { consumer.run(stop).await }
    });
    (stop, consumer, task)
}

#[tokio::test]
async fn shuffled_and_repeated_deliveries_apply_each_event_exactly_once() {
    let (db, broker, cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    // 40 events of two sources and three tenants; ids deliberately collide
    // across sources, which must not merge them.
    let mut events = Vec::new();
    for id in 1..=20 {
        events.push(envelope(
            "svc",
            id,
            1 + id % 3,
            &format!("agg-{}", id % 4),
            "Added",
            id,
        ));
        events.push(envelope(
            "other",
            id,
            1 + id % 3,
            &format!("agg-{}", id % 4),
            "Added",
            100 * id,
        ));
    }
    // Each delivered one to three times, in a shuffled order: later ids
    // often arrive before earlier ones, as when ids commit out of order.
    let mut rng = Rng::new(42);
    let mut deliveries = Vec::new();
    for e in &events {
        for _ in 0..=rng.below(3) {
            deliveries.push(e.clone());
        }
    }
    rng.shuffle(&mut deliveries);
    for e in &deliveries {
        broker
            .publish_to_queue(&queue, &serde_json::to_vec(e).unwrap())
            .await;
    }

    let stats = consume(&db, cfg, deliveries.len() as u64).await;
    assert_eq!(broker.depth(&queue).await, 0);
    assert_eq!(stats.applied, events.len() as u64);
    assert_eq!(
        stats.finished(),
        deliveries.len() as u64,
        "every delivery was acked"
    );

    // The expected state is each event applied once, computed independently.
    let mut expected = std::collections::BTreeMap::<(i64, String), (i32, i64)>::new();
    for e in &events {
        let entry = expected
            .entry((e.tenant_id, e.aggregate_id.clone()))
            .or_default();
        entry.0 += 1;
        entry.1 += e.payload["amount"].as_i64().unwrap();
    }
    let actual: std::collections::BTreeMap<_, _> = effects(&db)
        .await
        .into_iter()
        .map(|(t, a, applied, total)| ((t, a), (applied, total)))
        .collect();
    assert_eq!(actual, expected);

    let offsets: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT tenant_id, source, last_seen_id FROM consumer_offsets ORDER BY 1, 2",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert!(
        offsets.iter().all(|(_, _, last)| *last >= 18),
        "offsets advance to the highest id: {offsets:?}"
    );
    // Progress counts what happened, group by group: applied once each,
    // every other delivery a duplicate absorbed.
    let (applied, duplicates): (i64, i64) = sqlx::query_as(
        "SELECT sum(applied_count)::bigint, sum(duplicate_count)::bigint FROM consumer_offsets",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(
        (applied, duplicates),
        (
            events.len() as i64,
            (deliveries.len() - events.len()) as i64
        )
    );
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_crash_after_commit_before_ack_makes_the_redelivery_a_no_op() {
    let (db, broker, mut cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    cfg.fail_points
        .arm(failpoint::CONSUMER_AFTER_COMMIT, Action::Error);
    broker
        .publish_to_queue(
            &queue,
            &serde_json::to_vec(&envelope("svc", 7, 1, "agg", "Added", 5)).unwrap(),
        )
        .await;

    let (_stop, _, task) = start(&db, cfg.clone(), AddingHandler::default());
    let result = task.await.unwrap();
    assert!(
        matches!(
            result,
            Err(Error::FailPoint(failpoint::CONSUMER_AFTER_COMMIT))
        ),
        "{result:?}"
    );
    assert_eq!(
        effects(&db).await,
        vec![(1, "agg".to_owned(), 1, 5)],
        "committed before the crash"
    );

    // The broker still holds it unacked-then-requeued; a restarted consumer sees it again.
    cfg.fail_points = Default::default();
    let stats = consume(&db, cfg, 1).await;
    assert_eq!((stats.applied, stats.duplicates), (0, 1));
    assert_eq!(
        effects(&db).await,
        vec![(1, "agg".to_owned(), 1, 5)],
        "applied once"
    );
    let offsets = reliability::consumer::offsets(&db.owner, None)
        .await
        .unwrap();
    assert_eq!(
        offsets
            .iter()
            .map(|o| (o.applied_count, o.duplicate_count))
            .collect::<Vec<_>>(),
        vec![(1, 1)],
        "the absorbed duplicate is counted"
    );
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_crash_before_commit_leaves_no_effect_and_the_redelivery_applies_it() {
    let (db, broker, mut cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    cfg.fail_points
        .arm(failpoint::CONSUMER_BEFORE_COMMIT, Action::Error);
    broker
        .publish_to_queue(
            &queue,
            &serde_json::to_vec(&envelope("svc", 3, 2, "agg", "Added", 9)).unwrap(),
        )
        .await;

    let (_stop, _, task) = start(&db, cfg.clone(), AddingHandler::default());
    let result = task.await.unwrap();
    assert!(
        matches!(
            result,
            Err(Error::FailPoint(failpoint::CONSUMER_BEFORE_COMMIT))
        ),
        "{result:?}"
    );
    assert!(effects(&db).await.is_empty(), "nothing committed");

    cfg.fail_points = Default::default();
    let stats = consume(&db, cfg, 1).await;
    assert_eq!(
        (stats.applied, stats.duplicates),
        (1, 0),
        "nothing had been recorded"
    );
    assert_eq!(effects(&db).await, vec![(2, "agg".to_owned(), 1, 9)]);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_poison_message_is_dead_lettered_while_the_rest_flows_and_replays_once_after_a_fix() {
    let metrics = reliability::metrics::install();
    let (db, broker, cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    let handler = AddingHandler::default();
    handler.poisoned.store(true, Ordering::SeqCst);
    broker
        .publish_to_queue(
            &queue,
            &serde_json::to_vec(&envelope("svc", 1, 1, "bad", "Poison", 1000)).unwrap(),
        )
        .await;
    broker.publish_to_queue(&queue, b"{ this is not json").await;
    for id in 2..=4 {
        broker
            .publish_to_queue(
                &queue,
                &serde_json::to_vec(&envelope("svc", id, 1, "good", "Added", id)).unwrap(),
            )
            .await;
    }

    let (stop, consumer, task) = start(&db, cfg, handler.clone());
    let dlq = broker::dead_letter_queue(&queue);
    wait_until(
        DEADLINE,
        "good events applied and both bad ones dead-lettered",
        || async {
            broker.depth(&dlq).await == 2
                && effects(&db).await == vec![(1, "good".to_owned(), 3, 9)]
        },
    )
    .await;

    let letters = broker::peek_dead_letters(&broker.conn, &queue, 10)
        .await
        .unwrap();
    assert_eq!(letters.len(), 2);
    assert!(letters.iter().any(|l| l.body.contains("\"Poison\"")));
    assert!(letters.iter().any(|l| l.body.contains("this is not json")));
    assert!(
        letters
            .iter()
            .all(|l| l.reason.as_deref() == Some("rejected")),
        "{letters:?}"
    );
    wait_until(DEADLINE, "peeked messages back in the DLQ", || async {
        broker.depth(&dlq).await == 2
    })
    .await;

    // The operator fixes the handler and re-drives: the poison applies once,
    // the malformed message fails again and returns to the DLQ.
    handler.poisoned.store(false, Ordering::SeqCst);
    assert_eq!(
        broker::redrive_dead_letters(&broker.conn, &queue, 10)
            .await
            .unwrap(),
        2
    );
    wait_until(DEADLINE, "re-driven poison applied", || async {
        effects(&db)
            .await
            .iter()
            .any(|(_, agg, applied, total)| agg == "bad" && (*applied, *total) == (1, 1000))
    })
    .await;
    wait_until(DEADLINE, "malformed message back in the DLQ", || async {
        broker.depth(&dlq).await == 1
    })
    .await;
    // The per-queue view: its lag (nothing waiting), its DLQ, its last apply.
    let name = consumer.config().name.clone();
    wait_until(DEADLINE, "the queue gauges see the DLQ", || async {
        let text = metrics.render();
        text.contains(&format!(r#"consumer_dlq_depth{{consumer="{name}"}} 1"#))
            && text.contains(&format!(r#"consumer_queue_depth{{consumer="{name}"}} 0"#))
            && text.contains(&format!(
                r#"consumer_last_applied_timestamp_seconds{{consumer="{name}"}}"#
            ))
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(consumer.stats().dead_lettered, 3);
    assert_eq!(consumer.stats().applied, 4);
    // The operator gives up on the malformed one.
    assert_eq!(
        broker::purge_dead_letters(&broker.conn, &queue)
            .await
            .unwrap(),
        1
    );
    assert_eq!(broker.depth(&dlq).await, 0);
    let text = metrics.render();
    for line in [
        format!(r#"consumer_dead_lettered_total{{consumer="{name}",reason="handler_failed"}} 1"#),
        format!(r#"consumer_dead_lettered_total{{consumer="{name}",reason="malformed"}} 2"#),
    ] {
        assert!(text.contains(&line), "missing `{line}` in\n{text}");
    }
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_message_that_keeps_crashing_its_consumer_is_dead_lettered_by_the_delivery_limit() {
    let (db, broker, cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    broker
        .publish_to_queue(
            &queue,
            &serde_json::to_vec(&envelope("svc", 1, 1, "agg", "Added", 1)).unwrap(),
        )
        .await;
    // Crash before commit on every delivery, as a handler that kills its
    // process would; the broker counts each as a delivery.
    let dlq = broker::dead_letter_queue(&queue);
    let mut crashes = 0;
    loop {
        wait_until(
            DEADLINE,
            "the message is back on the queue or dead-lettered",
            || async { broker.depth(&queue).await + broker.depth(&dlq).await == 1 },
        )
        .await;
        if broker.depth(&dlq).await == 1 {
            break;
        }
        crashes += 1;
        assert!(
            crashes <= cfg.queue.delivery_limit + 1,
            "still redelivered after {crashes} crashes"
        );
        cfg.fail_points
            .arm(failpoint::CONSUMER_BEFORE_COMMIT, Action::Error);
        let (_stop, _, task) = start(&db, cfg.clone(), AddingHandler::default());
        assert!(task.await.unwrap().is_err());
    }
    assert!(
        crashes >= cfg.queue.delivery_limit,
        "dead-lettered after {crashes} crashes"
    );
    assert_eq!(broker.depth(&queue).await, 0);
    assert!(effects(&db).await.is_empty());
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_database_outage_delays_messages_but_never_dead_letters_them() {
    let (db, broker, cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    let proxy = TcpProxy::start(postgres_addr()).await;
    let app_via_proxy = db.pool_via(db::APP_ROLE, proxy.addr).await;
    proxy.down();
    for id in 1..=5 {
        broker
            .publish_to_queue(
                &queue,
                &serde_json::to_vec(&envelope("svc", id, 1, "agg", "Added", 1)).unwrap(),
            )
            .await;
    }
    let consumer = Arc::new(Consumer::new(
        app_via_proxy,
        &amqp_url(),
        cfg,
        AddingHandler::default(),
    ));
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (stop, consumer) = (stop.clone(), consumer.clone());
        async move { consumer.run(stop).await }
    });
    // Keep the database away until the consumer has failed more often than
    // a handler error may (3 tries): an outage must not count against them.
    wait_until(
        DEADLINE,
        "the consumer retried through the outage",
        || async { consumer.stats().retries > 4 },
    )
    .await;
    assert_eq!(broker.depth(&broker::dead_letter_queue(&queue)).await, 0);
    proxy.up();
    wait_until(
        DEADLINE,
        "all applied once the database is back",
        || async { consumer.stats().applied == 5 },
    )
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(consumer.stats().dead_lettered, 0);
    assert_eq!(broker.depth(&broker::dead_letter_queue(&queue)).await, 0);
    assert_eq!(effects(&db).await, vec![(1, "agg".to_owned(), 5, 5)]);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn waiting_deliveries_of_several_tenants_commit_as_one_group_each_under_its_tenant() {
    let (db, broker, cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    // Interleaved tenants, all waiting before the consumer starts: grouped.
    for id in 1..=30 {
        let tenant = 1 + id % 3;
        broker
            .publish_to_queue(
                &queue,
                &serde_json::to_vec(&envelope("svc", id, tenant, "agg", "Added", id)).unwrap(),
            )
            .await;
    }
    let stats = consume(&db, cfg, 30).await;
    // Each tenant's rows carry its own tenant (RLS's WITH CHECK would have
    // refused a row under another tenant's setting, and the group would
    // have fallen back to one at a time: `grouped` proves it did not).
    let sum = |t: i64| (1..=30).filter(|id| 1 + id % 3 == t).sum::<i64>();
    assert_eq!(
        effects(&db).await,
        vec![
            (1, "agg".to_owned(), 10, sum(1)),
            (2, "agg".to_owned(), 10, sum(2)),
            (3, "agg".to_owned(), 10, sum(3)),
        ]
    );
    assert_eq!((stats.applied, stats.duplicates), (30, 0));
    assert!(stats.grouped > 0, "{stats:?}");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn an_event_without_a_valid_tenant_is_dead_lettered_and_its_group_still_applies() {
    let (db, broker, cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    // Waiting before the consumer starts, so they arrive as one group.
    for (id, tenant) in [(1, 1), (2, 0), (3, 1), (4, -7), (5, 1)] {
        broker
            .publish_to_queue(
                &queue,
                &serde_json::to_vec(&envelope("svc", id, tenant, "agg", "Added", id)).unwrap(),
            )
            .await;
    }
    let stats = consume(&db, cfg, 5).await;
    assert_eq!((stats.applied, stats.dead_lettered), (3, 2));
    assert_eq!(effects(&db).await, vec![(1, "agg".to_owned(), 3, 9)]);
    assert_eq!(broker.depth(&broker::dead_letter_queue(&queue)).await, 2);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}
