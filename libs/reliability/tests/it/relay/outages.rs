//! I1 through failures: unroutable rows, a broker down or blocked, a database that goes away.

use std::time::Duration;

use reliability::TenantTx;
use reliability::outbox::{self, NewEvent};
use reliability::relay::Relay;
use serde_json::json;
use testkit::{TcpProxy, TestDb, amqp_url, broker_addr, postgres_addr, wait_until};

use crate::support::{Broker, DEADLINE, enqueue_added, tenant};

use super::{config, spawn_relay};

#[tokio::test]
async fn unroutable_events_back_off_and_end_in_the_dlq_table_after_ten_attempts() {
    let db = TestDb::new().await;
    let broker = Broker::new().await; // no queue bound: every publish is returned
    let id = enqueue_added(&db, 1, "agg-1", 1).await;

    // With the platform backoff, the first failure makes the row due 30 s later.
    let relay = Relay::new(db.relay.clone(), &amqp_url(), config(&broker));
    let publisher = relay.publisher().await.unwrap();
    let report = relay.relay_batch(&publisher).await.unwrap();
    assert_eq!((report.published, report.failed), (0, 1));
    let (attempts, delay, error): (i32, f64, String) = sqlx::query_as(
        "SELECT attempts, EXTRACT(EPOCH FROM available_at - now())::float8, last_error FROM outbox_messages WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(attempts, 1);
    assert!((25.0..=30.5).contains(&delay), "backoff was {delay} s");
    assert!(error.contains("unroutable"), "{error}");
    assert_eq!(
        relay.relay_batch(&publisher).await.unwrap().claimed,
        0,
        "not due again yet"
    );

    // Without delay, attempts 2..=10 keep it in the outbox and the 11th moves it.
    let mut fast = config(&broker);
    fast.backoff_step = Duration::ZERO;
    let relay = Relay::new(db.relay.clone(), &amqp_url(), fast);
    sqlx::query("UPDATE outbox_messages SET available_at = now()")
        .execute(&db.owner)
        .await
        .unwrap();
    for attempt in 2..=10 {
        let report = relay.relay_batch(&publisher).await.unwrap();
        assert_eq!(
            (report.failed, report.dead_lettered),
            (1, 0),
            "attempt {attempt}"
        );
    }
    let report = relay.relay_batch(&publisher).await.unwrap();
    assert_eq!(report.dead_lettered, 1);
    let (dlq_id, attempts, error): (i64, i32, String) =
        sqlx::query_as("SELECT id, attempts, last_error FROM outbox_messages_dlq")
            .fetch_one(&db.owner)
            .await
            .unwrap();
    assert_eq!((dlq_id, attempts), (id, 11));
    assert!(error.contains("unroutable"));
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    assert_eq!(left, 0);

    // The operator re-drives it once a queue exists: it goes out under its own id.
    let queue = broker.queue(&["svc.*"]).await;
    assert_eq!(
        operator::ops::outbox::redrive_dlq(&db.owner, None)
            .await
            .unwrap(),
        1
    );
    assert_eq!(relay.drain(&publisher).await.unwrap().published, 1);
    let got = broker.take_all(&queue).await;
    assert_eq!(got.iter().map(|e| e.id).collect::<Vec<_>>(), vec![id]);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn rows_stay_pending_while_the_broker_is_down_and_drain_when_it_returns() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let proxy = TcpProxy::start(broker_addr()).await;
    let mut cfg = config(&broker);
    cfg.backoff_step = Duration::from_millis(200);
    cfg.confirm_timeout = Duration::from_secs(2);
    let relay = Relay::new(db.relay.clone(), &proxy.amqp_url(), cfg);
    let (stop, running) = spawn_relay(relay);
    enqueue_added(&db, 1, "before", 1).await;
    wait_until(DEADLINE, "first event published", || async {
        broker.depth(&queue).await == 1
    })
    .await;

    proxy.down();
    for i in 0..20 {
        enqueue_added(&db, 1 + i % 2, &format!("during-{i}"), 1).await;
    }
    let pending = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL",
        )
        .fetch_one(&db.owner)
        .await
        .unwrap()
    };
    assert_eq!(
        pending().await,
        20,
        "nothing is marked while the broker is unreachable"
    );

    proxy.up();
    wait_until(
        DEADLINE,
        "outbox drained after the broker returned",
        || async { pending().await == 0 },
    )
    .await;
    wait_until(DEADLINE, "every event routed", || async {
        broker.depth(&queue).await >= 21
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let mut ids: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 21, "no event lost");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn the_relay_reconnects_after_the_database_goes_away() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let proxy = TcpProxy::start(postgres_addr()).await;
    let relay_pool = db.pool_via(reliability::db::RELAY_ROLE, proxy.addr).await;
    let relay = Relay::new(relay_pool, &amqp_url(), config(&broker));
    let (stop, running) = spawn_relay(relay);
    enqueue_added(&db, 1, "before", 1).await;
    wait_until(DEADLINE, "first event published", || async {
        broker.depth(&queue).await == 1
    })
    .await;

    proxy.down();
    for i in 0..10 {
        enqueue_added(&db, 1, &format!("during-{i}"), 1).await;
    }
    proxy.up();
    wait_until(
        DEADLINE,
        "events committed during the outage published",
        || async { broker.depth(&queue).await >= 11 },
    )
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let mut ids: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 11);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// A `basic.return` reaches whichever confirm lapin resolves next, not the
/// one of the returned message: in a batch that mixes routed and unroutable
/// rows, each row's fate must follow its own message id.
#[tokio::test]
async fn in_a_batch_of_routed_and_unroutable_rows_only_the_unroutable_back_off() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.Routed"]).await;
    let relay = Relay::new(db.relay.clone(), &amqp_url(), config(&broker));
    let publisher = relay.publisher().await.unwrap();
    let mut rng = crate::support::Rng::new(7);
    let (mut routed, mut stray) = (Vec::new(), Vec::new());
    for round in 0..10 {
        let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
        for i in 0..60 {
            let kind = if rng.below(2) == 0 { "Routed" } else { "Stray" };
            let id = outbox::enqueue(
                &mut tx,
                &NewEvent::new("test", format!("r{round}-{i}"), kind, &json!({"amount": 1}))
                    .unwrap(),
            )
            .await
            .unwrap();
            if kind == "Routed" {
                routed.push(id)
            } else {
                stray.push(id)
            }
        }
        tx.commit().await.unwrap();
        let report = relay.relay_batch(&publisher).await.unwrap();
        assert_eq!(report.claimed, 60, "round {round}");
    }
    let processed: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox_messages WHERE processed_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    let backed_off: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox_messages WHERE processed_at IS NULL AND attempts = 1 ORDER BY id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert_eq!(
        processed, routed,
        "every routed row, and only those, marked processed"
    );
    assert_eq!(
        backed_off, stray,
        "every unroutable row, and only those, backed off"
    );
    let mut got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    got.sort_unstable();
    assert_eq!(got, routed);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// A queue that cannot take a message nacks it: a quorum queue that lost
/// its majority, or here a queue held full (`x-max-length` 0 with
/// `reject-publish`). Neither is the message's fault: the nacked rows wait
/// one backoff step with no attempt spent, and rows bound for healthy
/// queues in the same batches are published all the same.
#[tokio::test]
async fn nacked_rows_cost_no_attempt_and_the_other_queues_keep_flowing() {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};

    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let healthy = broker.queue(&["svc.Routed"]).await;
    let full = testkit::unique("reltest.q.full.");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    broker
        .channel
        .queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    broker
        .channel
        .queue_bind(
            full.as_str().into(),
            broker.exchange.as_str().into(),
            "svc.Held".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let relay = Relay::new(db.relay.clone(), &amqp_url(), config(&broker));
    let publisher = relay.publisher().await.unwrap();
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    let (mut routed, mut held) = (Vec::new(), Vec::new());
    for i in 0..40 {
        let kind = if i % 2 == 0 { "Routed" } else { "Held" };
        let id = outbox::enqueue(
            &mut tx,
            &NewEvent::new("test", format!("n{i}"), kind, &json!({"amount": 1})).unwrap(),
        )
        .await
        .unwrap();
        if kind == "Routed" {
            routed.push(id)
        } else {
            held.push(id)
        }
    }
    tx.commit().await.unwrap();

    let report = relay.relay_batch(&publisher).await.unwrap();
    assert_eq!(
        (
            report.published,
            report.deferred,
            report.failed,
            report.unconfirmed
        ),
        (20, 20, 0, 0),
        "{report:?}"
    );
    assert!(publisher.is_usable(), "a nack leaves the channel as it was");
    let waiting: Vec<(i64, i32, f64, String)> = sqlx::query_as(
        "SELECT id, attempts, EXTRACT(EPOCH FROM available_at - now())::float8, last_error
         FROM outbox_messages WHERE processed_at IS NULL ORDER BY id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert_eq!(waiting.iter().map(|w| w.0).collect::<Vec<_>>(), held);
    for (id, attempts, delay, error) in &waiting {
        assert_eq!(*attempts, 0, "row {id}: a nack spent an attempt");
        assert!(
            (25.0..=30.5).contains(delay),
            "row {id}: due again in {delay} s"
        );
        assert!(error.contains("nacked"), "{error}");
    }
    let mut got: Vec<i64> = broker
        .take_all(&healthy)
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    got.sort_unstable();
    assert_eq!(got, routed);
    broker.cleanup(&[&healthy, &full]).await;
    db.cleanup().await;
}

/// A broker that blocks publishers (a memory or disk alarm) keeps the
/// connection and stops answering. Confirm timeouts must cost no attempts,
/// or a long alarm would move the whole backlog into the DLQ table.
#[tokio::test]
async fn a_blocked_broker_costs_no_attempts_and_the_backlog_drains_after() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let proxy = TcpProxy::start(broker_addr()).await;
    let mut cfg = config(&broker);
    cfg.backoff_step = Duration::ZERO;
    cfg.max_attempts = 2;
    cfg.confirm_timeout = Duration::from_millis(300);
    let relay = Relay::new(db.relay.clone(), &proxy.amqp_url(), cfg);
    let publisher = relay.publisher().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..30 {
        ids.push(enqueue_added(&db, 1, &format!("agg-{i}"), 1).await);
    }
    proxy.freeze();
    // Many more confirm timeouts than max_attempts allows failures.
    for round in 0..5 {
        let report = relay.relay_batch(&publisher).await.unwrap();
        assert_eq!(
            (
                report.claimed,
                report.published,
                report.failed,
                report.unconfirmed
            ),
            (30, 0, 0, 30),
            "round {round}"
        );
    }
    let (pending, attempts, dlq): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL),
                (SELECT coalesce(sum(attempts), 0)::bigint FROM outbox_messages),
                (SELECT count(*) FROM outbox_messages_dlq)",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(
        (pending, attempts, dlq),
        (30, 0, 0),
        "nothing counted, nothing parked"
    );

    proxy.thaw();
    let fresh = relay.publisher().await.unwrap();
    relay.drain(&fresh).await.unwrap();
    wait_until(DEADLINE, "every event routed", || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
                .fetch_one(&db.owner)
                .await
                .unwrap();
        n == 0
    })
    .await;
    let mut got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    got.sort_unstable();
    got.dedup();
    assert_eq!(got, ids, "every event published once the broker answered");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}
