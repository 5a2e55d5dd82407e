//! The log relay against a real PostgreSQL (`wal_level = logical`) and
//! RabbitMQ: commits published in commit order and the slot confirmed past
//! them; two relays on one slot, one reading, the other taking over when
//! it stops. Where the server's `wal_level` is not `logical` these say so
//! and pass, except under `LOG_RELAY_TESTS=required` (CI), where they
//! fail.

use std::time::Duration;

use log_relay::{LogRelay, LogRelayConfig, slot_status};
use reliability::TenantTx;
use reliability::failpoint::{self, Action, FailPoints};
use reliability::outbox::{self, NewEvent};
use reliability::relay::{Relay, RelayConfig};
use serde_json::json;
use testkit::{Broker, DEADLINE, TestDb, amqp_url, database_url, tenant, unique, wait_until};
use tokio_util::sync::CancellationToken;

async fn logical(db: &TestDb) -> bool {
    let level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&db.admin)
        .await
        .unwrap();
    if level == "logical" {
        return true;
    }
    assert!(
        std::env::var("LOG_RELAY_TESTS").as_deref() != Ok("required"),
        "wal_level is {level}: CI sets it to logical (.ci/run)"
    );
    eprintln!("skipped: wal_level is {level}, not logical");
    false
}

/// The superuser on the test's database: a role with REPLICATION.
fn replication_url(db: &TestDb) -> String {
    let url = database_url();
    let (server, _) = url.rsplit_once('/').expect("a database in DATABASE_URL");
    format!("{server}/{}", db.name)
}

/// Commits one transaction of `n` events of aggregate `agg`; their ids.
async fn commit(db: &TestDb, agg: &str, n: i64) -> Vec<i64> {
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let event = NewEvent::new("test", agg, "Added", &json!({"amount": i})).unwrap();
        ids.push(outbox::enqueue(&mut tx, &event).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

fn relay(db: &TestDb, broker: &Broker, slot: &str) -> LogRelay {
    relay_with(db, broker, slot, FailPoints::none())
}

fn relay_with(db: &TestDb, broker: &Broker, slot: &str, points: FailPoints) -> LogRelay {
    let mut config = RelayConfig::new("svc", &broker.exchange);
    config.fail_points = points;
    let relay = Relay::new(db.relay.clone(), &amqp_url(), config);
    let mut config = LogRelayConfig::new(&replication_url(db));
    config.slot = slot.to_owned();
    config.standby_retry = Duration::from_millis(200);
    LogRelay::new(relay, config)
}

fn spawn(relay: LogRelay) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    (stop, task)
}

async fn pending(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
        .fetch_one(&db.owner)
        .await
        .unwrap()
}

#[tokio::test]
async fn commits_are_published_in_commit_order_and_the_slot_confirmed_past_them() {
    let db = TestDb::new().await;
    if !logical(&db).await {
        return db.cleanup().await;
    }
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let slot = unique("reltest_slot_").replace('.', "_");
    let (stop, task) = spawn(relay(&db, &broker, &slot));
    wait_until(DEADLINE, "the relay holds the slot", || async {
        slot_status(&db.admin, &slot)
            .await
            .unwrap()
            .is_some_and(|s| s.active)
    })
    .await;

    let mut ids = commit(&db, "agg-1", 3).await;
    ids.extend(commit(&db, "agg-2", 1).await);
    // The last commit ends past this.
    let before: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&db.admin)
        .await
        .unwrap();
    ids.extend(commit(&db, "agg-1", 2).await);
    wait_until(DEADLINE, "every commit published and marked", || async {
        broker.depth(&queue).await == 6 && pending(&db).await == 0
    })
    .await;
    let got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    assert_eq!(got, ids, "in commit order, each once");
    wait_until(DEADLINE, "the slot confirmed past the last commit", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT confirmed_flush_lsn > $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&slot)
        .bind(&before)
        .fetch_one(&db.admin)
        .await
        .unwrap()
    })
    .await;
    let status = slot_status(&db.admin, &slot).await.unwrap().unwrap();
    assert!(status.lag_bytes.unwrap_or(0) >= 0, "{status:?}");
    stop.cancel();
    task.await.unwrap();
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// PostgreSQL lets one relay read the slot; the other waits and takes
/// over when the first stops, from the slot's confirmed position: what
/// the first published is not published again.
#[tokio::test]
async fn a_second_relay_waits_for_the_slot_and_takes_over_when_the_first_stops() {
    let db = TestDb::new().await;
    if !logical(&db).await {
        return db.cleanup().await;
    }
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let slot = unique("reltest_slot_").replace('.', "_");
    let (stop_a, task_a) = spawn(relay(&db, &broker, &slot));
    wait_until(DEADLINE, "the first relay holds the slot", || async {
        slot_status(&db.admin, &slot)
            .await
            .unwrap()
            .is_some_and(|s| s.active)
    })
    .await;
    let (stop_b, task_b) = spawn(relay(&db, &broker, &slot));
    let first = commit(&db, "agg-1", 2).await;
    wait_until(DEADLINE, "the first commit published", || async {
        broker.depth(&queue).await == 2 && pending(&db).await == 0
    })
    .await;

    stop_a.cancel();
    task_a.await.unwrap();
    let second = commit(&db, "agg-1", 2).await;
    wait_until(DEADLINE, "the second relay took over", || async {
        broker.depth(&queue).await == 4 && pending(&db).await == 0
    })
    .await;
    let got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    assert_eq!(got, [first, second].concat(), "each once, in order");
    stop_b.cancel();
    task_b.await.unwrap();
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// A slot left unread (its relays gone) keeps WAL: its gauges say so,
/// which is what the alerts `LogRelaySlotUnread` and
/// `LogRelaySlotRetainsWal` read; the runbook's step, a relay reading it
/// again, publishes what waited and clears them.
#[tokio::test]
async fn a_slot_left_unread_shows_in_its_gauges_and_a_relay_reading_it_again_clears_them() {
    let metrics = reliability::metrics::install();
    let db = TestDb::new().await;
    if !logical(&db).await {
        return db.cleanup().await;
    }
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let slot = unique("reltest_slot_").replace('.', "_");
    let gauge = |name: &str, value: &str| format!("{name}{{slot=\"{slot}\"}} {value}");
    let (stop, task) = spawn(relay(&db, &broker, &slot));
    wait_until(DEADLINE, "the relay holds the slot", || async {
        slot_status(&db.admin, &slot)
            .await
            .unwrap()
            .is_some_and(|s| s.active)
    })
    .await;
    stop.cancel();
    task.await.unwrap();

    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.extend(commit(&db, "agg-1", 10).await);
    }
    // The last commit ends past this.
    let before: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&db.admin)
        .await
        .unwrap();
    ids.extend(commit(&db, "agg-1", 10).await);
    wait_until(DEADLINE, "the slot unread, its lag growing", || async {
        slot_status(&db.admin, &slot)
            .await
            .unwrap()
            .is_some_and(|s| !s.active && s.lag_bytes.unwrap_or(0) > 0)
    })
    .await;
    assert!(metrics.render().contains(&gauge(log_relay::ACTIVE, "0")));
    assert_eq!(pending(&db).await, 50, "nothing published meanwhile");

    // The runbook's step: a relay reads the slot again.
    let (stop, task) = spawn(relay(&db, &broker, &slot));
    wait_until(DEADLINE, "what waited published, each once", || async {
        broker.depth(&queue).await == 50 && pending(&db).await == 0
    })
    .await;
    wait_until(
        DEADLINE,
        "the slot read and confirmed past what waited",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT active AND confirmed_flush_lsn > $2::pg_lsn FROM pg_replication_slots
             WHERE slot_name = $1",
            )
            .bind(&slot)
            .bind(&before)
            .fetch_one(&db.admin)
            .await
            .unwrap()
        },
    )
    .await;
    slot_status(&db.admin, &slot).await.unwrap();
    assert!(metrics.render().contains(&gauge(log_relay::ACTIVE, "1")));
    let got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    assert_eq!(got, ids);
    stop.cancel();
    task.await.unwrap();
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// A batch that fails ends the reading, and the relay reads again from the
/// slot's confirmed position: what failed is published then, and the
/// caller's token (the process's shutdown) is left alone.
#[tokio::test]
async fn a_failed_batch_is_read_again_from_the_slot_and_stops_nothing_else() {
    let db = TestDb::new().await;
    if !logical(&db).await {
        return db.cleanup().await;
    }
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let slot = unique("reltest_slot_").replace('.', "_");
    let points = FailPoints::none();
    let (stop, task) = spawn(relay_with(&db, &broker, &slot, points.clone()));
    wait_until(DEADLINE, "the relay holds the slot", || async {
        slot_status(&db.admin, &slot)
            .await
            .unwrap()
            .is_some_and(|s| s.active)
    })
    .await;
    points.arm(failpoint::RELAY_BEFORE_PUBLISH, Action::Error);
    let ids = commit(&db, "agg-1", 3).await;
    wait_until(DEADLINE, "published after the failed batch", || async {
        broker.depth(&queue).await == 3 && pending(&db).await == 0
    })
    .await;
    assert!(!points.any_armed(), "the batch failed once");
    assert!(!stop.is_cancelled(), "the process's token is its own");
    assert!(!task.is_finished(), "the relay reads on");
    let got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    assert_eq!(got, ids);
    stop.cancel();
    task.await.unwrap();
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}
