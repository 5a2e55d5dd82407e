//! The saga's decisions, applied through the consumer runtime on the real database.

use contracts::event;
use orders::saga::{CONSUMER, Saga};
use reliability::consumer::{Consumer, ConsumerConfig, Outcome};
use reliability::outbox::Envelope;
use serde_json::{Value, json};
use testkit::amqp_url;

use crate::{ORDER, TestApp};

fn envelope(id: i64, source: &str, event_type: &str, payload: Value) -> Envelope {
    Envelope {
        id,
        source: source.into(),
        tenant_id: 1,
        aggregate_type: "x".into(),
        aggregate_id: "1".into(),
        event_type: event_type.into(),
        event_version: 1,
        occurred_at: chrono::Utc::now(),
        payload,
        aggregate_seq: None,
    }
}

async fn status(app: &TestApp, order_id: i64) -> (String, Option<String>) {
    sqlx::query_as("SELECT status, cancel_reason FROM orders WHERE order_id = $1")
        .bind(order_id)
        .fetch_one(&app.db.owner)
        .await
        .unwrap()
}

async fn emitted(app: &TestApp) -> Vec<String> {
    sqlx::query_scalar("SELECT event_type FROM outbox_messages ORDER BY id")
        .fetch_all(&app.db.owner)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_captured_payment_confirms_once_and_a_late_failure_changes_nothing() {
    let app = TestApp::spawn().await;
    let (_, _, order) = app.place(1, "k", ORDER).await;
    let id = order["order_id"].as_i64().unwrap();
    let saga = Consumer::new(
        app.db.app.clone(),
        &amqp_url(),
        ConsumerConfig::new(CONSUMER, "unused", &[]),
        Saga,
    );

    let captured = envelope(
        1,
        "payments",
        event::PAYMENT_CAPTURED,
        json!({"order_id": id, "payment_id": 5, "amount_cents": 2599, "currency": "EUR"}),
    );
    assert_eq!(saga.apply(&captured).await.unwrap(), Outcome::Applied);
    assert_eq!(saga.apply(&captured).await.unwrap(), Outcome::Duplicate);
    assert_eq!(status(&app, id).await, ("confirmed".into(), None));

    let failed = envelope(
        2,
        "payments",
        event::PAYMENT_FAILED,
        json!({"order_id": id, "payment_id": 5, "reason": "declined"}),
    );
    assert_eq!(saga.apply(&failed).await.unwrap(), Outcome::Applied);
    assert_eq!(status(&app, id).await.0, "confirmed");
    assert_eq!(emitted(&app).await, ["OrderPlaced", "OrderConfirmed"]);
    let (_, body) = app.get(1, &format!("/orders/{id}")).await;
    assert_eq!(body["status"], "confirmed");
    app.stop().await;
}

#[tokio::test]
async fn a_rejection_or_failure_cancels_with_its_reason() {
    let app = TestApp::spawn().await;
    let saga = Consumer::new(
        app.db.app.clone(),
        &amqp_url(),
        ConsumerConfig::new(CONSUMER, "unused", &[]),
        Saga,
    );
    let (_, _, a) = app.place(1, "a", ORDER).await;
    let (_, _, b) = app.place(1, "b", ORDER).await;
    let (a, b) = (
        a["order_id"].as_i64().unwrap(),
        b["order_id"].as_i64().unwrap(),
    );

    saga.apply(&envelope(
        1,
        "inventory",
        event::INVENTORY_REJECTED,
        json!({"order_id": a, "reason": "insufficient_stock"}),
    ))
    .await
    .unwrap();
    saga.apply(&envelope(
        1,
        "payments",
        event::PAYMENT_FAILED,
        json!({"order_id": b, "payment_id": 9, "reason": "declined"}),
    ))
    .await
    .unwrap();
    assert_eq!(
        status(&app, a).await,
        (
            "cancelled".into(),
            Some("inventory_rejected: insufficient_stock".into())
        )
    );
    assert_eq!(
        status(&app, b).await,
        ("cancelled".into(), Some("payment_failed: declined".into()))
    );
    let (_, body) = app.get(1, &format!("/orders/{a}")).await;
    assert_eq!(
        body["cancel_reason"],
        "inventory_rejected: insufficient_stock"
    );

    let cancelled: Vec<Value> = sqlx::query_scalar(
        "SELECT payload FROM outbox_messages WHERE event_type = 'OrderCancelled' ORDER BY id",
    )
    .fetch_all(&app.db.owner)
    .await
    .unwrap();
    assert_eq!(cancelled.len(), 2);
    assert_eq!(cancelled[0]["order_id"], a);

    // A payload of the wrong shape or version is permanent, never applied.
    let bad = envelope(
        3,
        "payments",
        event::PAYMENT_CAPTURED,
        json!({"order": "?"}),
    );
    assert!(saga.apply(&bad).await.is_err());
    let mut v2 = envelope(
        4,
        "payments",
        event::PAYMENT_CAPTURED,
        json!({"order_id": a, "payment_id": 1, "amount_cents": 1, "currency": "EUR"}),
    );
    v2.event_version = 2;
    assert!(saga.apply(&v2).await.is_err());
    assert_eq!(status(&app, a).await.0, "cancelled");
    app.stop().await;
}
