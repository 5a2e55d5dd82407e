//! The HTTP contract of inventory.

use serde_json::json;

use crate::TestApp;

#[tokio::test]
async fn a_positive_adjustment_creates_the_sku_and_later_ones_add_up() {
    let app = TestApp::spawn().await;
    let (status, _, body) = app.adjust(1, "a1", "SKU-1", 100).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        body,
        json!({"sku": "SKU-1", "on_hand": 100, "reserved": 0, "available": 100})
    );
    let (status, _, body) = app.adjust(1, "a2", "SKU-1", -30).await;
    assert_eq!((status, body["on_hand"].as_i64()), (201, Some(70)));
    let (status, body) = app.api.get(1, "/products/SKU-1").await;
    assert_eq!((status, body["available"].as_i64()), (200, Some(70)));
    let events: Vec<String> = sqlx::query_scalar("SELECT event_type FROM outbox_messages")
        .fetch_all(&app.db.owner)
        .await
        .unwrap();
    assert_eq!(events, ["StockAdjusted", "StockAdjusted"]);
    app.stop().await;
}

#[tokio::test]
async fn adjustments_below_reserved_or_invalid_get_422_and_change_nothing() {
    let app = TestApp::spawn().await;
    app.adjust(1, "seed", "SKU-1", 10).await;
    sqlx::query("UPDATE products SET reserved = 6")
        .execute(&app.db.owner)
        .await
        .unwrap();

    let (status, _, err) = app.adjust(1, "too-far", "SKU-1", -5).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("insufficient_stock"))
    );
    let (status, _, _) = app.adjust(1, "unknown-negative", "SKU-NEW", -1).await;
    assert_eq!(status, 422);
    for (i, body) in [
        json!({"sku": "SKU-1", "delta": 0, "reason": "r"}),
        json!({"sku": "", "delta": 1, "reason": "r"}),
        json!({"sku": "SKU-1", "delta": 1, "reason": ""}),
        json!({"sku": "SKU-1", "delta": 1, "reason": "nul\u{0}byte"}),
        json!({"sku": "SKU-1", "delta": 2_000_000_000i64, "reason": "r"}),
        json!({"sku": "SKU-1", "delta": i64::MIN, "reason": "overflows abs()"}),
        json!({"sku": "SKU-1", "delta": i64::MAX, "reason": "r"}),
        json!({"sku": "SKU-1", "delta": "1", "reason": "r"}),
    ]
    .iter()
    .enumerate()
    {
        let (status, _, err) = app
            .api
            .post(
                1,
                "/stock/adjustments",
                &format!("bad-{i}"),
                &body.to_string(),
            )
            .await;
        assert_eq!(status, 422, "{body} -> {err}");
    }
    let (_, body) = app.api.get(1, "/products/SKU-1").await;
    assert_eq!(
        body,
        json!({"sku": "SKU-1", "on_hand": 10, "reserved": 6, "available": 4})
    );
    let (status, _) = app.api.get(1, "/products/SKU-NEW").await;
    assert_eq!(status, 404);
    let adjustments: i64 = sqlx::query_scalar("SELECT count(*) FROM stock_adjustments")
        .fetch_one(&app.db.owner)
        .await
        .unwrap();
    assert_eq!(adjustments, 1);

    // A stock level that an adjustment would push past i64: 422, unchanged.
    sqlx::query("UPDATE products SET on_hand = 9223372036854775800, reserved = 0")
        .execute(&app.db.owner)
        .await
        .unwrap();
    let (status, _, err) = app.adjust(1, "overflow", "SKU-1", 1000).await;
    assert_eq!(status, 422, "{err}");
    let (_, body) = app.api.get(1, "/products/SKU-1").await;
    assert_eq!(body["on_hand"], 9_223_372_036_854_775_800i64);
    app.stop().await;
}

#[tokio::test]
async fn another_tenants_product_is_not_found_and_their_stock_is_their_own() {
    let app = TestApp::spawn().await;
    app.adjust(1, "k", "SKU-1", 5).await;
    let (status, body) = app.api.get(2, "/products/SKU-1").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    // Tenant 2 may use the same sku for its own product.
    let (status, _, body) = app.adjust(2, "k", "SKU-1", 1).await;
    assert_eq!((status, body["on_hand"].as_i64()), (201, Some(1)));
    let (_, body) = app.api.get(1, "/products/SKU-1").await;
    assert_eq!(body["on_hand"], 5);
    app.stop().await;
}
