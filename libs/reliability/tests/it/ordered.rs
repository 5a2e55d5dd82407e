//! Order per aggregate (docs/adr/0028): an ordered subscription's handler
//! sees each aggregate's events in outbox order, with relays and replicas
//! side by side, a crash mid-group and duplicates; a poison event parks
//! its aggregate alone, and an unpark replays it in order.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reliability::broker::QueueSpec;
use reliability::consumer::{self, Consumer, ConsumerConfig, Handler, HandlerError};
use reliability::failpoint::{self, Action};
use reliability::outbox::{self, Envelope, NewEvent};
use reliability::relay::{Relay, RelayConfig};
use reliability::testing::{TestDb, amqp_url, unique, wait_until};
use reliability::{TenantTx, broker};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::{Broker, Rng, tenant};

const LONG: Duration = Duration::from_secs(90);

/// Records every event it applies, in the order applied: one aggregate's
/// applies take turns under its lock, so the serial is their order. Fails
/// for good on the events named in `poison`.
#[derive(Clone, Default)]
struct Recording {
    poison: Arc<Mutex<HashSet<(String, i64)>>>,
}

impl Handler for Recording {
    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        let seq = e.aggregate_seq.unwrap_or(0);
        if self
            .poison
            .lock()
            .unwrap()
            .contains(&(e.aggregate_id.clone(), seq))
        {
            return Err(HandlerError::Permanent("poison".into()));
        }
        sqlx::query(
            "INSERT INTO test_applied (tenant_id, aggregate_id, seq, message_id) VALUES ($1, $2, $3, $4)",
        )
        .bind(tx.tenant().get())
        .bind(&e.aggregate_id)
        .bind(seq)
        .bind(e.id)
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
             message_id bigint NOT NULL UNIQUE);
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
) -> (Arc<Consumer<Recording>>, Task) {
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

/// One relay and one consumer (2 lanes) on an ordered subscription of
/// `partitions`, the handler failing for good on `poison` ((aggregate, n)).
struct Parking {
    db: TestDb,
    broker: Broker,
    spec: QueueSpec,
    stop: CancellationToken,
    relay: Task,
    consumer: Arc<Consumer<Recording>>,
    task: Task,
    name: String,
    handler: Recording,
}

impl Parking {
    async fn start(partitions: u16, poison: &[(&str, i64)]) -> Self {
        let db = TestDb::new().await;
        create_applied_table(&db).await;
        let broker = Broker::new().await;
        let spec = spec(&broker, partitions);
        broker::declare_queue(&broker.channel, &spec).await.unwrap();
        let stop = CancellationToken::new();
        let relay = spawn_relay(&db, &broker, &spec, &stop);
        let handler = Recording::default();
        for (aggregate, n) in poison {
            handler
                .poison
                .lock()
                .unwrap()
                .insert(((*aggregate).to_owned(), *n));
        }
        let cfg = consumer_config(&spec);
        let name = cfg.name.clone();
        let (consumer, task) = run_consumer(&db, cfg, handler.clone(), &stop);
        Self {
            db,
            broker,
            spec,
            stop,
            relay,
            consumer,
            task,
            name,
            handler,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.relay.await.unwrap().unwrap();
        self.task.await.unwrap().unwrap();
        self.broker.cleanup_ordered(&self.spec).await;
        self.db.cleanup().await;
    }
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
    assert!(parked.is_empty(), "nothing parked: {parked:?}");
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
        .map(|_| {
            let mut cfg = consumer_config(&spec);
            cfg.fail_points = crash.clone();
            run_consumer(&db, cfg, Recording::default(), &stop)
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
    replicas.push(run_consumer(
        &db,
        consumer_config(&spec),
        Recording::default(),
        &stop,
    ));

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

#[tokio::test]
async fn a_poison_event_parks_its_aggregate_alone_and_an_unpark_replays_it_in_order() {
    // A's second event fails for good.
    let t = Parking::start(2, &[("A", 2)]).await;
    let (db, consumer, name) = (&t.db, &t.consumer, &t.name);

    // Five events each of A and of twenty others, interleaved.
    for round in 0..5 {
        let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
        for aggregate in std::iter::once("A".to_owned()).chain((0..20).map(|i| format!("b{i}"))) {
            outbox::enqueue(
                &mut tx,
                &NewEvent::new("test", aggregate, "Changed", &json!({ "round": round })).unwrap(),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
    wait_until(LONG, "the others applied, A parked", || async {
        consumer.stats().finished() == 105
    })
    .await;
    let seqs = |aggregate: &'static str| {
        let db = &db;
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT seq FROM test_applied WHERE aggregate_id = $1 ORDER BY n",
            )
            .bind(aggregate)
            .fetch_all(&db.owner)
            .await
            .unwrap()
        }
    };
    assert_eq!(seqs("b7").await, vec![1, 2, 3, 4, 5], "the others flow");
    assert_eq!(seqs("A").await, vec![1], "A stops at its poison");
    let parked = consumer::parked(&db.owner, Some(name)).await.unwrap();
    assert_eq!(parked.len(), 1, "{parked:?}");
    let a = &parked[0];
    assert_eq!(
        (a.aggregate_id.as_str(), a.waiting, a.first_seq),
        ("A", 4, Some(2))
    );
    assert!(a.error.contains("poison"), "{}", a.error);
    assert_eq!(consumer.stats().parked, 4);

    // A later event of A waits behind the parked ones.
    write_one(db, 1, "A").await;
    wait_until(LONG, "A's sixth event parked behind", || async {
        consumer.stats().parked == 5
    })
    .await;

    // A dry run of skip names the first and changes nothing.
    let first = consumer::skip_first(&db.owner, name, 1, "test", "A", true)
        .await
        .unwrap()
        .expect("a first parked event");
    assert_eq!(first.aggregate_seq, Some(2));
    assert_eq!(
        consumer::parked(&db.owner, Some(name)).await.unwrap()[0].waiting,
        5
    );

    // Fixed, then unparked: A replays in order and flows again.
    t.handler.poison.lock().unwrap().clear();
    assert!(
        consumer::unpark(&db.owner, name, 1, "test", "A")
            .await
            .unwrap()
    );
    wait_until(LONG, "A replayed and resumed", || async {
        consumer::parked(&db.owner, Some(name))
            .await
            .unwrap()
            .is_empty()
    })
    .await;
    assert_eq!(seqs("A").await, vec![1, 2, 3, 4, 5, 6]);
    write_one(db, 1, "A").await;
    wait_until(LONG, "A's next event applied at once", || async {
        seqs("A").await.len() == 7
    })
    .await;

    t.stop().await;
}

#[tokio::test]
async fn skip_removes_the_first_parked_event_and_an_emptied_park_resumes() {
    let t = Parking::start(1, &[("S", 1)]).await;
    let (db, consumer, name) = (&t.db, &t.consumer, &t.name);
    write_one(db, 2, "S").await;
    wait_until(LONG, "S parked", || async { consumer.stats().parked == 1 }).await;
    let skipped = consumer::skip_first(&db.owner, name, 2, "test", "S", false)
        .await
        .unwrap()
        .expect("the parked event");
    assert_eq!(skipped.aggregate_seq, Some(1));
    assert!(
        consumer::parked(&db.owner, Some(name))
            .await
            .unwrap()
            .is_empty(),
        "the only parked event skipped: S flows again"
    );
    write_one(db, 2, "S").await;
    wait_until(LONG, "S's next event applied", || async {
        consumer.stats().applied == 1
    })
    .await;
    t.stop().await;
}

/// The gate itself, without a broker: an event at or below its aggregate's
/// position parks the aggregate (never applied late in silence), the later
/// ones wait behind it, and a gap (events this subscription is not bound
/// to) is no reason to wait.
#[tokio::test]
async fn an_event_out_of_order_parks_its_aggregate_and_a_gap_does_not() {
    use reliability::consumer::Outcome;
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let mut spec = QueueSpec::new(&unique("reltest.gate."), "x", &["svc.*"]);
    spec.partitions = 2;
    let consumer = Consumer::new(
        db.app.clone(),
        &amqp_url(),
        consumer_config(&spec),
        Recording::default(),
    );
    let event = |id: i64, seq: i64| {
        let mut e = crate::support::envelope("svc", id, 1, "G", "Changed", 0);
        e.aggregate_seq = Some(seq);
        e
    };
    let outcomes = [
        consumer.apply(&event(10, 1)).await.unwrap(),
        consumer.apply(&event(11, 3)).await.unwrap(),
        consumer.apply(&event(12, 2)).await.unwrap(),
        consumer.apply(&event(13, 4)).await.unwrap(),
        consumer.apply(&event(12, 2)).await.unwrap(),
    ];
    assert_eq!(
        outcomes,
        [
            Outcome::Applied,
            Outcome::Applied,
            Outcome::Parked,
            Outcome::Parked,
            Outcome::Duplicate
        ]
    );
    let parked = consumer::parked(&db.owner, None).await.unwrap();
    assert_eq!((parked.len(), parked[0].waiting), (1, 2));
    assert!(
        parked[0].error.contains("out of order: event 2 of test:G"),
        "{}",
        parked[0].error
    );
    db.cleanup().await;
}

/// K from 4 to 8 by the runbook's drain and switch: the relays stop, the
/// consumers empty the partitions and stop, `reliability queue drained`
/// says so, then consumers and relays start with 8. Events keep coming
/// all along (they wait in the outbox meanwhile), and every aggregate is
/// still applied in outbox order, nothing parked.
#[tokio::test]
async fn changing_k_after_a_drain_keeps_every_aggregate_in_order() {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let four = spec(&broker, 4);
    broker::declare_queue(&broker.channel, &four).await.unwrap();
    let run =
        |spec: &QueueSpec, relays_stop: &CancellationToken, consumers_stop: &CancellationToken| {
            let relays: Vec<Task> = (0..2)
                .map(|_| spawn_relay(&db, &broker, spec, relays_stop))
                .collect();
            let consumers: Vec<Task> = (0..2)
                .map(|_| {
                    run_consumer(
                        &db,
                        consumer_config(spec),
                        Recording::default(),
                        consumers_stop,
                    )
                    .1
                })
                .collect();
            (relays, consumers)
        };
    let (relays_stop, consumers_stop) = (CancellationToken::new(), CancellationToken::new());
    let (relays, consumers) = run(&four, &relays_stop, &consumers_stop);
    write_concurrently(&db, 4, 20).await;

    // 1. Stop the relays: what is written now waits in the outbox.
    relays_stop.cancel();
    for t in relays {
        t.await.unwrap().unwrap();
    }
    let writing = tokio::spawn({
        let app = db.app.clone();
        async move {
            for i in 0..40 {
                let mut tx = TenantTx::begin(&app, tenant(1 + i % 2)).await.unwrap();
                outbox::enqueue(
                    &mut tx,
                    &NewEvent::new("test", format!("a{}", i % 12), "Changed", &json!({})).unwrap(),
                )
                .await
                .unwrap();
                tx.commit().await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    // 2. The consumers empty the partitions, then stop.
    wait_until(LONG, "the partitions emptied", || async {
        let mut ready = 0;
        for q in four.queues() {
            ready += broker.depth(&q).await;
        }
        let published: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_messages WHERE processed_at IS NOT NULL",
        )
        .fetch_one(&db.owner)
        .await
        .unwrap();
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM test_applied")
            .fetch_one(&db.owner)
            .await
            .unwrap();
        ready == 0 && applied == published
    })
    .await;
    consumers_stop.cancel();
    for t in consumers {
        t.await.unwrap().unwrap();
    }
    // 3. The operator's check.
    let drained = std::process::Command::new(env!("CARGO_BIN_EXE_reliability"))
        .args(["queue", "drained", &four.queue, "--partitions", "4"])
        .env("AMQP_URL", amqp_url())
        .output()
        .unwrap();
    assert!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );

    // 4. Consumers and relays with K = 8, the writes still going on.
    let mut eight = four.clone();
    eight.partitions = 8;
    let stop = CancellationToken::new();
    let (relays, consumers) = run(&eight, &stop, &stop);
    writing.await.unwrap();
    write_concurrently(&db, 4, 20).await;
    all_applied_in_outbox_order(&db).await;
    for q in eight.queues() {
        assert_eq!(broker.depth(&q).await, 0, "{q} exists and was emptied");
    }

    stop.cancel();
    for t in relays.into_iter().chain(consumers) {
        t.await.unwrap().unwrap();
    }
    broker.cleanup_ordered(&eight).await;
    db.cleanup().await;
}

/// `reliability status` on an ordered subscription: its partitions added
/// up, a partition with messages and no consumer named, and its parked
/// aggregates counted as a problem.
#[tokio::test]
async fn status_adds_up_the_partitions_and_names_the_parked_aggregates() {
    use reliability::broker::Subscription;
    use reliability::ops::{self, status};
    static SUBSCRIPTIONS: &[Subscription] =
        &[Subscription::new("shop.orders", &["svc.*"]).ordered(2)];
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let prefix = unique("reltest.status.");
    let spec = QueueSpec::for_subscription(&SUBSCRIPTIONS[0], &broker.exchange, &prefix);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    broker
        .publish_to_queue(&spec.partition_queue(1), b"{}")
        .await;
    sqlx::query(
        "INSERT INTO parked_aggregates (tenant_id, consumer, source, aggregate_type, aggregate_id, error)
         VALUES (1, 'shop.orders', 'svc', 'order', '7', 'permanent: x')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let estate = ops::Estate {
        databases: vec![("shop".into(), db.owner.clone())],
        broker: Some(broker::connect(&amqp_url(), "status-test").await.unwrap()),
        queue_prefix: prefix,
        subscriptions: SUBSCRIPTIONS,
        management_url: None,
    };
    wait_until(LONG, "the message counted", || async {
        status::status(&estate).await.consumers[0].ready == Some(1)
    })
    .await;
    let s = status::status(&estate).await;
    let line = &s.consumers[0];
    assert_eq!(
        (line.consumers, line.parked, line.error.as_deref()),
        (Some(0), Some(1), None)
    );
    assert!(
        s.problems
            .iter()
            .any(|p| p.contains("1 aggregate(s) parked")),
        "{:?}",
        s.problems
    );
    assert!(
        s.problems
            .iter()
            .any(|p| p.contains("no consumer attached")),
        "{:?}",
        s.problems
    );
    broker.cleanup_ordered(&spec).await;
    db.cleanup().await;
}
