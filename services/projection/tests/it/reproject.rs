//! The order views re-projected from the sources' current rows, with no
//! event history left (as past the archive): each view equals what the
//! rows say; the events that arrive afterwards count nothing twice, a
//! refund included; and a drifted view is repaired from the rows alone.

use std::time::Duration;

use contracts::event;
use projection::reproject::reproject;
use projection::verify::{Sources, Verifier};
use projection::views::{CONSUMER, Views};
use reliability::consumer::{Consumer, ConsumerConfig};
use reliability::outbox::Envelope;
use serde_json::json;
use testkit::{TestDb, amqp_url};

use super::order_event;

/// Tenant 1's order 1 as its events said it (`testkit::seeded_sources`).
fn order_one() -> Vec<Envelope> {
    let e = |id, source, event_type, payload| order_event(1, id, source, event_type, payload);
    vec![
        e(
            1,
            "orders",
            event::ORDER_PLACED,
            json!({"order_id": 1, "customer_id": "c1", "currency": "EUR", "total_cents": 1000, "lines": []}),
        ),
        e(
            2,
            "inventory",
            event::INVENTORY_RESERVED,
            json!({"order_id": 1, "customer_id": "c1", "currency": "EUR", "total_cents": 1000}),
        ),
        e(
            3,
            "payments",
            event::PAYMENT_CAPTURED,
            json!({"order_id": 1, "payment_id": 11, "amount_cents": 1000, "currency": "EUR"}),
        ),
        e(4, "orders", event::ORDER_CONFIRMED, json!({"order_id": 1})),
        e(
            5,
            "payments",
            event::REFUND_ISSUED,
            json!({"order_id": 1, "payment_id": 11, "refund_id": 5, "amount_cents": 300}),
        ),
    ]
}

async fn view(db: &TestDb, tenant: i64, order: i64) -> (String, String, String, i64) {
    sqlx::query_as(
        "SELECT status, payment_status, reservation_status, refunded_cents FROM order_views
         WHERE tenant_id = $1 AND order_id = $2",
    )
    .bind(tenant)
    .bind(order)
    .fetch_one(&db.owner)
    .await
    .unwrap()
}

#[tokio::test]
async fn views_re_projected_from_the_rows_alone_equal_their_sources_and_count_no_event_twice() {
    let dbs = testkit::seeded_sources().await;
    let sources = Sources {
        orders: dbs.orders.owner.clone(),
        inventory: dbs.inventory.owner.clone(),
        payments: dbs.payments.owner.clone(),
    };
    let db = TestDb::with_migrations(&projection::MIGRATIONS).await;
    let live = Consumer::new(
        db.app.clone(),
        &amqp_url(),
        ConsumerConfig::new(CONSUMER, "unused", &[]),
        Views,
    );
    // A chunk of 2: the walk crosses chunks and tenants.
    let verify = Verifier::new(db.owner.clone(), sources.clone(), Duration::ZERO, 2);
    let before = verify.run_once(false).await.unwrap();
    assert_eq!(before.differences.len(), 5, "no view yet: {before:#?}");

    let report = reproject(&db.owner, &sources).await.unwrap();
    assert_eq!(report.orders, 5);
    let after = verify.run_once(false).await.unwrap();
    assert!(after.differences.is_empty(), "{:#?}", after.differences);
    assert_eq!(
        view(&db, 1, 1).await,
        (
            "confirmed".into(),
            "captured".into(),
            "committed".into(),
            300
        )
    );

    // The events the rows already said, delivered late: nothing counts twice.
    for e in order_one() {
        live.apply(&e).await.unwrap();
    }
    assert_eq!(
        view(&db, 1, 1).await.3,
        300,
        "the refund's event and its fact count once"
    );
    // Again, beside those events: the same views.
    reproject(&db.owner, &sources).await.unwrap();
    let again = verify.run_once(false).await.unwrap();
    assert!(again.differences.is_empty(), "{:#?}", again.differences);

    // A view that drifted, with no event of its order anywhere: the
    // repair makes it again from the rows.
    sqlx::query("UPDATE order_views SET status = 'confirmed' WHERE tenant_id = 1 AND order_id = 2")
        .execute(&db.owner)
        .await
        .unwrap();
    let found = verify.run_once(true).await.unwrap();
    assert_eq!(found.differences.len(), 1, "{:#?}", found.differences);
    let mended = verify.run_once(false).await.unwrap();
    assert!(mended.differences.is_empty(), "{:#?}", mended.differences);

    db.cleanup().await;
    dbs.cleanup().await;
}
