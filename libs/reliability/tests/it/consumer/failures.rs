//! I8: poison and crashing messages are dead-lettered, a database outage only delays.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use reliability::broker;
use reliability::consumer::{self, Consumer};
use reliability::db;
use reliability::failpoint::{self, Action};
use testkit::{TcpProxy, amqp_url, postgres_addr, wait_until};
use tokio_util::sync::CancellationToken;

use crate::support::{AddingHandler, DEADLINE, effects, envelope};

use super::{setup, start};

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

    // Held, not acked, until the re-drive below (the operator's tools,
    // `operator::dlq`, are tested in the operator's crate).
    let letters = take_letters(&broker, &dlq, 2).await;
    let body = |l: &lapin::message::BasicGetMessage| String::from_utf8_lossy(&l.data).into_owned();
    assert!(letters.iter().any(|l| body(l).contains("\"Poison\"")));
    assert!(letters.iter().any(|l| body(l).contains("this is not json")));
    for l in &letters {
        let reason = broker::header_str(&l.properties, "x-first-death-reason");
        assert_eq!(reason.as_deref(), Some("rejected"));
    }
    // The handler's error is kept beside the letter, which carries only
    // the broker's "rejected": the poison's cause; the malformed message
    // has no tenant to keep one under.
    let name = consumer.config().name.clone();
    let kept: Vec<(i64, String, String, String)> = sqlx::query_as(
        "SELECT message_id, reason, error_class, error FROM dead_letter_causes
         WHERE consumer = $1 ORDER BY message_id",
    )
    .bind(&name)
    .fetch_all(&db.owner)
    .await
    .unwrap();
    let expected = (1, "handler_failed", "transient", "transient: poison pill");
    let expected = (
        expected.0,
        expected.1.into(),
        expected.2.into(),
        expected.3.into(),
    );
    assert_eq!(kept, [expected]);

    // The operator fixes the handler and re-drives: the poison applies once,
    // the malformed message fails again and returns to the DLQ.
    handler.poisoned.store(false, Ordering::SeqCst);
    for letter in letters {
        redrive(&broker, &queue, letter).await;
    }
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
    let purged = broker
        .channel
        .queue_purge(dlq.as_str().into(), Default::default())
        .await
        .unwrap();
    assert_eq!(purged, 1);
    assert_eq!(broker.depth(&dlq).await, 0);
    let text = metrics.render();
    for line in [
        format!(r#"consumer_dead_lettered_total{{consumer="{name}",reason="handler_failed"}} 1"#),
        format!(r#"consumer_dead_lettered_total{{consumer="{name}",reason="malformed"}} 2"#),
        // Each applied event's age, in buckets that reach an hour.
        format!(r#"consumer_event_age_seconds_bucket{{consumer="{name}",le="3600"}} 4"#),
        format!(r#"consumer_event_age_seconds_count{{consumer="{name}"}} 4"#),
    ] {
        assert!(text.contains(&line), "missing `{line}` in\n{text}");
    }
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// A message that takes its consumer down each time it is tried (a
/// handler that kills its process) is dead-lettered once its recorded
/// tries say it is the one, well before the queue's delivery limit. The
/// message behind it, handed back by the same crashes and never tried, is
/// applied: counted by returns alone, it went to the DLQ with the culprit
/// (shown in session 29).
#[tokio::test]
async fn a_message_that_keeps_crashing_its_consumer_is_dead_lettered_alone() {
    let (db, broker, mut cfg) = setup().await;
    cfg.lanes = 1;
    let queue = cfg.queue.queue.clone();
    for (id, aggregate) in [(1, "culprit"), (2, "neighbour")] {
        let event = envelope("svc", id, 1, aggregate, "Added", 1);
        broker
            .publish_to_queue(&queue, &serde_json::to_vec(&event).unwrap())
            .await;
    }
    let crash = format!(
        "{}@{}/1/test:culprit",
        failpoint::CONSUMER_HANDLER,
        cfg.name
    );
    let dlq = broker::dead_letter_queue(&queue);
    let mut crashes = 0;
    let running = loop {
        wait_until(DEADLINE, "the messages back on the queue", || async {
            broker.depth(&queue).await + broker.depth(&dlq).await == 2
        })
        .await;
        cfg.fail_points.arm(&crash, Action::Crash);
        let (stop, _, task) = start(&db, cfg.clone(), AddingHandler::default());
        wait_until(DEADLINE, "a crash or a dead letter", || async {
            task.is_finished() || broker.depth(&dlq).await == 1
        })
        .await;
        if !task.is_finished() {
            break (stop, task);
        }
        assert!(task.await.unwrap().is_err(), "a crash");
        crashes += 1;
        assert!(
            crashes <= cfg.queue.delivery_limit,
            "still redelivered after {crashes} crashes"
        );
    };
    assert_eq!(crashes, 1 + consumer::CRASH_TRIES as u32);
    wait_until(DEADLINE, "the neighbour applied", || async {
        effects(&db).await.len() == 1
    })
    .await;
    assert_eq!(
        effects(&db).await[0].1,
        "neighbour",
        "the culprit never applied"
    );
    assert_eq!(broker.depth(&dlq).await, 1);
    assert_eq!(broker.depth(&queue).await, 0);
    running.0.cancel();
    running.1.await.unwrap().unwrap();
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// A message whose ack is lost after its commit, time after time (its
/// channel gone with a broker node), was applied each time: no try of it
/// ended in its consumer's death, and it is acked, never set aside as one
/// that crashes its consumer. Counted from the record to the ack, its
/// third hand-back dead-lettered it, applied (shown in session 30).
#[tokio::test]
async fn a_message_whose_ack_is_lost_after_each_commit_is_never_set_aside() {
    let (db, broker, mut cfg) = setup().await;
    cfg.lanes = 1;
    let queue = cfg.queue.queue.clone();
    let event = envelope("svc", 1, 1, "agg", "Added", 1);
    broker
        .publish_to_queue(&queue, &serde_json::to_vec(&event).unwrap())
        .await;
    let dlq = broker::dead_letter_queue(&queue);
    for _ in 0..=consumer::CRASH_TRIES {
        wait_until(DEADLINE, "the message back on the queue", || async {
            broker.depth(&queue).await == 1
        })
        .await;
        cfg.fail_points
            .arm(failpoint::CONSUMER_AFTER_COMMIT, Action::Error);
        let (_stop, _, task) = start(&db, cfg.clone(), AddingHandler::default());
        assert!(
            task.await.unwrap().is_err(),
            "lost its ack after the commit"
        );
    }
    cfg.fail_points = Default::default();
    let (stop, consumer, task) = start(&db, cfg.clone(), AddingHandler::default());
    wait_until(DEADLINE, "the message settled", || async {
        broker.depth(&queue).await == 0
            && consumer.stats().duplicates + consumer.stats().dead_lettered == 1
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(broker.depth(&dlq).await, 0, "never dead-lettered");
    assert_eq!(consumer.stats().duplicates, 1);
    assert_eq!(effects(&db).await, vec![(1, "agg".to_owned(), 1, 1)]);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// Copies of one message (a relay publishes again what it cannot prove
/// confirmed), handed back together, are tried side by side, and each
/// try of the event adds to its count: here two copies' tries are in the
/// table when a third copy, handed back once, comes to its consumer. It is
/// applied, never set aside as the event its consumer keeps dying on.
/// Counted by the event's tries alone, it was dead-lettered (two copies
/// beside the applied one, in `make e2e`'s quorum-lost row; session 30).
#[tokio::test]
async fn a_copy_handed_back_once_is_tried_whatever_its_siblings_tries() {
    let (db, broker, mut cfg) = setup().await;
    cfg.lanes = 1;
    let queue = cfg.queue.queue.clone();
    let event = envelope("svc", 1, 1, "agg", "Added", 1);
    broker
        .publish_to_queue(&queue, &serde_json::to_vec(&event).unwrap())
        .await;
    super::hand_back(&broker, &queue, 1).await;
    // Two sibling copies' tries, in flight elsewhere.
    let mut tx = reliability::TenantTx::begin(&db.app, reliability::TenantId::new(1).unwrap())
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO consumer_tries (tenant_id, consumer, source, message_id, tries)
         VALUES (1, $1, 'svc', 1, $2)",
    )
    .bind(&cfg.name)
    .bind(consumer::CRASH_TRIES)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let stats = super::consume(&db, cfg, 1).await;
    assert_eq!((stats.applied, stats.dead_lettered), (1, 0));
    assert_eq!(broker.depth(&broker::dead_letter_queue(&queue)).await, 0);
    assert_eq!(effects(&db).await, vec![(1, "agg".to_owned(), 1, 1)]);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// A handed-back delivery's try runs beside no other handler of its
/// process: a death during it is its own. Tried beside a neighbour in
/// another lane, each death of the culprit (a process abort) was counted
/// against the neighbour too, which was parked beside it after three
/// restarts running (`make e2e`'s "worn" scenario, session 43's
/// rehearsal). Two deliveries handed back, two lanes, one each: they are
/// tried one after the other.
#[tokio::test]
async fn handed_back_deliveries_are_tried_one_at_a_time_across_lanes() {
    let (db, broker, mut cfg) = setup().await;
    (cfg.lanes, cfg.prefetch) = (2, 1);
    let queue = cfg.queue.queue.clone();
    for (id, aggregate) in [(1, "one"), (2, "two")] {
        let event = envelope("svc", id, 1, aggregate, "Added", 1);
        broker
            .publish_to_queue(&queue, &serde_json::to_vec(&event).unwrap())
            .await;
    }
    super::hand_back(&broker, &queue, 2).await;

    let handler = Overlap::default();
    let (stop, consumer, task) = start(&db, cfg, handler.clone());
    wait_until(DEADLINE, "both applied", || async {
        consumer.stats().applied == 2
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(handler.most.load(Ordering::SeqCst), 1, "tried side by side");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// Counts the handler's runs that overlap, each taking a while.
#[derive(Clone, Default)]
struct Overlap {
    running: Arc<std::sync::atomic::AtomicUsize>,
    most: Arc<std::sync::atomic::AtomicUsize>,
}

impl consumer::Handler for Overlap {
    async fn handle(
        &self,
        _: &mut reliability::TenantTx,
        _: &reliability::outbox::Envelope,
    ) -> Result<(), consumer::HandlerError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
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
async fn one_lane_whose_channel_fails_sends_back_only_its_own_deliveries() {
    let (db, broker, mut cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    cfg.lanes = 2;
    cfg.prefetch = 20;
    cfg.batch_max = 1;
    let events = 400;
    publish_added(&broker, &queue, events).await;
    let handler = AddingHandler {
        work: Duration::from_millis(5),
        ..AddingHandler::default()
    };
    let fail_points = cfg.fail_points.clone();
    let prefetch = u64::from(cfg.prefetch);
    let (stop, consumer, task) = start(&db, cfg, handler);
    // Both lanes hold full windows before one of them fails.
    wait_until(DEADLINE, "both lanes under way", || async {
        consumer.stats().applied >= 2 * prefetch
    })
    .await;
    fail_points.arm(failpoint::CONSUMER_LANE_CHANNEL, Action::Error);
    wait_until(DEADLINE, "every event applied", || async {
        consumer.stats().applied == events as u64
    })
    .await;
    let stats = consumer.stats();
    assert_eq!(stats.lane_restarts, 1, "{stats:?}");
    // The failed lane's window came back (at most its prefetch); the other
    // lane's stayed with it. Closing the connection would return both.
    assert!(
        stats.redelivered >= 1 && stats.redelivered <= prefetch,
        "{} deliveries came back; one lane holds at most {prefetch}: {stats:?}",
        stats.redelivered
    );
    stop.cancel();
    task.await.unwrap().unwrap();
    let applied: Vec<i32> = effects(&db).await.into_iter().map(|e| e.2).collect();
    assert_eq!(applied.len(), events as usize);
    assert!(applied.iter().all(|n| *n == 1), "each applied once");
    assert_eq!(broker.depth(&broker::dead_letter_queue(&queue)).await, 0);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// Lane 0 looks at the queue's and the DLQ's depths every 2 s. A look at a
/// queue that is gone (an operator deleted the DLQ) fails, and the broker
/// closes the channel it ran on: that must not be the consuming channel,
/// whose prefetched deliveries would all go back, each a step toward a
/// dead letter.
#[tokio::test]
async fn a_depth_look_at_a_missing_queue_returns_no_delivery() {
    use lapin::options::QueueDeleteOptions;
    let (db, broker, mut cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    cfg.lanes = 1;
    cfg.prefetch = 50;
    cfg.batch_max = 1;
    let events = 200;
    publish_added(&broker, &queue, events).await;
    let handler = AddingHandler {
        work: Duration::from_millis(20),
        ..AddingHandler::default()
    };
    let (stop, consumer, task) = start(&db, cfg, handler);
    wait_until(DEADLINE, "the lane under way", || async {
        consumer.stats().applied >= 1
    })
    .await;
    let dlq = broker::dead_letter_queue(&queue);
    broker
        .channel
        .queue_delete(dlq.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    wait_until(DEADLINE, "every event applied", || async {
        consumer.stats().applied == events as u64
    })
    .await;
    let stats = consumer.stats();
    assert_eq!(
        (stats.redelivered, stats.lane_restarts),
        (0, 0),
        "the failed looks (one each 2 s over {} s) sent nothing back: {stats:?}",
        events * 20 / 1000
    );
    stop.cancel();
    task.await.unwrap().unwrap();
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// Events `1..=events`, each of an aggregate of its own, published
/// straight to `queue`.
async fn publish_added(broker: &crate::support::Broker, queue: &str, events: i64) {
    for id in 1..=events {
        let event = envelope("svc", id, 1, &format!("agg-{id}"), "Added", 1);
        broker
            .publish_to_queue(queue, &serde_json::to_vec(&event).unwrap())
            .await;
    }
}

/// Takes `n` letters off `dlq`, unacked: they stay the broker's until
/// acked or the channel closes.
async fn take_letters(
    broker: &testkit::Broker,
    dlq: &str,
    n: usize,
) -> Vec<lapin::message::BasicGetMessage> {
    let mut letters = Vec::new();
    while letters.len() < n {
        let got = broker
            .channel
            .basic_get(dlq.into(), Default::default())
            .await
            .unwrap();
        letters.push(got.expect("a letter in the DLQ"));
    }
    letters
}

/// Publishes `letter` back on `queue` without the broker's `x-` history,
/// then acks it in the DLQ: an operator's re-drive, at its simplest.
async fn redrive(broker: &testkit::Broker, queue: &str, letter: lapin::message::BasicGetMessage) {
    let mut kept = lapin::types::FieldTable::default();
    if let Some(headers) = letter.properties.headers() {
        for (k, v) in headers.inner() {
            if !k.as_str().starts_with("x-") {
                kept.insert(k.clone(), v.clone());
            }
        }
    }
    let props = letter.properties.clone().with_headers(kept);
    broker.publish_with(queue, &letter.data, props).await;
    letter.ack(Default::default()).await.unwrap();
}
