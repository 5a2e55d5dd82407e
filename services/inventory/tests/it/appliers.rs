//! Stock under competing appliers (docs/adr/0010): orders that share skus
//! reserve, commit and release side by side without deadlocking, and end
//! where one applier in order ends.

use contracts::event;
use inventory::stock::{CONSUMER, Stock};
use reliability::outbox::Envelope;
use serde_json::json;
use testkit::{AppliersCheck, assert_competing_appliers_agree, event as ev};

const SKUS: [&str; 4] = ["SKU-A", "SKU-B", "SKU-C", "SKU-D"];

/// Order `n`'s lines: two or three skus out of four, in varying order, so
/// groups of different appliers want the same stock rows in other orders.
fn lines(n: i64) -> serde_json::Value {
    let picked: Vec<_> = (0..2 + n % 2)
        .map(|i| json!({"sku": SKUS[((n * 3 + i * (1 + n % 3)) % 4) as usize], "quantity": 1 + i, "unit_price_cents": 100}))
        .collect();
    json!(picked)
}

fn placed(n: i64) -> Envelope {
    let lines = if n % 11 == 0 {
        json!([{"sku": "SKU-UNKNOWN", "quantity": 1, "unit_price_cents": 100}])
    } else {
        lines(n)
    };
    ev(
        "orders",
        10 * n,
        1 + n % 2,
        ("order", n),
        event::ORDER_PLACED,
        json!({"order_id": n, "customer_id": "c", "currency": "EUR", "total_cents": 100, "lines": lines}),
    )
}

fn decided(n: i64) -> Envelope {
    let order = ("order", n);
    if n % 3 == 0 {
        ev(
            "orders",
            10 * n + 1,
            1 + n % 2,
            order,
            event::ORDER_CANCELLED,
            json!({"order_id": n, "reason": "payment_failed: declined"}),
        )
    } else {
        ev(
            "orders",
            10 * n + 1,
            1 + n % 2,
            order,
            event::ORDER_CONFIRMED,
            json!({"order_id": n}),
        )
    }
}

#[tokio::test]
async fn three_competing_consumers_reserve_and_settle_like_one_in_order() {
    let orders = 1..=60_i64;
    assert_competing_appliers_agree(
        AppliersCheck {
            migrations: &inventory::MIGRATIONS,
            consumer: CONSUMER,
            // A decision follows its order's reservation (the saga sees to
            // it); within each wave any order goes. Stock is ample, so which
            // order reserves first cannot change who gets it.
            waves: vec![orders.clone().map(placed).collect(), orders.map(decided).collect()],
            seed: "INSERT INTO products (tenant_id, sku, on_hand)
                   SELECT t, s, 1000 FROM generate_series(1, 2) t,
                          unnest(ARRAY['SKU-A', 'SKU-B', 'SKU-C', 'SKU-D']) s",
            state: "SELECT 'product' AS kind, tenant_id, sku AS id, on_hand::text AS a, reserved::text AS b FROM products
                    UNION ALL
                    SELECT 'reservation', tenant_id, order_id::text, status, reason FROM reservations
                    UNION ALL
                    SELECT 'line', tenant_id, order_id || '/' || sku, quantity::text, NULL FROM reservation_lines
                    UNION ALL
                    SELECT 'event', tenant_id, aggregate_id, event_type, count(*)::text FROM outbox_messages
                    GROUP BY tenant_id, aggregate_id, event_type",
        },
        || Stock,
    )
    .await;
}
