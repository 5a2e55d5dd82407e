//! Topology is code (docs/adr/0012): every subscriber queue exists before a
//! relay publishes, so an event waits for a consumer that never ran, was
//! stopped while its queue was deleted, or starts after the publisher.

use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use reliability::Error;
use reliability::broker::QueueSpec;
use reliability::relay::{Relay, RelayConfig};
use testkit::{TestDb, amqp_url, unique, wait_until};
use tokio_util::sync::CancellationToken;

use crate::support::{Broker, DEADLINE, enqueue_added};

/// Two subscribers: one takes every `svc` event (so nothing is ever
/// returned as unroutable), the other only `svc.Added`.
fn subscribers(broker: &Broker) -> Vec<QueueSpec> {
    [
        ("reltest.topo.all.", "svc.*"),
        ("reltest.topo.added.", "svc.Added"),
    ]
    .into_iter()
    .map(|(prefix, binding)| QueueSpec::new(&unique(prefix), &broker.exchange, &[binding]))
    .collect()
}

fn relay(db: &TestDb, broker: &Broker, topology: &[QueueSpec]) -> Relay {
    let mut config = RelayConfig::new("svc", &broker.exchange);
    config.topology = topology.to_vec();
    config.poll_interval = std::time::Duration::from_millis(50);
    Relay::new(db.relay.clone(), &amqp_url(), config)
}

async fn delete(broker: &Broker, queue: &str) {
    broker
        .channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

async fn pending(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
        .fetch_one(&db.owner)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_event_waits_in_the_queue_of_a_subscriber_that_never_ran() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let topology = subscribers(&broker);
    let id = enqueue_added(&db, 1, "agg-1", 5).await;
    let relay = relay(&db, &broker, &topology);
    let report = relay
        .drain(&relay.publisher().await.unwrap())
        .await
        .unwrap();
    assert_eq!(report.published, 1);
    for q in &topology {
        let got = broker.take_all(&q.queue).await;
        assert_eq!(
            got.iter().map(|e| e.id).collect::<Vec<_>>(),
            [id],
            "{}",
            q.queue
        );
    }
    let names: Vec<&str> = topology.iter().map(|q| q.queue.as_str()).collect();
    broker.cleanup(&names).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_queue_deleted_under_a_running_relay_is_declared_again_before_the_next_publish() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let topology = subscribers(&broker);
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, stop) = (relay(&db, &broker, &topology), stop.clone());
        async move { relay.run(stop).await }
    });
    let first = enqueue_added(&db, 1, "agg-1", 1).await;
    wait_until(DEADLINE, "the first event relayed", || async {
        pending(&db).await == 0
    })
    .await;

    // An operator deletes one subscriber's queue while its consumer is down.
    delete(&broker, &topology[1].queue).await;
    let mut later = Vec::new();
    for n in 0..20 {
        later.push(enqueue_added(&db, 1, &format!("agg-{n}"), 1).await);
    }
    wait_until(DEADLINE, "the later events relayed", || async {
        pending(&db).await == 0
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();

    let mut got: Vec<i64> = broker
        .take_all(&topology[1].queue)
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    got.sort_unstable();
    got.dedup();
    assert_eq!(
        got, later,
        "the recreated queue holds every event published after the deletion"
    );
    let all: Vec<i64> = broker
        .take_all(&topology[0].queue)
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    assert!(all.contains(&first) && later.iter().all(|id| all.contains(id)));
    let names: Vec<&str> = topology.iter().map(|q| q.queue.as_str()).collect();
    broker.cleanup(&names).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_relay_that_cannot_declare_a_subscriber_queue_publishes_nothing_and_costs_no_attempts() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let topology = subscribers(&broker);
    // Someone made the queue with other arguments: declaring ours fails.
    broker
        .channel
        .queue_declare(
            topology[1].queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    enqueue_added(&db, 1, "agg-1", 1).await;
    let relay = relay(&db, &broker, &topology);
    let err = relay
        .publisher()
        .await
        .err()
        .expect("no publisher without the topology");
    assert!(matches!(err, Error::Topology(_)), "{err}");
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM outbox_messages")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    assert_eq!(
        (pending(&db).await, attempts),
        (1, 0),
        "the outbox simply waits"
    );
    assert_eq!(
        broker.depth(&topology[0].queue).await,
        0,
        "nothing published anywhere"
    );

    delete(&broker, &topology[1].queue).await;
    let report = relay
        .drain(&relay.publisher().await.unwrap())
        .await
        .unwrap();
    assert_eq!(
        report.published, 1,
        "published once the queue could be declared"
    );
    let names: Vec<&str> = topology.iter().map(|q| q.queue.as_str()).collect();
    broker.cleanup(&names).await;
    db.cleanup().await;
}
