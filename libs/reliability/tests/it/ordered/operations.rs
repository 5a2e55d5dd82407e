//! Operating an ordered subscription: changing K by drain and switch
//! (what `reliability status` says of its partitions is the operator's:
//! `libs/operator/tests/status.rs`).

use super::*;

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
    // Written while drained: these wait in the outbox for the new layout.
    write_concurrently(&db, 2, 10).await;
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
    // 3. The operator's check (`reliability queue drained`, which asks
    // the same of each partition: the operator's tests run it).
    let conn = broker::connect(&amqp_url(), "drained").await.unwrap();
    for q in four.queues() {
        let (ready, consumers) = broker::inspect_queue(&conn, &q).await.unwrap();
        assert_eq!((ready, consumers), (0, 0), "{q} is not drained");
    }
    let _ = conn.close(200, "looked".into()).await;

    // 4. Consumers and relays with K = 8, the writes still going on.
    let mut eight = four.clone();
    eight.partitions = 8;
    let stop = CancellationToken::new();
    // Writers run while the new layout starts and drains the outbox.
    let (relays, consumers) = run(&eight, &stop, &stop);
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

/// A rolling upgrade from a release whose relays do not number (ADR 0028,
/// amended in session 34): once today's migrations ran, a relay session
/// that does not say it numbers (an older release's, left running beside
/// today's) claims nothing, and today's relay publishes every event,
/// numbered. Without migration 0012's policy the old relay claims all five
/// and would publish them unnumbered, to one partition.
#[tokio::test]
async fn a_relay_of_a_release_that_does_not_number_claims_nothing() {
    use std::str::FromStr;
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let spec = spec(&broker, 2);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    for n in 0..5 {
        write_one(&db, 1, &format!("a{n}")).await;
    }
    // The relay role as an older release connects: without the setting.
    let mut as_old = sqlx::postgres::PgConnectOptions::from_str(&testkit::database_url())
        .unwrap()
        .database(&db.name)
        .username(reliability::db::RELAY_ROLE);
    if let Ok(password) = std::env::var(reliability::db::ROLE_PASSWORD_ENV) {
        as_old = as_old.password(&password);
    }
    let old_pool = reliability::db::pool(as_old, 2).await.unwrap();
    let mut cfg = RelayConfig::new("svc", &broker.exchange);
    cfg.topology = vec![spec.clone()];
    let old = Relay::new(old_pool, &amqp_url(), cfg);
    let report = old
        .relay_batch(&old.publisher().await.unwrap())
        .await
        .unwrap();
    assert_eq!(
        (report.claimed, report.published),
        (0, 0),
        "an old relay claimed events"
    );

    let ours = relay(&db, &broker, &spec);
    let report = ours
        .relay_batch(&ours.publisher().await.unwrap())
        .await
        .unwrap();
    assert_eq!((report.claimed, report.published), (5, 5));
    let unnumbered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL OR aggregate_seq IS NULL",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(unnumbered, 0, "events left unpublished or unnumbered");
}
