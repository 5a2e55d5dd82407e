//! Operating an ordered subscription: changing K by drain and switch, and
//! what `reliability status` says of its partitions and parked aggregates.

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

/// `reliability status` on an ordered subscription: its partitions added
/// up, a partition with messages and no consumer named, and its parked
/// aggregates counted as a problem.
#[tokio::test]
async fn status_adds_up_the_partitions_and_names_the_parked_aggregates() {
    use operator::ops::{self, status};
    use reliability::broker::Subscription;
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
        exchange: String::new(),
        subscriptions: SUBSCRIPTIONS,
        ordered_partitions: String::new(),
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
