//! An operator re-drives dead letters one by one or by event type; the
//! others stay in the dead-letter queue, in their order.

use lapin::BasicProperties;
use operator::dlq::{self, DeadLetterFilter};
use reliability::broker;
use testkit::Broker;

/// A consumer queue whose DLQ holds `letters` (message id, event type), in
/// that order: the broker, the queue and its DLQ.
async fn dead_letters(letters: &[(&str, &str)]) -> (Broker, String, String) {
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let dlq = broker.dead_letters(&queue, letters).await;
    (broker, queue, dlq)
}

#[tokio::test]
async fn dead_letters_are_re_driven_one_by_one_or_by_event_type_and_the_rest_keep_their_order() {
    let (broker, queue, dlq) = dead_letters(&[
        ("svc:1", "A"),
        ("svc:2", "B"),
        ("svc:3", "A"),
        ("svc:4", "B"),
    ])
    .await;
    let ids = |letters: Vec<dlq::DeadLetter>| -> Vec<String> {
        letters.into_iter().filter_map(|l| l.message_id).collect()
    };

    // What a filter matches, looked at first, moves nothing (the CLI's
    // `queue dlq redrive --dry-run` prints this count: operator's tests).
    let matching = async |filter: DeadLetterFilter| {
        dlq::peek_dead_letters(&broker.conn, &queue, 10)
            .await
            .unwrap()
            .iter()
            .filter(|l| filter.matches(l))
            .count()
    };
    assert_eq!(matching(DeadLetterFilter::default()).await, 4);
    let type_a = DeadLetterFilter {
        event_type: Some("A".into()),
        ..Default::default()
    };
    assert_eq!(matching(type_a).await, 2);
    let three = DeadLetterFilter {
        message_id: Some("svc:3".into()),
        ..Default::default()
    };
    assert_eq!(matching(three).await, 1);
    assert_eq!(broker.depth(&dlq).await, 4);

    let one = DeadLetterFilter {
        message_id: Some("svc:2".into()),
        ..Default::default()
    };
    assert_eq!(
        dlq::redrive_dead_letters(&broker.conn, &queue, usize::MAX, &one)
            .await
            .unwrap(),
        1
    );
    assert_eq!(broker.depth(&queue).await, 1);
    let left = dlq::peek_dead_letters(&broker.conn, &queue, 10)
        .await
        .unwrap();
    assert_eq!(ids(left), ["svc:1", "svc:3", "svc:4"]);

    let group = DeadLetterFilter {
        event_type: Some("A".into()),
        ..Default::default()
    };
    assert_eq!(
        dlq::redrive_dead_letters(&broker.conn, &queue, usize::MAX, &group)
            .await
            .unwrap(),
        2
    );
    assert_eq!(broker.depth(&queue).await, 3);
    let left = dlq::peek_dead_letters(&broker.conn, &queue, 10)
        .await
        .unwrap();
    assert_eq!(ids(left), ["svc:4"]);

    let none = DeadLetterFilter {
        message_id: Some("svc:9".into()),
        ..Default::default()
    };
    assert_eq!(
        dlq::redrive_dead_letters(&broker.conn, &queue, usize::MAX, &none)
            .await
            .unwrap(),
        0
    );
    assert_eq!(broker.depth(&dlq).await, 1);
    broker.cleanup(&[&queue]).await;
}

/// RabbitMQ 4 gives every quorum queue a delivery limit (20 by default)
/// and counts a message handed back by a look at the DLQ as a delivery; a
/// DLQ has nowhere to dead-letter to, so the 21st look would drop it.
/// Looks refresh the DLQ before that: 30 looks and 30 re-drives that move
/// nothing, and both letters are still there, in order, then re-driven.
#[tokio::test]
async fn looking_at_a_dead_letter_more_often_than_any_delivery_limit_loses_nothing() {
    let (broker, queue, dlq) = dead_letters(&[("svc:1", "A"), ("svc:2", "A")]).await;
    let nothing = DeadLetterFilter {
        message_id: Some("svc:none".into()),
        ..Default::default()
    };
    for look in 1..=30 {
        let seen = dlq::peek_dead_letters(&broker.conn, &queue, 10)
            .await
            .unwrap();
        let ids: Vec<_> = seen.into_iter().filter_map(|l| l.message_id).collect();
        assert_eq!(ids, ["svc:1", "svc:2"], "look {look}: both, in order");
        let moved = dlq::redrive_dead_letters(&broker.conn, &queue, usize::MAX, &nothing)
            .await
            .unwrap();
        assert_eq!(moved, 0);
    }
    assert_eq!(broker.depth(&dlq).await, 2);
    let all = DeadLetterFilter::default();
    assert_eq!(
        dlq::redrive_dead_letters(&broker.conn, &queue, usize::MAX, &all)
            .await
            .unwrap(),
        2
    );
    assert_eq!(broker.depth(&queue).await, 2);
    assert_eq!(broker.depth(&dlq).await, 0);
}

/// An ordered subscription has no queue of its own name: its re-drive
/// goes to the partitions, each letter to its aggregate's by the
/// `x-aggregate` it keeps (the broker's own `x-` history dropped).
#[tokio::test]
async fn an_ordered_subscriptions_dead_letters_are_re_driven_to_its_partitions() {
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let broker = Broker::new().await;
    let mut spec = broker::QueueSpec::new(
        &testkit::unique("reltest.ordredrive."),
        &broker.exchange,
        &["svc.*"],
    );
    spec.partitions = 2;
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let dlq = broker::dead_letter_queue(&spec.queue);
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(broker::PARTITION_HEADER),
        AMQPValue::LongString("1/order:7".into()),
    );
    headers.insert(
        ShortString::from("x-first-death-reason"),
        AMQPValue::LongString("delivery_limit".into()),
    );
    broker
        .publish_with(
            &dlq,
            b"letter",
            BasicProperties::default()
                .with_message_id("svc:7".into())
                .with_headers(headers),
        )
        .await;

    let moved =
        dlq::redrive_dead_letters(&broker.conn, &spec.queue, 10, &DeadLetterFilter::default())
            .await
            .unwrap();
    assert_eq!(moved, 1);
    let mut found = Vec::new();
    for q in spec.queues() {
        if broker.depth(&q).await > 0 {
            found.push(q);
        }
    }
    assert_eq!(found.len(), 1, "the letter is in one partition: {found:?}");
    // A partition has a single active consumer: read it as one.
    use futures_util::StreamExt;
    let ch = broker.conn.create_channel().await.unwrap();
    let mut reader = ch
        .basic_consume(
            found[0].as_str().into(),
            "reltest-reader".into(),
            lapin::options::BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let letter = tokio::time::timeout(std::time::Duration::from_secs(10), reader.next())
        .await
        .expect("the letter is delivered")
        .expect("a delivery")
        .unwrap();
    let header = |name| broker::header_str(&letter.properties, name);
    assert_eq!(
        header(broker::PARTITION_HEADER).as_deref(),
        Some("1/order:7")
    );
    assert_eq!(
        header("x-first-death-reason"),
        None,
        "the broker's history dropped"
    );
    letter
        .ack(lapin::options::BasicAckOptions { multiple: false })
        .await
        .unwrap();
    let _ = ch.close(200, "done".into()).await;
    broker.cleanup_ordered(&spec).await;
}
