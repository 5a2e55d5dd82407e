//! Reservations through the consumer runtime on the real database.

use std::sync::Arc;

use contracts::event;
use inventory::stock::{CONSUMER, Stock};
use reliability::consumer::{Consumer, ConsumerConfig, Pg};
use reliability::outbox::Envelope;
use serde_json::{Value, json};
use testkit::amqp_url;

use crate::TestApp;

fn envelope(id: i64, event_type: &str, payload: Value) -> Envelope {
    Envelope {
        id,
        source: "orders".into(),
        tenant_id: 1,
        aggregate_type: "order".into(),
        aggregate_id: payload["order_id"].to_string(),
        event_type: event_type.into(),
        event_version: 1,
        occurred_at: chrono::Utc::now(),
        payload,
        aggregate_seq: None,
    }
}

fn placed(id: i64, order_id: i64, lines: Value) -> Envelope {
    envelope(
        id,
        event::ORDER_PLACED,
        json!({"order_id": order_id, "customer_id": "c", "currency": "EUR", "total_cents": 100, "lines": lines}),
    )
}

fn consumer(app: &TestApp) -> Consumer<Pg<Stock>> {
    Consumer::new(
        app.db.app.clone(),
        &amqp_url(),
        ConsumerConfig::new(CONSUMER, "unused", &[]),
        Stock,
    )
}

async fn product(app: &TestApp, sku: &str) -> (i64, i64) {
    sqlx::query_as("SELECT on_hand, reserved FROM products WHERE sku = $1")
        .bind(sku)
        .fetch_one(&app.db.owner)
        .await
        .unwrap()
}

async fn events(app: &TestApp, event_type: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE event_type = $1")
        .bind(event_type)
        .fetch_one(&app.db.owner)
        .await
        .unwrap()
}

#[tokio::test]
async fn twenty_concurrent_orders_for_ten_units_reserve_exactly_ten() {
    let app = TestApp::spawn().await;
    app.adjust(1, "seed", "LAST", 10).await;
    let stock = Arc::new(consumer(&app));
    let results = futures_util::future::join_all((1..=20).map(|i| {
        let stock = stock.clone();
        async move {
            stock
                .apply(&placed(
                    i,
                    1000 + i,
                    json!([{"sku": "LAST", "quantity": 1, "unit_price_cents": 5}]),
                ))
                .await
        }
    }))
    .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(
        product(&app, "LAST").await,
        (10, 10),
        "all ten reserved, never more"
    );
    assert_eq!(
        (
            events(&app, "InventoryReserved").await,
            events(&app, "InventoryRejected").await
        ),
        (10, 10)
    );

    // Confirm three, cancel the other seven reservations: three sold, seven back.
    let reserved: Vec<i64> = sqlx::query_scalar(
        "SELECT order_id FROM reservations WHERE status = 'reserved' ORDER BY order_id",
    )
    .fetch_all(&app.db.owner)
    .await
    .unwrap();
    for (n, order_id) in reserved.iter().enumerate() {
        let e = if n < 3 {
            envelope(
                100 + n as i64,
                event::ORDER_CONFIRMED,
                json!({"order_id": order_id}),
            )
        } else {
            envelope(
                100 + n as i64,
                event::ORDER_CANCELLED,
                json!({"order_id": order_id, "reason": "payment_failed"}),
            )
        };
        stock.apply(&e).await.unwrap();
    }
    assert_eq!(product(&app, "LAST").await, (7, 0));
    let (_, body) = app.api.get(1, "/products/LAST").await;
    assert_eq!(body["available"], 7);
    drop(stock);
    app.stop().await;
}

#[tokio::test]
async fn an_order_reserves_all_of_its_lines_or_none() {
    let app = TestApp::spawn().await;
    app.adjust(1, "a", "A", 5).await;
    app.adjust(1, "b", "B", 1).await;
    let stock = consumer(&app);
    stock.apply(&placed(1, 1, json!([{"sku": "A", "quantity": 2, "unit_price_cents": 1}, {"sku": "B", "quantity": 2, "unit_price_cents": 1}]))).await.unwrap();
    stock.apply(&placed(2, 2, json!([{"sku": "A", "quantity": 1, "unit_price_cents": 1}, {"sku": "GHOST", "quantity": 1, "unit_price_cents": 1}]))).await.unwrap();
    assert_eq!(product(&app, "A").await, (5, 0));
    assert_eq!(product(&app, "B").await, (1, 0));
    let reasons: Vec<String> = sqlx::query_scalar("SELECT payload->>'reason' FROM outbox_messages WHERE event_type = 'InventoryRejected' ORDER BY id")
        .fetch_all(&app.db.owner)
        .await
        .unwrap();
    assert_eq!(reasons, ["insufficient_stock: B", "unknown_sku: GHOST"]);

    // Two lines of one sku count together.
    stock.apply(&placed(3, 3, json!([{"sku": "A", "quantity": 3, "unit_price_cents": 1}, {"sku": "A", "quantity": 3, "unit_price_cents": 1}]))).await.unwrap();
    assert_eq!(product(&app, "A").await, (5, 0), "6 of A do not fit in 5");
    app.stop().await;
}

#[tokio::test]
async fn a_cancel_delivered_before_its_order_placed_leaves_nothing_reserved() {
    let app = TestApp::spawn().await;
    app.adjust(1, "a", "A", 5).await;
    let stock = consumer(&app);
    stock
        .apply(&envelope(
            2,
            event::ORDER_CANCELLED,
            json!({"order_id": 7, "reason": "x"}),
        ))
        .await
        .unwrap();
    stock
        .apply(&placed(
            1,
            7,
            json!([{"sku": "A", "quantity": 2, "unit_price_cents": 1}]),
        ))
        .await
        .unwrap();
    assert_eq!(product(&app, "A").await, (5, 0));
    assert_eq!(events(&app, "InventoryReserved").await, 0);
    app.stop().await;
}
