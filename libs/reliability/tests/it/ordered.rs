//! Order per aggregate (docs/adr/0028): an ordered subscription's handler
//! sees each aggregate's events in outbox order, with relays and replicas
//! side by side, a crash mid-group and duplicates; a poison event parks
//! its aggregate alone, and an unpark replays it in order.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reliability::broker::QueueSpec;
use reliability::consumer::{self, Consumer, ConsumerConfig, Handler, HandlerError, Pg};
use reliability::failpoint::{self, Action};
use reliability::outbox::{self, Envelope, NewEvent};
use reliability::relay::{Relay, RelayConfig};
use reliability::{TenantTx, broker};
use serde_json::json;
use testkit::{TestDb, amqp_url, unique, wait_until};
use tokio_util::sync::CancellationToken;

use crate::support::{Broker, Rng, tenant};

mod gaps;
mod handover;
mod lock_waits;
mod operations;
mod parking;
mod plan;

const LONG: Duration = Duration::from_secs(90);

/// Records every event it applies, in the order applied: one aggregate's
/// applies take turns under its lock, so the serial is their order. Fails
/// for good on the events named in `poison`, and for now (retried) on
/// those in `stuck`.
#[derive(Clone, Default)]
struct Recording {
    poison: Arc<Mutex<HashSet<(String, i64)>>>,
    stuck: Arc<Mutex<HashSet<(String, i64)>>>,
    /// Which replica applied it, for the failure's account.
    replica: i32,
}

impl Handler for Recording {
    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        let seq = e.aggregate_seq.unwrap_or(0);
        let this = (e.aggregate_id.clone(), seq);
        if self.poison.lock().unwrap().contains(&this) {
            return Err(HandlerError::Permanent("poison".into()));
        }
        if self.stuck.lock().unwrap().contains(&this) {
            return Err(HandlerError::Transient("stuck".into()));
        }
        sqlx::query(
            "INSERT INTO test_applied (tenant_id, aggregate_id, seq, message_id, replica) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(tx.tenant().get())
        .bind(&e.aggregate_id)
        .bind(seq)
        .bind(e.id)
        .bind(self.replica)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

async fn create_applied_table(db: &TestDb) {
    sqlx::raw_sql(
        "CREATE TABLE test_applied (
             n bigint GENERATED ALWAYS AS IDENTITY,
             tenant_id bigint NOT NULL,
             aggregate_id text NOT NULL,
             seq bigint NOT NULL,
             message_id bigint NOT NULL UNIQUE,
             replica int NOT NULL,
             at timestamptz NOT NULL DEFAULT clock_timestamp());
         ALTER TABLE test_applied ENABLE ROW LEVEL SECURITY;
         ALTER TABLE test_applied FORCE ROW LEVEL SECURITY;
         CREATE POLICY tenant_isolation ON test_applied
             USING (tenant_id = (SELECT app_current_tenant()))
             WITH CHECK (tenant_id = (SELECT app_current_tenant()));
         GRANT SELECT, INSERT ON test_applied TO commerce_app;",
    )
    .execute(&db.owner)
    .await
    .unwrap();
}

/// (tenant, aggregate) -> outbox ids, in the order the handler applied them.
async fn applied(db: &TestDb) -> BTreeMap<(i64, String), Vec<i64>> {
    let rows: Vec<(i64, String, i64)> =
        sqlx::query_as("SELECT tenant_id, aggregate_id, message_id FROM test_applied ORDER BY n")
            .fetch_all(&db.owner)
            .await
            .unwrap();
    let mut out: BTreeMap<(i64, String), Vec<i64>> = BTreeMap::new();
    for (t, a, id) in rows {
        out.entry((t, a)).or_default().push(id);
    }
    out
}

/// (tenant, aggregate) -> outbox ids in outbox order: the numbers the
/// relays gave (the order of the commits; id order where the writers of an
/// aggregate take turns), or with ordering off, the ids.
async fn written(db: &TestDb) -> BTreeMap<(i64, String), Vec<i64>> {
    let rows: Vec<(i64, String, i64, Option<i64>)> = sqlx::query_as(
        "SELECT tenant_id, aggregate_id, id, aggregate_seq FROM outbox_messages
         ORDER BY tenant_id, aggregate_id, aggregate_seq, id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    let mut out: BTreeMap<(i64, String), Vec<i64>> = BTreeMap::new();
    for (t, a, id, _) in rows {
        out.entry((t, a)).or_default().push(id);
    }
    out
}

fn spec(broker: &Broker, partitions: u16) -> QueueSpec {
    let mut spec = QueueSpec::new(&unique("reltest.ord."), &broker.exchange, &["svc.*"]);
    spec.partitions = partitions;
    spec
}

fn consumer_config(spec: &QueueSpec) -> ConsumerConfig {
    let mut cfg = ConsumerConfig::new(&spec.queue, &spec.exchange, &["svc.*"]);
    cfg.queue = spec.clone();
    cfg.lanes = 2;
    cfg.prefetch = 16;
    cfg.batch_max = 8;
    cfg.max_attempts = 2;
    cfg.retry_delay = Duration::from_millis(10);
    cfg
}

/// The gate alone: a database with the applied table, and an ordered
/// consumer of 2 partitions, applied by hand with no broker traffic.
async fn gate(prefix: &str) -> (TestDb, Consumer<Pg<Recording>>, ConsumerConfig) {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let mut spec = QueueSpec::new(&unique(prefix), "x", &["svc.*"]);
    spec.partitions = 2;
    let cfg = consumer_config(&spec);
    let consumer = Consumer::new(
        db.app.clone(),
        &amqp_url(),
        cfg.clone(),
        Recording::default(),
    );
    (db, consumer, cfg)
}

/// Event `id` of aggregate `test:<aggregate>`, tenant 1, numbered `seq`
/// (`None`: as a relay that does not number sends it).
fn numbered(id: i64, aggregate: &str, seq: Option<i64>) -> Envelope {
    let mut e = crate::support::envelope("svc", id, 1, aggregate, "Changed", 0);
    e.aggregate_seq = seq;
    e
}

fn relay(db: &TestDb, broker: &Broker, spec: &QueueSpec) -> Relay {
    let mut cfg = RelayConfig::new("svc", &broker.exchange);
    cfg.topology = vec![spec.clone()];
    cfg.batch_size = 7;
    cfg.batches_in_flight = 3;
    cfg.poll_interval = Duration::from_millis(50);
    Relay::new(db.relay.clone(), &amqp_url(), cfg)
}

type Task = tokio::task::JoinHandle<reliability::Result<()>>;

fn run_consumer(
    db: &TestDb,
    cfg: ConsumerConfig,
    handler: Recording,
    stop: &CancellationToken,
) -> (Arc<Consumer<Pg<Recording>>>, Task) {
    let consumer = Arc::new(Consumer::new(db.app.clone(), &amqp_url(), cfg, handler));
    let task = tokio::spawn({
        let (consumer, stop) = (consumer.clone(), stop.clone());
        async move { consumer.run(stop).await }
    });
    (consumer, task)
}

fn spawn_relay(db: &TestDb, broker: &Broker, spec: &QueueSpec, stop: &CancellationToken) -> Task {
    let (relay, stop) = (relay(db, broker, spec), stop.clone());
    tokio::spawn(async move { relay.run(stop).await })
}

/// Commits one event of `aggregate` in a transaction of its own.
async fn write_one(db: &TestDb, tenant_id: i64, aggregate: &str) {
    let mut tx = TenantTx::begin(&db.app, tenant(tenant_id)).await.unwrap();
    outbox::enqueue(
        &mut tx,
        &NewEvent::new("test", aggregate, "Changed", &json!({})).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// Business transactions writing events of a few aggregates each, side by
/// side, some waiting inside their transaction: commits land out of id
/// order, and two writers of one aggregate take turns.
async fn write_concurrently(db: &TestDb, writers: usize, txs_each: usize) {
    let mut tasks = Vec::new();
    for w in 0..writers {
        let app = db.app.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(7 + w as u64);
            for _ in 0..txs_each {
                let t = 1 + rng.below(2) as i64;
                let mut tx = TenantTx::begin(&app, tenant(t)).await.unwrap();
                for _ in 0..1 + rng.below(3) {
                    let aggregate = format!("a{}", rng.below(12));
                    outbox::enqueue(
                        &mut tx,
                        &NewEvent::new("test", aggregate, "Changed", &json!({})).unwrap(),
                    )
                    .await
                    .unwrap();
                }
                if rng.below(3) == 0 {
                    // Not a wait for anything: a transaction held open a
                    // while, so that later ids commit before it.
                    tokio::time::sleep(Duration::from_millis(rng.below(15) as u64)).await;
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Waits until every outbox row is applied (or parked), then checks that
/// nothing is parked and that each aggregate was applied in outbox order.
async fn all_applied_in_outbox_order(db: &TestDb) {
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    wait_until(LONG, "every event applied or parked", || async {
        let done: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM test_applied) + (SELECT count(*) FROM parked_events)",
        )
        .fetch_one(&db.owner)
        .await
        .unwrap();
        done == total
    })
    .await;
    let parked = consumer::parked(&db.owner, None).await.unwrap();
    if !parked.is_empty() {
        for p in &parked {
            eprintln!("{}", account(db, p.tenant_id, &p.aggregate_id).await);
        }
        panic!("nothing parked: {parked:?}");
    }
    let (applied, written) = (applied(db).await, written(db).await);
    assert_eq!(
        applied.keys().collect::<Vec<_>>(),
        written.keys().collect::<Vec<_>>()
    );
    for (aggregate, ids) in &written {
        assert_eq!(
            &applied[aggregate], ids,
            "{aggregate:?} applied in outbox order"
        );
    }
}

/// What happened to one aggregate: its outbox rows, its applies (which
/// replica, when) and its parked events, for a failure's message.
async fn account(db: &TestDb, tenant_id: i64, aggregate: &str) -> String {
    let outbox: Vec<(i64, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT id, aggregate_seq, to_char(processed_at, 'HH24:MI:SS.US') FROM outbox_messages
         WHERE tenant_id = $1 AND aggregate_id = $2 ORDER BY aggregate_seq, id",
    )
    .bind(tenant_id)
    .bind(aggregate)
    .fetch_all(&db.owner)
    .await
    .unwrap();
    let applied: Vec<(i64, i64, i64, i32, String)> = sqlx::query_as(
        "SELECT n, seq, message_id, replica, to_char(at, 'HH24:MI:SS.US') FROM test_applied
         WHERE tenant_id = $1 AND aggregate_id = $2 ORDER BY n",
    )
    .bind(tenant_id)
    .bind(aggregate)
    .fetch_all(&db.owner)
    .await
    .unwrap();
    let parked: Vec<(i64, Option<i64>)> = sqlx::query_as(
        "SELECT message_id, aggregate_seq FROM parked_events
         WHERE tenant_id = $1 AND aggregate_id = $2 ORDER BY position",
    )
    .bind(tenant_id)
    .bind(aggregate)
    .fetch_all(&db.owner)
    .await
    .unwrap();
    format!(
        "{tenant_id}/{aggregate}\n  outbox (id, seq, published): {outbox:?}\n  applied (n, seq, id, replica, at): {applied:?}\n  parked (id, seq): {parked:?}"
    )
}

/// Partitions of the ordered subscription: `ORDERED_TEST_PARTITIONS=0`
/// switches the ordering off (one shared queue, no relay guard, no gate),
/// to see this test fail without it.
fn partitions() -> u16 {
    std::env::var("ORDERED_TEST_PARTITIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4)
}

#[tokio::test]
async fn three_relays_and_three_replicas_apply_each_aggregate_in_outbox_order() {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let spec = spec(&broker, partitions());
    broker::declare_queue(&broker.channel, &spec).await.unwrap();

    let stop = CancellationToken::new();
    let relay_tasks: Vec<Task> = (0..3)
        .map(|_| spawn_relay(&db, &broker, &spec, &stop))
        .collect();
    // The first replica to apply anything crashes before that commit.
    let crash = consumer_config(&spec).fail_points;
    crash.arm(failpoint::CONSUMER_BEFORE_COMMIT, Action::Error);
    let mut replicas: Vec<_> = (0..3)
        .map(|i| {
            let mut cfg = consumer_config(&spec);
            cfg.fail_points = crash.clone();
            let handler = Recording {
                replica: i,
                ..Recording::default()
            };
            run_consumer(&db, cfg, handler, &stop)
        })
        .collect();

    write_concurrently(&db, 8, 40).await;
    // Duplicates: a seventh of the rows go out again, after later events
    // of their aggregates.
    wait_until(LONG, "the first rows published", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox_messages WHERE processed_at IS NOT NULL",
        )
        .fetch_one(&db.owner)
        .await
        .unwrap()
            > 100
    })
    .await;
    sqlx::query("UPDATE outbox_messages SET processed_at = NULL WHERE id % 7 = 0 AND processed_at IS NOT NULL")
        .execute(&db.owner)
        .await
        .unwrap();
    write_concurrently(&db, 4, 20).await;

    // The crashed replica comes back, as a restarted process would.
    wait_until(LONG, "a replica crashed", || async {
        replicas.iter().any(|(_, t)| t.is_finished())
    })
    .await;
    let at = replicas.iter().position(|(_, t)| t.is_finished()).unwrap();
    let (_, crashed) = replicas.remove(at);
    let crash = crashed.await.unwrap();
    assert!(
        matches!(crash, Err(reliability::Error::FailPoint(_))),
        "{crash:?}"
    );
    let handler = Recording {
        replica: 3,
        ..Recording::default()
    };
    replicas.push(run_consumer(&db, consumer_config(&spec), handler, &stop));

    all_applied_in_outbox_order(&db).await;
    let duplicates: u64 = replicas.iter().map(|(c, _)| c.stats().duplicates).sum();
    assert!(duplicates > 0, "the duplicates reached the consumers");

    stop.cancel();
    for t in relay_tasks {
        t.await.unwrap().unwrap();
    }
    for (_, t) in replicas {
        t.await.unwrap().unwrap();
    }
    broker.cleanup_ordered(&spec).await;
    db.cleanup().await;
}
