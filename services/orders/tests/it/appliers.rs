//! The saga's decision under competing appliers (docs/adr/0010): each
//! order is decided once, its outcome emitted once.

use contracts::event;
use orders::saga::{CONSUMER, Saga};
use reliability::outbox::Envelope;
use serde_json::json;
use testkit::{AppliersCheck, assert_competing_appliers_agree, event as ev};

/// The one decision order `n` gets: captured, declined or out of stock.
fn decision(n: i64) -> Envelope {
    let tenant = 1 + n % 2;
    match n % 3 {
        0 => ev(
            "payments",
            n,
            tenant,
            ("payment", 900 + n),
            event::PAYMENT_CAPTURED,
            json!({"order_id": n, "payment_id": 900 + n, "amount_cents": 100, "currency": "EUR"}),
        ),
        1 => ev(
            "payments",
            n,
            tenant,
            ("payment", 900 + n),
            event::PAYMENT_FAILED,
            json!({"order_id": n, "payment_id": 900 + n, "reason": "declined"}),
        ),
        _ => ev(
            "inventory",
            n,
            tenant,
            ("order", n),
            event::INVENTORY_REJECTED,
            json!({"order_id": n, "reason": "insufficient_stock: SKU-1"}),
        ),
    }
}

#[tokio::test]
async fn three_competing_consumers_decide_each_order_once_like_one_in_order() {
    assert_competing_appliers_agree(
        AppliersCheck {
            migrations: &orders::MIGRATIONS,
            consumer: CONSUMER,
            waves: vec![(1..=90).map(decision).collect()],
            seed: "INSERT INTO orders (tenant_id, order_id, customer_id, currency, total_cents)
                   OVERRIDING SYSTEM VALUE
                   SELECT 1 + n % 2, n, 'c', 'EUR', 100 FROM generate_series(1, 90) n",
            state: "SELECT o.tenant_id, o.order_id, status, cancel_reason,
                           (SELECT count(*) FROM outbox_messages m
                            WHERE m.tenant_id = o.tenant_id AND m.aggregate_id = o.order_id::text) AS emitted
                    FROM orders o",
        },
        || Saga,
    )
    .await;
}
