//! Parking: a poison event parks its aggregate alone, an unpark replays
//! it in order, a skip drops the first event, and the gate parks what
//! comes out of order.

use super::*;

/// One relay and one consumer (2 lanes) on an ordered subscription of
/// `partitions`, the handler failing for good on `poison` ((aggregate, n)).
struct Parking {
    db: TestDb,
    broker: Broker,
    spec: QueueSpec,
    stop: CancellationToken,
    relay: Task,
    consumer: Arc<Consumer<Pg<Recording>>>,
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
    let first = consumer::first_parked(&db.owner, name, 1, "test", "A")
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
    let shown = consumer::first_parked(&db.owner, name, 2, "test", "S")
        .await
        .unwrap()
        .expect("the parked event");
    let skipped = consumer::skip(&db.owner, name, 2, "test", "S", shown.message_id)
        .await
        .unwrap()
        .expect("the parked event");
    assert_eq!(
        consumer::skip(&db.owner, name, 2, "test", "S", shown.message_id)
            .await
            .unwrap()
            .map(|e| e.message_id),
        None,
        "a second skip of the same event drops nothing"
    );
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
    let (db, consumer, _) = gate("reltest.gate.").await;
    let event = |id: i64, seq: i64| numbered(id, "G", Some(seq));
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

/// An unnumbered event (from a relay that does not number: an older
/// release in a rolling upgrade) is applied only where no numbered event
/// came before it; after one, its order cannot be checked, and it parks
/// its aggregate rather than be applied late in silence.
#[tokio::test]
async fn an_unnumbered_event_after_a_numbered_one_parks_its_aggregate() {
    use reliability::consumer::Outcome;
    let (db, consumer, _) = gate("reltest.unnumbered.").await;
    let event = numbered;
    let outcomes = [
        // The old relay's events, then the new relay's: in order.
        consumer.apply(&event(1, "U", None)).await.unwrap(),
        consumer.apply(&event(2, "U", Some(1))).await.unwrap(),
        // The new relay's event applied first, the old one's late.
        consumer.apply(&event(4, "L", Some(1))).await.unwrap(),
        consumer.apply(&event(3, "L", None)).await.unwrap(),
    ];
    assert_eq!(
        outcomes,
        [
            Outcome::Applied,
            Outcome::Applied,
            Outcome::Applied,
            Outcome::Parked
        ]
    );
    let parked = consumer::parked(&db.owner, None).await.unwrap();
    assert_eq!(
        parked
            .iter()
            .map(|p| (p.aggregate_id.as_str(), p.first_message_id))
            .collect::<Vec<_>>(),
        [("L", Some(3))]
    );
    assert!(
        parked[0].error.contains("unnumbered"),
        "{}",
        parked[0].error
    );
    db.cleanup().await;
}

/// The gate over a group (one transaction, tenant by tenant) decides as it
/// does one event at a time: in order and new aggregates apply, an event
/// at or below its aggregate's position parks it and the later ones wait,
/// a message repeated in the group is a duplicate, unnumbered events apply.
#[tokio::test]
async fn a_group_is_gated_as_its_events_would_be_one_by_one() {
    use reliability::consumer::Outcome;
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let spec = spec(&broker, 1);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let mut cfg = consumer_config(&spec);
    (cfg.lanes, cfg.prefetch, cfg.batch_max) = (1, 50, 32);
    let event = |tenant: i64, aggregate: &str, id: i64, seq: Option<i64>| {
        let mut e = crate::support::envelope("svc", id, tenant, aggregate, "Changed", 0);
        e.aggregate_seq = seq;
        e
    };
    // Positions from before: K and M at 1.
    let before = Consumer::new(
        db.app.clone(),
        &amqp_url(),
        cfg.clone(),
        Recording::default(),
    );
    for e in [event(1, "K", 40, Some(1)), event(1, "M", 50, Some(1))] {
        assert_eq!(before.apply(&e).await.unwrap(), Outcome::Applied);
    }
    let group = [
        event(1, "G", 10, Some(1)),
        event(1, "G", 11, Some(3)),
        event(1, "G", 12, Some(2)), // out of order: parks G
        event(1, "G", 13, Some(4)), // waits behind it
        event(1, "G", 12, Some(2)), // the same message again
        event(2, "H", 20, Some(5)), // a new aggregate starts where it is
        event(2, "H", 20, Some(5)),
        event(2, "H", 21, Some(6)),
        event(1, "N", 30, None),
        event(1, "N", 31, None),
        event(1, "K", 41, Some(1)), // at K's position, another message: parks K
        event(1, "K", 42, Some(2)),
        event(1, "M", 51, Some(2)), // after M's position
    ];
    let queue = spec.partition_queue(0);
    for e in &group {
        broker
            .publish_to_queue(&queue, &serde_json::to_vec(e).unwrap())
            .await;
    }
    let stop = CancellationToken::new();
    let (consumer, task) = run_consumer(&db, cfg, Recording::default(), &stop);
    let settled = || {
        let s = consumer.stats();
        s.applied + s.duplicates + s.parked
    };
    wait_until(LONG, "the group settled", || async {
        settled() >= group.len() as u64
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    let s = consumer.stats();
    assert_eq!((s.applied, s.parked, s.duplicates), (7, 4, 2), "{s:?}");
    // The group way ran (the events waited before the consumer started).
    assert!(s.grouped > 0, "{s:?}");
    let applied = applied(&db).await;
    let ids = |t: i64, a: &str| applied.get(&(t, a.to_owned())).cloned().unwrap_or_default();
    assert_eq!(ids(1, "G"), [10, 11]);
    assert_eq!(ids(2, "H"), [20, 21]);
    assert_eq!(ids(1, "N"), [30, 31]);
    assert_eq!(ids(1, "K"), [40]);
    assert_eq!(ids(1, "M"), [50, 51]);
    let parked = consumer::parked(&db.owner, None).await.unwrap();
    let waiting: Vec<(String, i64)> = parked
        .iter()
        .map(|p| (p.aggregate_id.clone(), p.waiting))
        .collect();
    assert_eq!(waiting.len(), 2, "{parked:?}");
    assert!(waiting.contains(&("G".into(), 2)) && waiting.contains(&("K".into(), 2)));
    for p in &parked {
        let first = if p.aggregate_id == "G" { 2 } else { 1 };
        let expected = format!("out of order: event {first} of test:{}", p.aggregate_id);
        assert!(p.error.contains(&expected), "{}", p.error);
    }
    broker.cleanup_ordered(&spec).await;
    db.cleanup().await;
}

/// `parked_overview` runs with its owner's rights (SECURITY DEFINER): a
/// caller's temporary table of the same name must not stand in for the
/// real one. With `pg_temp` not last in its `search_path`, PostgreSQL
/// searched the session's temporary tables first.
#[tokio::test]
async fn a_temporary_table_cannot_stand_in_for_a_definer_functions_table() {
    use reliability::consumer::Outcome;
    let (db, consumer, cfg) = gate("reltest.definer.").await;
    consumer.apply(&numbered(1, "D", Some(2))).await.unwrap();
    assert_eq!(
        consumer.apply(&numbered(2, "D", Some(1))).await.unwrap(),
        Outcome::Parked
    );
    let mut conn = db.app.acquire().await.unwrap();
    sqlx::raw_sql(
        "CREATE TEMP TABLE parked_aggregates (LIKE public.parked_aggregates);
         CREATE TEMP TABLE payments (id bigint)",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let seen: Vec<String> = sqlx::query_scalar("SELECT aggregate_id FROM parked_overview($1)")
        .bind(&cfg.name)
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    assert_eq!(seen, ["D"], "the function read the caller's empty table");
    let loose: Vec<String> = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text FROM pg_proc p
         JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'public' AND p.prosecdef
           AND NOT EXISTS (SELECT FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%pg_temp')",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert!(loose.is_empty(), "pg_temp is not last for {loose:?}");
    conn.detach();
    db.cleanup().await;
}

/// An event that takes its consumer down every time it is tried (a crash,
/// a freeze past the broker's timeout) is handed back each time. On an
/// ordered partition the broker's delivery limit would dead-letter it, and
/// the aggregate's later events would be applied over the gap. The lane
/// parks it instead, untried, once its recorded tries say it is the one
/// the consumer dies on; the DLQ stays empty, and an unpark replays it in
/// order. B's event, in the same partition behind it, is handed back by
/// every crash too but never tried: counted by returns alone, it was
/// parked with A (shown in session 29); it is applied.
#[tokio::test]
async fn an_event_that_keeps_crashing_its_consumer_parks_its_aggregate_instead_of_a_dead_letter() {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let spec = spec(&broker, 1);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let stop = CancellationToken::new();
    let relay = spawn_relay(&db, &broker, &spec, &stop);
    let mut cfg = consumer_config(&spec);
    // One lane: a simulated crash stops the lanes one after the other, and
    // a second lane would take the event back between the two.
    cfg.lanes = 1;
    let name = cfg.name.clone();
    let (partition, dlq) = (
        spec.partition_queue(0),
        broker::dead_letter_queue(&spec.queue),
    );
    write_one(&db, 1, "A").await;
    write_one(&db, 1, "B").await;
    let parked = || async { consumer::parked(&db.owner, Some(&name)).await.unwrap() };
    // The consumer dies whenever it applies A's event, and only then.
    let crash_on_a = format!("{}@{name}/1/test:A", failpoint::CONSUMER_HANDLER);
    let mut crashes = 0;
    let consumer = loop {
        wait_until(
            LONG,
            "the events waiting, parked or dead-lettered",
            || async {
                broker.depth(&partition).await + broker.depth(&dlq).await == 2
                    || !parked().await.is_empty()
            },
        )
        .await;
        assert_eq!(broker.depth(&dlq).await, 0, "dead-lettered: a gap");
        cfg.fail_points.arm(&crash_on_a, Action::Crash);
        let (consumer, task) = run_consumer(&db, cfg.clone(), Recording::default(), &stop);
        wait_until(LONG, "the consumer crashed or parked A", || async {
            task.is_finished() || !parked().await.is_empty()
        })
        .await;
        if !task.is_finished() {
            break (consumer, task);
        }
        assert!(task.await.unwrap().is_err(), "a crash");
        crashes += 1;
        assert!(
            crashes <= spec.delivery_limit + 1,
            "still tried after {crashes} crashes"
        );
    };
    assert_eq!(
        crashes,
        1 + consumer::CRASH_TRIES as u32,
        "set aside once its recorded tries say so"
    );
    wait_until(LONG, "B applied", || async {
        applied(&db).await.contains_key(&(1, "B".to_owned()))
    })
    .await;
    let all = parked().await;
    assert_eq!(all.len(), 1, "only A parked: {all:?}");
    let a = &all[0];
    assert_eq!((a.aggregate_id.as_str(), a.waiting), ("A", 1));
    assert!(a.error.contains("died each of the"), "{}", a.error);
    assert_eq!(broker.depth(&dlq).await, 0);
    assert!(
        !applied(&db).await.contains_key(&(1, "A".to_owned())),
        "never tried once set aside"
    );

    // A's next event waits behind it; fixed, unparked: both, in order.
    write_one(&db, 1, "A").await;
    wait_until(LONG, "A's second event parked behind", || async {
        parked().await.first().is_some_and(|a| a.waiting == 2)
    })
    .await;
    cfg.fail_points.fire(&crash_on_a);
    assert!(
        consumer::unpark(&db.owner, &name, 1, "test", "A")
            .await
            .unwrap()
    );
    wait_until(LONG, "A replayed", || async { parked().await.is_empty() }).await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT message_id FROM test_applied WHERE aggregate_id = 'A' ORDER BY n",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert_eq!(ids, written(&db).await[&(1, "A".to_owned())]);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM consumer_tries")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    assert_eq!(left, 0, "tries are forgotten once settled");
    stop.cancel();
    relay.await.unwrap().unwrap();
    consumer.1.await.unwrap().unwrap();
    drop(consumer.0);
    broker.cleanup_ordered(&spec).await;
    db.cleanup().await;
}
