//! Recording payments under competing appliers (docs/adr/0010): one
//! payment per order, whoever applies its reservation.

use contracts::event;
use payments::charges::{CONSUMER, Charges};
use serde_json::json;
use testkit::{AppliersCheck, assert_competing_appliers_agree, event as ev};

#[tokio::test]
async fn three_competing_consumers_record_one_payment_per_order_like_one_in_order() {
    let reserved = (1..=90_i64)
        .map(|n| {
            ev("inventory", n, 1 + n % 2, ("order", n), event::INVENTORY_RESERVED,
                json!({"order_id": n, "customer_id": format!("c-{n}"), "currency": "EUR", "total_cents": 100 * n}))
        })
        .collect();
    assert_competing_appliers_agree(
        AppliersCheck {
            migrations: &payments::MIGRATIONS,
            consumer: CONSUMER,
            waves: vec![reserved],
            seed: "",
            state: "SELECT tenant_id, order_id, customer_id, amount_cents, currency, status FROM payments",
        },
        || Charges,
    )
    .await;
}
