//! The log relay against a real PostgreSQL (`wal_level = logical`) and
//! RabbitMQ: commits published in commit order and the slot confirmed past
//! them; two relays on one slot, one reading, the other taking over when
//! it stops; a slot left unread; a failed batch read again. Where the
//! server's `wal_level` is not `logical` these say so and pass, except
//! under `LOG_RELAY_TESTS=required` (CI), where they fail.

use std::time::Duration;

use log_relay::{LogRelay, LogRelayConfig, slot_status};
use reliability::TenantTx;
use reliability::broker::QueueSpec;
use reliability::failpoint::{self, Action, FailPoints};
use reliability::health::Health;
use reliability::outbox::{self, NewEvent};
use reliability::relay::{Relay, RelayConfig};
use serde_json::json;
use testkit::{Broker, DEADLINE, TestDb, amqp_url, tenant, unique, wait_until};
use tokio_util::sync::CancellationToken;

/// A test's database, broker queue and slot name.
struct Setup {
    db: TestDb,
    broker: Broker,
    queue: String,
    slot: String,
}

type Running = (CancellationToken, tokio::task::JoinHandle<()>);

impl Setup {
    /// `None` (and nothing left behind) where the server cannot decode
    /// its WAL logically.
    async fn new() -> Option<Self> {
        let db = TestDb::new().await;
        if !testkit::logical_decoding(&db.admin).await {
            db.cleanup().await;
            return None;
        }
        let broker = Broker::new().await;
        let queue = broker.queue(&["svc.*"]).await;
        let slot = unique("reltest_slot_").replace('.', "_");
        Some(Self {
            db,
            broker,
            queue,
            slot,
        })
    }

    /// A log relay on the slot, running until its token is cancelled.
    fn spawn(&self, points: FailPoints) -> Running {
        self.spawn_as(points, &self.db.url(), Health::default())
    }

    /// A log relay reading as `url`, reporting to `health`.
    fn spawn_as(&self, points: FailPoints, url: &str, health: Health) -> Running {
        let mut config = RelayConfig::new("svc", &self.broker.exchange);
        config.fail_points = points;
        self.start(config, url, health)
    }

    fn start(&self, config: RelayConfig, url: &str, health: Health) -> Running {
        let relay = Relay::new(self.db.relay.clone(), &amqp_url(), config);
        let mut config = LogRelayConfig::new(url);
        config.slot = self.slot.clone();
        config.standby_retry = Duration::from_millis(200);
        let relay = LogRelay::new(relay, config).with_health(health);
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move { relay.run(stop).await }
        });
        (stop, task)
    }

    async fn read_by_a_relay(&self, read: bool) {
        wait_until(DEADLINE, "the slot read, or let go", || async {
            slot_status(&self.db.admin, &self.slot)
                .await
                .unwrap()
                .is_some_and(|s| s.active == read)
        })
        .await;
    }

    /// Commits one transaction of `n` events of aggregate `agg`; their ids.
    async fn commit(&self, agg: &str, n: i64) -> Vec<i64> {
        let mut tx = TenantTx::begin(&self.db.app, tenant(1)).await.unwrap();
        let mut ids = Vec::new();
        for i in 0..n {
            let event = NewEvent::new("test", agg, "Added", &json!({"amount": i})).unwrap();
            ids.push(outbox::enqueue(&mut tx, &event).await.unwrap());
        }
        tx.commit().await.unwrap();
        ids
    }

    /// Where the server's WAL ends now: a commit after this ends past it.
    async fn wal_end(&self) -> String {
        sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
            .fetch_one(&self.db.admin)
            .await
            .unwrap()
    }

    async fn pending(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
            .fetch_one(&self.db.owner)
            .await
            .unwrap()
    }

    /// Waits until `n` messages are on the queue and no row is pending.
    async fn published(&self, n: u32) {
        wait_until(DEADLINE, "published and marked", || async {
            self.broker.depth(&self.queue).await == n && self.pending().await == 0
        })
        .await;
    }

    /// The ids of the messages on the queue, taken off it, in order.
    async fn taken(&self) -> Vec<i64> {
        let got = self.broker.take_all(&self.queue).await;
        got.iter().map(|e| e.id).collect()
    }

    /// Waits until a reader confirmed the slot past `lsn`.
    async fn confirmed_past(&self, lsn: &str) {
        wait_until(DEADLINE, "the slot confirmed past the commits", || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT active AND confirmed_flush_lsn > $2::pg_lsn FROM pg_replication_slots
                 WHERE slot_name = $1",
            )
            .bind(&self.slot)
            .bind(lsn)
            .fetch_one(&self.db.admin)
            .await
            .unwrap()
        })
        .await;
    }

    async fn cleanup(self, running: Running) {
        let (stop, task) = running;
        stop.cancel();
        task.await.unwrap();
        self.broker.cleanup(&[&self.queue]).await;
        self.db.cleanup().await;
    }
}

#[tokio::test]
async fn commits_are_published_in_commit_order_and_the_slot_confirmed_past_them() {
    let Some(t) = Setup::new().await else { return };
    let running = t.spawn(FailPoints::none());
    t.read_by_a_relay(true).await;

    let mut ids = t.commit("agg-1", 3).await;
    ids.extend(t.commit("agg-2", 1).await);
    let before = t.wal_end().await;
    ids.extend(t.commit("agg-1", 2).await);
    t.published(6).await;
    assert_eq!(t.taken().await, ids, "in commit order, each once");
    t.confirmed_past(&before).await;
    t.cleanup(running).await;
}

/// PostgreSQL lets one relay read the slot; the other waits and takes
/// over when the first stops, from the slot's confirmed position: what
/// the first published is not published again.
#[tokio::test]
async fn a_second_relay_waits_for_the_slot_and_takes_over_when_the_first_stops() {
    let Some(t) = Setup::new().await else { return };
    let (stop_a, task_a) = t.spawn(FailPoints::none());
    t.read_by_a_relay(true).await;
    let second = t.spawn(FailPoints::none());
    let first = t.commit("agg-1", 2).await;
    t.published(2).await;

    stop_a.cancel();
    task_a.await.unwrap();
    let then = t.commit("agg-1", 2).await;
    t.published(4).await;
    assert_eq!(
        t.taken().await,
        [first, then].concat(),
        "each once, in order"
    );
    t.cleanup(second).await;
}

/// A slot left unread (its relays gone) keeps WAL: its gauges say so,
/// which is what the alerts `LogRelaySlotUnread` and
/// `LogRelaySlotRetainsWal` read; the runbook's step, a relay reading it
/// again, publishes what waited and clears them.
#[tokio::test]
async fn a_slot_left_unread_shows_in_its_gauges_and_a_relay_reading_it_again_clears_them() {
    let metrics = reliability::metrics::install();
    let Some(t) = Setup::new().await else { return };
    let gauge = |value: &str| format!("{}{{slot=\"{}\"}} {value}", log_relay::ACTIVE, t.slot);
    let (stop, task) = t.spawn(FailPoints::none());
    t.read_by_a_relay(true).await;
    stop.cancel();
    task.await.unwrap();
    t.read_by_a_relay(false).await;

    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.extend(t.commit("agg-1", 10).await);
    }
    let before = t.wal_end().await;
    ids.extend(t.commit("agg-1", 10).await);
    wait_until(DEADLINE, "the slot unread, its lag growing", || async {
        slot_status(&t.db.admin, &t.slot)
            .await
            .unwrap()
            .is_some_and(|s| !s.active && s.lag_bytes.unwrap_or(0) > 0)
    })
    .await;
    assert!(metrics.render().contains(&gauge("0")));
    assert_eq!(t.pending().await, 50, "nothing published meanwhile");

    // The runbook's step: a relay reads the slot again.
    let running = t.spawn(FailPoints::none());
    t.published(50).await;
    t.confirmed_past(&before).await;
    slot_status(&t.db.admin, &t.slot).await.unwrap();
    assert!(metrics.render().contains(&gauge("1")));
    assert_eq!(t.taken().await, ids);
    t.cleanup(running).await;
}

/// A batch that fails ends the reading, and the relay reads again from the
/// slot's confirmed position: what failed is published then, and the
/// caller's token (the process's shutdown) is left alone.
#[tokio::test]
async fn a_failed_batch_is_read_again_from_the_slot_and_stops_nothing_else() {
    let Some(t) = Setup::new().await else { return };
    let points = FailPoints::none();
    let running = t.spawn(points.clone());
    t.read_by_a_relay(true).await;
    points.arm(failpoint::RELAY_BEFORE_PUBLISH, Action::Error);
    let ids = t.commit("agg-1", 3).await;
    t.published(3).await;
    assert!(!points.any_armed(), "the batch failed once");
    assert!(!running.0.is_cancelled(), "the process's token is its own");
    assert!(!running.1.is_finished(), "the relay reads on");
    assert_eq!(t.taken().await, ids);
    t.cleanup(running).await;
}

/// PostgreSQL makes a new logical slot wait for every transaction running
/// on the server, and one of them may be on the relay's own thread (a
/// current-thread runtime, as every in-process stack test runs). That
/// transaction must still end. Fails without `ensure_slot`: the stream's
/// blocking creation froze the thread until the server ended the
/// transaction at its idle timeout.
#[tokio::test]
async fn a_new_slot_waits_for_a_transaction_on_the_relays_own_thread_and_does_not_freeze_it() {
    let Some(t) = Setup::new().await else { return };
    let mut open = t.db.owner.begin().await.unwrap();
    sqlx::query("SET LOCAL idle_in_transaction_session_timeout = '10s'")
        .execute(&mut *open)
        .await
        .unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *open)
        .await
        .unwrap();
    let running = t.spawn(FailPoints::none());
    wait_until(DEADLINE, "the slot being made", || async {
        slot_status(&t.db.admin, &t.slot).await.unwrap().is_some()
    })
    .await;
    open.commit()
        .await
        .expect("the transaction ends: the relay did not freeze its thread");
    t.read_by_a_relay(true).await;
    let ids = t.commit("agg-1", 2).await;
    t.published(2).await;
    assert_eq!(t.taken().await, ids);
    t.cleanup(running).await;
}

/// `/readyz`: a relay reading the slot is ready, and so is one waiting
/// behind it (a standby, not a fault); one that cannot read, here a role
/// without REPLICATION, is not, and says why.
#[tokio::test]
async fn readiness_counts_a_standby_as_ready_and_names_why_a_relay_cannot_read() {
    let Some(t) = Setup::new().await else { return };
    let part = |health: &Health| {
        let (_, parts) = health.report();
        parts
            .get(log_relay::HEALTH_PART)
            .cloned()
            .unwrap_or_default()
    };
    let (reader, standby, refused) = (Health::default(), Health::default(), Health::default());
    let first = t.spawn_as(FailPoints::none(), &t.db.url(), reader.clone());
    t.read_by_a_relay(true).await;
    let second = t.spawn_as(FailPoints::none(), &t.db.url(), standby.clone());
    let url = t.db.url();
    let (scheme, rest) = url.split_once("://").unwrap();
    let server = rest.split_once('@').map_or(rest, |(_, server)| server);
    let third = t.spawn_as(
        FailPoints::none(),
        &format!("{scheme}://commerce_app@{server}"),
        refused.clone(),
    );
    wait_until(
        DEADLINE,
        "the standby and the refused relay tried",
        || async {
            let refused = part(&refused);
            part(&standby) == "ok" && refused.is_string() && refused != "starting"
        },
    )
    .await;
    assert!(reader.report().0, "{:?}", reader.report());
    assert!(!refused.report().0);
    let why = part(&refused).to_string();
    assert!(why.contains("replication"), "{why}");
    for (stop, task) in [second, third] {
        stop.cancel();
        task.await.unwrap();
    }
    t.cleanup(first).await;
}

/// Where an ordered subscription binds, the relay's window holds back a
/// row whose aggregate an earlier batch has in flight. The log relay
/// passes over its rows again, and publishes those too, without the sweep
/// (none runs here). Fails without the passes: the held rows stay pending.
#[tokio::test]
async fn an_aggregate_across_the_windows_batches_is_published_whole_and_numbered_in_order() {
    let Some(t) = Setup::new().await else { return };
    let mut spec = QueueSpec::new(&unique("reltest.ord."), &t.broker.exchange, &["svc.*"]);
    spec.partitions = 1;
    let mut config = RelayConfig::new("svc", &t.broker.exchange);
    config.topology = vec![spec.clone()];
    config.batch_size = 2;
    let running = t.start(config, &t.db.url(), Health::default());
    t.read_by_a_relay(true).await;

    let ids = t.commit("agg-1", 7).await;
    t.published(7).await;
    let got = t.broker.take_all(&t.queue).await;
    let seqs: Vec<_> = got.iter().map(|e| e.aggregate_seq).collect();
    assert_eq!(got.iter().map(|e| e.id).collect::<Vec<_>>(), ids);
    assert_eq!(
        seqs,
        (1..=7).map(Some).collect::<Vec<_>>(),
        "numbered in order"
    );
    t.broker.delete_ordered(&spec).await;
    t.cleanup(running).await;
}
