//! I2 and I8: a consumer applies each event once whatever the delivery
//! count or order, and poison ends in its DLQ where an operator can re-drive it.

use std::sync::Arc;
use std::time::Duration;

use reliability::Error;
use reliability::broker;
use reliability::consumer::{Consumer, ConsumerConfig, ConsumerStats, Handler, Pg};
use reliability::failpoint::{self, Action};
use testkit::{TestDb, amqp_url, unique, wait_until};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::support::{
    AddingHandler, Broker, DEADLINE, Rng, create_effects_table, effects, envelope,
};

mod failures;
mod gather;
mod lost_link;

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

type Running<H = AddingHandler> = (
    CancellationToken,
    Arc<Consumer<Pg<H>>>,
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

fn start<H: Handler>(db: &TestDb, cfg: ConsumerConfig, handler: H) -> Running<H> {
    let consumer = Arc::new(Consumer::new(db.app.clone(), &amqp_url(), cfg, handler));
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (stop, consumer) = (stop.clone(), consumer.clone());
        async move { consumer.run(stop).await }
    });
    (stop, consumer, task)
}

/// Takes `n` messages from `queue` unacked and closes their channel: the
/// broker hands each back, counting a return.
async fn hand_back(broker: &Broker, queue: &str, n: usize) {
    use lapin::options::BasicGetOptions;
    let ch = broker.conn.create_channel().await.unwrap();
    for _ in 0..n {
        let got = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap();
        assert!(got.is_some(), "the message was there");
    }
    ch.close(200, "handed back".into()).await.unwrap();
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
    let counted: (i64, i64) = sqlx::query_as(
        "SELECT sum(applied_count)::bigint, sum(duplicate_count)::bigint FROM consumer_offsets",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(counted, (1, 1), "the absorbed duplicate is counted");
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
    // RabbitMQ 4 moves a rejected message to the DLQ after the reject
    // returns (its quorum queues dead-letter at least once, ADR 0031).
    let dlq = broker::dead_letter_queue(&queue);
    wait_until(DEADLINE, "both dead letters in the DLQ", || async {
        broker.depth(&dlq).await == 2
    })
    .await;
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}
