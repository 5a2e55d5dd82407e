//! A partition changing hands keeps its order: the replica that lets go
//! hands back what it holds before its standby is given anything later.

use super::*;

/// Replica A holds aggregate A's partition and is stuck retrying event 5,
/// with the events after it delivered and unacked; B stands by. Then A
/// lets go: it stops (a rolling restart), or its other lane crashes. B
/// must get 5 and the rest A held before any later event. Were A's
/// consumer cancelled before its channel closed, the quorum queue would
/// keep A's deliveries checked out to it and make B active at once: B
/// would apply a later event first (a gap is allowed) and then park 5 as
/// out of order.
///
/// How soon a cancel reaches the queue is a race, so without the fixes
/// these fail only sometimes, and so did the 3-relay test (about one run
/// in twenty under load). Checked once: with half a second between the
/// drop of the consumers and the close, the stop case failed every time
/// (B applied 8 first, then parked 5-7).
async fn handover(crash_the_other_lane: bool) {
    let db = TestDb::new().await;
    create_applied_table(&db).await;
    let broker = Broker::new().await;
    let spec = spec(&broker, 2);
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    for n in 0..60 {
        outbox::enqueue(
            &mut tx,
            &NewEvent::new("test", "A", "Changed", &json!({ "n": n })).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let stop = CancellationToken::new();
    let relay = spawn_relay(&db, &broker, &spec, &stop);

    let crash = consumer_config(&spec).fail_points;
    let config = |fail_points| {
        let mut cfg = consumer_config(&spec);
        cfg.max_attempts = u32::MAX;
        cfg.fail_points = fail_points;
        cfg
    };
    let a_handler = Recording::default();
    a_handler.stuck.lock().unwrap().insert(("A".into(), 5));
    let a_stop = CancellationToken::new();
    let (a, a_task) = run_consumer(&db, config(crash.clone()), a_handler, &a_stop);
    wait_until(LONG, "A applied 1-4 and retries 5", || async {
        a.stats().retries > 0 && a.stats().applied == 4
    })
    .await;
    // B's lanes report ready once they consume: standing by.
    let health = reliability::health::Health::default();
    let b_handler = Recording {
        replica: 1,
        ..Recording::default()
    };
    let b = Arc::new(
        Consumer::new(
            db.app.clone(),
            &amqp_url(),
            config(Default::default()),
            b_handler,
        )
        .with_health(health.clone()),
    );
    let b_task = tokio::spawn({
        let (b, stop) = (b.clone(), stop.clone());
        async move { b.run(stop).await }
    });
    wait_until(LONG, "B stands by", || async {
        let (ready, parts) = health.report();
        ready && parts.len() == 2
    })
    .await;

    if crash_the_other_lane {
        // The first commit crashes A: one on the other partition, since
        // A's lane on this one is stuck.
        crash.arm(failpoint::CONSUMER_BEFORE_COMMIT, Action::Error);
        let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
        for z in 0..8 {
            outbox::enqueue(
                &mut tx,
                &NewEvent::new("test", format!("z{z}"), "Changed", &json!({})).unwrap(),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
        let crashed = a_task.await.unwrap();
        assert!(
            matches!(crashed, Err(reliability::Error::FailPoint(_))),
            "{crashed:?}"
        );
    } else {
        a_stop.cancel();
        a_task.await.unwrap().unwrap();
    }
    all_applied_in_outbox_order(&db).await;
    assert_eq!(
        b.stats().applied as usize,
        56 + if crash_the_other_lane { 8 } else { 0 }
    );

    stop.cancel();
    relay.await.unwrap().unwrap();
    b_task.await.unwrap().unwrap();
    broker.cleanup_ordered(&spec).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_stopping_replica_hands_back_its_unacked_events_before_its_standby_gets_later_ones() {
    handover(false).await;
}

#[tokio::test]
async fn a_replica_whose_other_lane_crashed_hands_back_its_unacked_events_in_order() {
    handover(true).await;
}
