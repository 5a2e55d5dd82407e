//! I1 with relays side by side and batches in flight: no row twice, every return matched to its row, no wait on each other.

use reliability::TenantTx;
use reliability::outbox::{self, NewEvent};
use reliability::relay::Relay;
use serde_json::json;
use testkit::{TestDb, amqp_url, wait_until};

use crate::support::{Broker, DEADLINE, tenant};

use super::config;

#[tokio::test]
async fn two_relays_on_one_table_never_publish_a_row_twice() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    // 1000 rows in one transaction, 25 tenants.
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload)
         SELECT 1 + g % 25, 'test', 'agg-' || g, 'Added', jsonb_build_object('amount', g)
         FROM generate_series(1, 1000) g RETURNING id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();

    let mut cfg = config(&broker);
    cfg.batch_size = 25;
    let r1 = Relay::new(db.relay.clone(), &amqp_url(), cfg.clone());
    let r2 = Relay::new(db.relay.clone(), &amqp_url(), cfg);
    let (p1, p2) = (r1.publisher().await.unwrap(), r2.publisher().await.unwrap());
    // Both drain at once; SKIP LOCKED splits the rows between them. A
    // relay that finds every due row locked stops early, so one more pass
    // each collects whatever the other still held.
    let (a, b) = tokio::join!(async { r1.drain(&p1).await.unwrap() }, async {
        r2.drain(&p2).await.unwrap()
    });
    let (a2, b2) = (r1.drain(&p1).await.unwrap(), r2.drain(&p2).await.unwrap());
    let published = a.published + b.published + a2.published + b2.published;
    assert_eq!(published, 1000);
    assert!(
        a.published > 0 && b.published > 0,
        "both relays did work: {a:?} {b:?}"
    );

    wait_until(DEADLINE, "all published messages routed", || async {
        broker.depth(&queue).await == 1000
    })
    .await;
    let got = broker.take_all(&queue).await;
    let mut seen: Vec<i64> = got.iter().map(|e| e.id).collect();
    seen.sort_unstable();
    let mut expected = ids.clone();
    expected.sort_unstable();
    assert_eq!(seen, expected, "every row exactly once");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// With several batches in flight on one channel, a return can reach a
/// confirm of another batch: each row's fate must still follow its own id.
#[tokio::test]
async fn a_window_of_batches_in_flight_matches_every_return_to_its_row() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.Routed"]).await;
    let mut cfg = config(&broker);
    cfg.batch_size = 20;
    cfg.batches_in_flight = 3;
    let relay = Relay::new(db.relay.clone(), &amqp_url(), cfg);
    let publisher = relay.publisher().await.unwrap();
    let mut rng = crate::support::Rng::new(11);
    let (mut routed, mut stray) = (Vec::new(), Vec::new());
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    for i in 0..400 {
        let kind = if rng.below(3) == 0 { "Stray" } else { "Routed" };
        let id = outbox::enqueue(
            &mut tx,
            &NewEvent::new("test", format!("w-{i}"), kind, &json!({"amount": 1})).unwrap(),
        )
        .await
        .unwrap();
        if kind == "Routed" {
            routed.push(id)
        } else {
            stray.push(id)
        }
    }
    tx.commit().await.unwrap();
    let report = relay.relay_window(&publisher).await.unwrap();
    assert_eq!(
        (report.claimed, report.published, report.failed),
        (400, routed.len(), stray.len())
    );
    let processed: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox_messages WHERE processed_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert_eq!(processed, routed);
    let mut got: Vec<i64> = broker.take_all(&queue).await.iter().map(|e| e.id).collect();
    got.sort_unstable();
    assert_eq!(got, routed);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// Relays with batches in flight share one small pool: none may hold claims
/// while it waits for another connection (each would wait on the others).
#[tokio::test]
async fn relays_with_batches_in_flight_never_wait_on_each_other_for_connections() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    for i in 0..2_000 {
        outbox::enqueue(
            &mut tx,
            &NewEvent::new("test", format!("p-{i}"), "Added", &json!({"amount": 1})).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let pool = db.pool_as(reliability::db::RELAY_ROLE, 3).await;
    let mut cfg = config(&broker);
    cfg.batch_size = 50;
    cfg.batches_in_flight = 3;
    let drains: Vec<_> = (0..4)
        .map(|_| {
            let relay = Relay::new(pool.clone(), &amqp_url(), cfg.clone());
            tokio::spawn(async move {
                let publisher = relay.publisher().await?;
                relay.drain(&publisher).await
            })
        })
        .collect();
    let mut published = 0;
    for d in drains {
        published += tokio::time::timeout(DEADLINE, d)
            .await
            .expect("drained in time")
            .unwrap()
            .unwrap()
            .published;
    }
    assert_eq!(published, 2_000);
    pool.close().await;
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

/// The window's later batches take a connection only if one is free at
/// once. A pool whose idle connections were reaped (or never opened) has
/// none idle but room for more: the window must open them, not shrink to
/// one batch at a time.
#[tokio::test]
async fn the_window_opens_connections_a_reaped_pool_no_longer_holds() {
    let db = TestDb::new().await;
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    for i in 0..600 {
        outbox::enqueue(
            &mut tx,
            &NewEvent::new("test", format!("w-{i}"), "Added", &json!({"amount": 1})).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let pool = db.pool_as(reliability::db::RELAY_ROLE, 3).await;
    assert!(pool.size() <= 1, "a fresh pool, as after idle reaping");
    let mut cfg = config(&broker);
    cfg.batch_size = 100;
    cfg.batches_in_flight = 3;
    let relay = Relay::new(pool.clone(), &amqp_url(), cfg);
    let publisher = relay.publisher().await.unwrap();
    let report = relay.relay_window(&publisher).await.unwrap();
    assert_eq!(report.published, 600);
    assert_eq!(
        pool.size(),
        3,
        "the window held 3 batches, one connection each"
    );
    assert_eq!(broker.take_all(&queue).await.len(), 600);
    pool.close().await;
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}
