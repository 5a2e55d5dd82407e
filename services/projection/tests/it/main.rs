//! The projection against the real PostgreSQL: the view is the same
//! whatever order (and however often) its events arrive.

mod appliers;
mod history;
mod reproject;

use contracts::event;
use projection::views::{CONSUMER, Views};
use projection::{SERVICE, Settings};
use reliability::consumer::{Consumer, ConsumerConfig};
use reliability::outbox::Envelope;
use serde_json::{Value, json};
use service_kit::service::{Role, ShutdownToken};
use testkit::{ApiClient, TestDb, amqp_url, unique};

pub(crate) async fn spawn() -> (ApiClient, TestDb, ShutdownToken) {
    let db = TestDb::with_migrations(&projection::MIGRATIONS).await;
    let mut common = testkit::common_settings();
    common.exchange = unique("reltest.projection.");
    let settings = Settings {
        role: Role::Serve,
        ..Settings::local(common)
    };
    let app = testkit::serve(&SERVICE, settings, db.databases()).await;
    (app.api, db, app.stop)
}

/// An event of tenant 1's order `order_id`, outbox id `id` of `source`,
/// `id` seconds into the test's time.
pub(crate) fn order_event(
    order_id: i64,
    id: i64,
    source: &str,
    event_type: &str,
    payload: Value,
) -> Envelope {
    Envelope {
        id,
        source: source.into(),
        tenant_id: 1,
        aggregate_type: "order".into(),
        aggregate_id: order_id.to_string(),
        event_type: event_type.into(),
        event_version: 1,
        occurred_at: chrono::DateTime::from_timestamp(1_700_000_000 + id, 0).unwrap(),
        payload,
        aggregate_seq: None,
    }
}

/// The life of one order: placed, reserved, captured, confirmed, refunded.
fn life(order_id: i64) -> Vec<Envelope> {
    let e = |id: i64, source: &str, event_type: &str, payload: Value| Envelope {
        occurred_at: chrono::DateTime::from_timestamp(1_700_000_000 + id, 0).unwrap(),
        ..order_event(order_id, id + 100 * order_id, source, event_type, payload)
    };
    vec![
        e(
            1,
            "orders",
            event::ORDER_PLACED,
            json!({"order_id": order_id, "customer_id": "c", "currency": "EUR", "total_cents": 2500, "lines": []}),
        ),
        e(
            2,
            "inventory",
            event::INVENTORY_RESERVED,
            json!({"order_id": order_id, "customer_id": "c", "currency": "EUR", "total_cents": 2500}),
        ),
        e(
            3,
            "payments",
            event::PAYMENT_CAPTURED,
            json!({"order_id": order_id, "payment_id": 9, "amount_cents": 2500, "currency": "EUR"}),
        ),
        e(
            4,
            "orders",
            event::ORDER_CONFIRMED,
            json!({"order_id": order_id}),
        ),
        e(
            5,
            "payments",
            event::REFUND_ISSUED,
            json!({"order_id": order_id, "payment_id": 9, "refund_id": 1, "amount_cents": 500}),
        ),
    ]
}

#[tokio::test]
async fn the_view_is_the_same_whatever_the_delivery_order_and_count() {
    let (api, db, stop) = spawn().await;
    let views = Consumer::new(
        db.app.clone(),
        &amqp_url(),
        ConsumerConfig::new(CONSUMER, "unused", &[]),
        Views,
    );
    let (status, _) = api.get(1, "/orders/1").await;
    assert_eq!(status, 404, "nothing arrived yet");

    for e in life(1) {
        views.apply(&e).await.unwrap();
    }
    let mut reversed = life(2);
    reversed.reverse();
    for e in reversed.iter().chain(reversed.iter()) {
        views.apply(e).await.unwrap();
    }
    let (s1, mut one) = api.get(1, "/orders/1").await;
    let (s2, mut two) = api.get(1, "/orders/2").await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(
        one,
        json!({"order_id": 1, "status": "confirmed", "total_cents": 2500, "currency": "EUR", "payment_status": "captured",
               "reservation_status": "committed", "refunded_cents": 500, "events": one["events"].clone()})
    );
    let types: Vec<&str> = one["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "OrderPlaced",
            "InventoryReserved",
            "PaymentCaptured",
            "OrderConfirmed",
            "RefundIssued"
        ]
    );
    one["order_id"] = json!(0);
    two["order_id"] = json!(0);
    assert_eq!(one, two, "same events, other order: same view");

    let (status, _) = api.get(2, "/orders/1").await;
    assert_eq!(status, 404, "another tenant sees nothing");
    stop.cancel();
    db.cleanup().await;
}

#[tokio::test]
async fn a_cancelled_order_shows_its_reservation_released() {
    let (api, db, stop) = spawn().await;
    let views = Consumer::new(
        db.app.clone(),
        &amqp_url(),
        ConsumerConfig::new(CONSUMER, "unused", &[]),
        Views,
    );
    let mut events = life(3);
    events.truncate(2);
    events.push(Envelope {
        id: 9_999,
        event_type: event::PAYMENT_FAILED.into(),
        source: "payments".into(),
        payload: json!({"order_id": 3, "payment_id": 1, "reason": "declined"}),
        aggregate_seq: None,
        ..events[0].clone()
    });
    events.push(Envelope {
        id: 10_000,
        event_type: event::ORDER_CANCELLED.into(),
        payload: json!({"order_id": 3, "reason": "payment_failed: declined"}),
        aggregate_seq: None,
        ..events[0].clone()
    });
    for e in events.iter().rev() {
        views.apply(e).await.unwrap();
    }
    let (_, view) = api.get(1, "/orders/3").await;
    assert_eq!(
        (
            view["status"].as_str(),
            view["payment_status"].as_str(),
            view["reservation_status"].as_str()
        ),
        (Some("cancelled"), Some("failed"), Some("released"))
    );
    stop.cancel();
    db.cleanup().await;
}
