//! A whole ordered subscription waits for a number skipped (docs/adr/0040):
//! a later event holds its aggregate until the missing one comes, then
//! both apply in number order; one that never comes is applied over after
//! the hold's bound. The others of the partition flow meanwhile.

use super::*;

/// Publishes `events` to the partition queue of `spec` (one partition).
async fn publish(broker: &Broker, spec: &QueueSpec, events: &[Envelope]) {
    for e in events {
        broker
            .publish_to_queue(&spec.partition_queue(0), &serde_json::to_vec(e).unwrap())
            .await;
    }
}

async fn held(db: &TestDb) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT a.aggregate_id, count(e.*) FROM parked_aggregates a
         JOIN parked_events e USING (tenant_id, consumer, source, aggregate_type, aggregate_id)
         WHERE a.held_until IS NOT NULL GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap()
}

async fn parked_rows(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM parked_aggregates")
        .fetch_one(&db.owner)
        .await
        .unwrap()
}

/// Waits until the one aggregate parked is parked for an operator (not
/// held), with an error that says `why`.
async fn parked_for_an_operator(db: &TestDb, why: &str) {
    wait_until(LONG, "G parked for an operator", || async {
        let rows: Vec<(String, Option<chrono::DateTime<chrono::Utc>>)> =
            sqlx::query_as("SELECT error, held_until FROM parked_aggregates")
                .fetch_all(&db.owner)
                .await
                .unwrap();
        matches!(rows.as_slice(), [(error, None)] if error.contains(why))
    })
    .await;
}

fn whole(broker: &Broker, gap_wait: Duration) -> (QueueSpec, ConsumerConfig) {
    let mut spec = spec(broker, 1);
    spec.whole = true;
    let mut cfg = consumer_config(&spec);
    cfg.gap_wait = gap_wait;
    (spec, cfg)
}

#[tokio::test]
async fn a_whole_subscription_waits_for_a_number_skipped_and_applies_in_number_order() {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let (spec, cfg) = whole(&broker, LONG);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    // G's first event is late (the broker handed it back after the others,
    // or a relay retried it); H is complete.
    publish(
        &broker,
        &spec,
        &[
            numbered(12, "G", Some(3)),
            numbered(11, "G", Some(2)),
            numbered(20, "H", Some(1)),
            numbered(21, "H", Some(2)),
        ],
    )
    .await;
    let stop = CancellationToken::new();
    let (_consumer, task) = run_consumer(&db, cfg, Recording::default(), &stop);
    wait_until(LONG, "G held with its two events, H applied", || async {
        held(&db).await == [("G".to_owned(), 2)]
            && applied(&db).await.get(&(1, "H".to_owned())) == Some(&vec![20, 21])
    })
    .await;
    assert!(!applied(&db).await.contains_key(&(1, "G".to_owned())));
    publish(&broker, &spec, &[numbered(10, "G", Some(1))]).await;
    wait_until(LONG, "G applied whole and resumed", || async {
        applied(&db).await.get(&(1, "G".to_owned())).map(Vec::len) == Some(3)
            && parked_rows(&db).await == 0
    })
    .await;
    // In number order: without the hold, 3 was applied first and the late
    // ones parked G as out of order.
    assert_eq!(applied(&db).await[&(1, "G".to_owned())], vec![10, 11, 12]);
    // G flows on from 3.
    publish(&broker, &spec, &[numbered(13, "G", Some(4))]).await;
    wait_until(LONG, "G's next event applied", || async {
        applied(&db).await.get(&(1, "G".to_owned())).map(Vec::len) == Some(4)
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_number_that_never_comes_is_applied_over_once_the_hold_has_waited_its_bound() {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let (spec, cfg) = whole(&broker, Duration::from_secs(2));
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    publish(
        &broker,
        &spec,
        &[numbered(13, "G", Some(4)), numbered(12, "G", Some(3))],
    )
    .await;
    let stop = CancellationToken::new();
    let (_consumer, task) = run_consumer(&db, cfg, Recording::default(), &stop);
    wait_until(LONG, "G held", || async {
        held(&db).await == [("G".to_owned(), 2)]
    })
    .await;
    wait_until(LONG, "G applied over its gap and resumed", || async {
        applied(&db).await.get(&(1, "G".to_owned())).map(Vec::len) == Some(2)
            && parked_rows(&db).await == 0
    })
    .await;
    assert_eq!(applied(&db).await[&(1, "G".to_owned())], vec![12, 13]);
    // The late ones, after all: out of order, G parks for an operator.
    publish(&broker, &spec, &[numbered(10, "G", Some(1))]).await;
    parked_for_an_operator(&db, "out of order").await;
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_held_event_that_fails_when_its_turn_comes_parks_its_aggregate_for_an_operator() {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let (spec, cfg) = whole(&broker, Duration::from_secs(2));
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let handler = Recording::default();
    handler.poison.lock().unwrap().insert(("G".to_owned(), 2));
    publish(&broker, &spec, &[numbered(11, "G", Some(2))]).await;
    let stop = CancellationToken::new();
    let (_consumer, task) = run_consumer(&db, cfg, handler, &stop);
    wait_until(LONG, "G held", || async {
        held(&db).await == [("G".to_owned(), 1)]
    })
    .await;
    publish(&broker, &spec, &[numbered(10, "G", Some(1))]).await;
    // 1 applies; 2's replay fails: G is parked with the handler's error,
    // no longer held (else, its hold run out, it was released each pass).
    parked_for_an_operator(&db, "poison").await;
    assert_eq!(applied(&db).await[&(1, "G".to_owned())], vec![10]);
    stop.cancel();
    task.await.unwrap().unwrap();
}
