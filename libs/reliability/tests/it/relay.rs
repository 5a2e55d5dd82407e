//! I1: every committed outbox row reaches the broker at least once, through
//! crashes, concurrent relays and broker outages.

use std::collections::HashMap;
use std::time::Duration;

use reliability::consumer::{Consumer, ConsumerConfig};
use reliability::failpoint::{self, Action, FailPoints};
use reliability::outbox::{self, NewEvent};
use reliability::relay::{Relay, RelayConfig};
use reliability::testing::{TcpProxy, TestDb, amqp_url, broker_addr, postgres_addr, wait_until};
use reliability::{Error, TenantTx};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::{
    AddingHandler, Broker, DEADLINE, create_effects_table, effects, enqueue_added, tenant,
};

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

#[tokio::test]
async fn a_relay_crash_after_the_confirm_republishes_and_the_consumer_applies_once() {
    let db = TestDb::new().await;
    create_effects_table(&db).await;
    let broker = Broker::new().await;
    let consumer_cfg = ConsumerConfig::new(
        &reliability::testing::unique("reltest.c."),
        &broker.exchange,
        &["svc.*"],
    );
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
async fn two_relays_on_one_table_never_publish_a_row_twice() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    // 1000 rows in one transaction, 25 tenants.
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload)
         SELECT 1 + g % 25, 'test', 'agg-' || g, 'Added', jsonb_build_object('amount', g)
         FROM generate_series(1, 1000) g RETURNING id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();

    let mut cfg = config(&broker);
    cfg.batch_size = 25;
    let r1 = Relay::new(db.relay.clone(), &amqp_url(), cfg.clone());
    let r2 = Relay::new(db.relay.clone(), &amqp_url(), cfg);
    let (p1, p2) = (r1.publisher().await.unwrap(), r2.publisher().await.unwrap());
    // Both drain at once; SKIP LOCKED splits the rows between them. A
    // relay that finds every due row locked stops early, so one more pass
    // each collects whatever the other still held.
    let (a, b) = tokio::join!(async { r1.drain(&p1).await.unwrap() }, async {
        r2.drain(&p2).await.unwrap()
    });
    let (a2, b2) = (r1.drain(&p1).await.unwrap(), r2.drain(&p2).await.unwrap());
    let published = a.published + b.published + a2.published + b2.published;
    assert_eq!(published, 1000);
    assert!(
        a.published > 0 && b.published > 0,
        "both relays did work: {a:?} {b:?}"
    );

    wait_until(DEADLINE, "all published messages routed", || async {
        broker.depth(&queue).await == 1000
    })
    .await;
    let got = broker.take_all(&queue).await;
    let mut seen: Vec<i64> = got.iter().map(|e| e.id).collect();
    seen.sort_unstable();
    let mut expected = ids.clone();
    expected.sort_unstable();
    assert_eq!(seen, expected, "every row exactly once");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

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
        reliability::relay::redrive_dlq(&db.owner, None)
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

/// With several batches in flight on one channel, a return can reach a
/// confirm of another batch: each row's fate must still follow its own id.
#[tokio::test]
async fn a_window_of_batches_in_flight_matches_every_return_to_its_row() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.Routed"]).await;
    let mut cfg = config(&broker);
    cfg.batch_size = 20;
    cfg.batches_in_flight = 3;
    let relay = Relay::new(db.relay.clone(), &amqp_url(), cfg);
    let publisher = relay.publisher().await.unwrap();
    let mut rng = crate::support::Rng::new(11);
    let (mut routed, mut stray) = (Vec::new(), Vec::new());
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    for i in 0..400 {
        let kind = if rng.below(3) == 0 { "Stray" } else { "Routed" };
        let id = outbox::enqueue(
            &mut tx,
            &NewEvent::new("test", format!("w-{i}"), kind, &json!({"amount": 1})).unwrap(),
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
    let report = relay.relay_window(&publisher).await.unwrap();
    assert_eq!(
        (report.claimed, report.published, report.failed),
        (400, routed.len(), stray.len())
    );
    let processed: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox_messages WHERE processed_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert_eq!(processed, routed);
    let mut got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    got.sort_unstable();
    assert_eq!(got, routed);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// Relays with batches in flight share one small pool: none may hold claims
/// while it waits for another connection (each would wait on the others).
#[tokio::test]
async fn relays_with_batches_in_flight_never_wait_on_each_other_for_connections() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    for i in 0..2_000 {
        outbox::enqueue(
            &mut tx,
            &NewEvent::new("test", format!("p-{i}"), "Added", &json!({"amount": 1})).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let pool = db.pool_as(reliability::db::RELAY_ROLE, 3).await;
    let mut cfg = config(&broker);
    cfg.batch_size = 50;
    cfg.batches_in_flight = 3;
    let drains: Vec<_> = (0..4)
        .map(|_| {
            let relay = Relay::new(pool.clone(), &amqp_url(), cfg.clone());
            tokio::spawn(async move {
                let publisher = relay.publisher().await?;
                relay.drain(&publisher).await
            })
        })
        .collect();
    let mut published = 0;
    for d in drains {
        published += tokio::time::timeout(DEADLINE, d)
            .await
            .expect("drained in time")
            .unwrap()
            .unwrap()
            .published;
    }
    assert_eq!(published, 2_000);
    pool.close().await;
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
