//! What `reliability status` says of the broker, against the real one:
//! an ordered subscription's partitions and parked aggregates, and each
//! subscription's bindings held to the broker's (its management API,
//! which CI enables; not in RabbitMQ 4's run, whose chroot has none).

use contracts::topology::Subscription;
use operator::ops::{self, status};
use reliability::broker::{self, QueueSpec};
use testkit::{Broker, DEADLINE, TestDb, amqp_url, management_url, unique, wait_until};

static SUBSCRIPTIONS: &[Subscription] = &[
    Subscription::new("shop.views", &["svc.A", "svc.B"]),
    Subscription::new("shop.history", &["svc.C"]).ordered(2),
];

/// A queue that is not bound to a routing key of its subscription
/// receives none of those events, and a passive declare of the queue
/// does not say so (issue 43).
#[tokio::test]
async fn status_names_a_binding_the_broker_lost() {
    let broker = Broker::new().await;
    let prefix = unique("reltest.bind.");
    let specs: Vec<QueueSpec> = SUBSCRIPTIONS
        .iter()
        .map(|s| QueueSpec::for_subscription(s, &broker.exchange, &prefix))
        .collect();
    for spec in &specs {
        broker::declare_queue(&broker.channel, spec).await.unwrap();
    }
    let estate = ops::Estate {
        databases: Vec::new(),
        broker: Some(broker::connect(&amqp_url(), "bindings-test").await.unwrap()),
        queue_prefix: prefix.clone(),
        exchange: broker.exchange.clone(),
        subscriptions: SUBSCRIPTIONS,
        ordered_partitions: String::new(),
        management_url: Some(management_url()),
    };
    let about_bindings = |problems: Vec<operator::ops::problems::Problem>| -> Vec<String> {
        problems
            .into_iter()
            .map(|p| p.text)
            .filter(|p| p.contains("is not bound"))
            .collect()
    };
    let s = status::status(&estate).await;
    assert!(
        s.bindings_checked,
        "the management API answers at {}",
        management_url()
    );
    assert_eq!(about_bindings(s.problems), Vec::<String>::new());

    // An operator's slip, or a broker restored from an old definitions
    // file: one routing key of the order-free queue, and one partition.
    let (views, history) = (&specs[0], &specs[1]);
    broker
        .channel
        .queue_unbind(
            views.queue.as_str().into(),
            broker.exchange.as_str().into(),
            "svc.B".into(),
            Default::default(),
        )
        .await
        .unwrap();
    let partition = history.partition_queue(1);
    broker
        .channel
        .queue_unbind(
            partition.as_str().into(),
            history.partition_exchange().as_str().into(),
            // The consistent-hash exchange binds with the partition's weight.
            "1".into(),
            Default::default(),
        )
        .await
        .unwrap();
    let lost = about_bindings(status::status(&estate).await.problems);
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(
        lost[0].starts_with(&format!(
            "shop.views: {} is not bound to `svc.B`",
            views.queue
        )),
        "{lost:?}"
    );
    assert!(
        lost[1].starts_with(&format!("shop.history: partition {partition} is not bound")),
        "{lost:?}"
    );
    broker.cleanup_ordered(history).await;
    let ch = broker::connect(&amqp_url(), "bindings-cleanup")
        .await
        .unwrap();
    let channel = ch.create_channel().await.unwrap();
    for q in [views.queue.clone(), broker::dead_letter_queue(&views.queue)] {
        let _ = channel
            .queue_delete(q.as_str().into(), Default::default())
            .await;
    }
}

/// `reliability status` on an ordered subscription: its partitions added
/// up, a partition with messages and no consumer named, and its parked
/// aggregates counted as a problem.
#[tokio::test]
async fn status_adds_up_the_partitions_and_names_the_parked_aggregates() {
    static ORDERED: &[Subscription] = &[Subscription::new("shop.orders", &["svc.*"]).ordered(2)];
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let prefix = unique("reltest.status.");
    let spec = QueueSpec::for_subscription(&ORDERED[0], &broker.exchange, &prefix);
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
        subscriptions: ORDERED,
        ordered_partitions: String::new(),
        management_url: None,
    };
    wait_until(DEADLINE, "the message counted", || async {
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
