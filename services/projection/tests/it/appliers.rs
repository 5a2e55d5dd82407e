//! The projection under competing appliers (docs/adr/0010): every event of
//! an order recomputes its view, so two appliers of one order's events must
//! take turns or the later write loses the other's event.

use contracts::event;
use projection::views::{CONSUMER, Views};
use reliability::outbox::Envelope;
use serde_json::json;
use testkit::{AppliersCheck, assert_competing_appliers_agree, event as ev};

/// Orders of two tenants, each with its whole life: placed, reserved,
/// paid or declined, decided, sometimes refunded. Payment events name the
/// payment as their aggregate, as payments publishes them.
fn lives() -> Vec<Envelope> {
    let mut events = Vec::new();
    for n in 1..=12_i64 {
        let tenant = 1 + n % 2;
        let o = json!(n);
        let order = ("order", n);
        let payment = ("payment", 500 + n);
        events.push(ev("orders", 100 * n, tenant, order, event::ORDER_PLACED,
            json!({"order_id": o, "customer_id": "c", "currency": "EUR", "total_cents": 100 * n, "lines": []})));
        events.push(ev(
            "inventory",
            100 * n,
            tenant,
            order,
            event::INVENTORY_RESERVED,
            json!({"order_id": o, "customer_id": "c", "currency": "EUR", "total_cents": 100 * n}),
        ));
        if n % 3 == 0 {
            events.push(ev(
                "payments",
                100 * n,
                tenant,
                payment,
                event::PAYMENT_FAILED,
                json!({"order_id": o, "payment_id": 500 + n, "reason": "declined"}),
            ));
            events.push(ev(
                "orders",
                100 * n + 1,
                tenant,
                order,
                event::ORDER_CANCELLED,
                json!({"order_id": o, "reason": "payment_failed: declined"}),
            ));
        } else {
            events.push(ev("payments", 100 * n, tenant, payment, event::PAYMENT_CAPTURED,
                json!({"order_id": o, "payment_id": 500 + n, "amount_cents": 100 * n, "currency": "EUR"})));
            events.push(ev(
                "orders",
                100 * n + 1,
                tenant,
                order,
                event::ORDER_CONFIRMED,
                json!({"order_id": o}),
            ));
            for r in 1..=12 {
                events.push(ev("payments", 100 * n + r, tenant, payment, event::REFUND_ISSUED,
                    json!({"order_id": o, "payment_id": 500 + n, "refund_id": r, "amount_cents": 10 * r})));
            }
        }
    }
    events
}

#[tokio::test]
async fn three_competing_consumers_build_the_same_views_as_one_in_order() {
    assert_competing_appliers_agree(
        AppliersCheck {
            migrations: &projection::MIGRATIONS,
            consumer: CONSUMER,
            // The view is a function of the set of events: any order goes.
            waves: vec![lives()],
            seed: "",
            state: "SELECT v.tenant_id, v.order_id, status, total_cents, currency, payment_status,
                           reservation_status, refunded_cents,
                           (SELECT count(*) FROM order_view_events e
                            WHERE e.tenant_id = v.tenant_id AND e.order_id = v.order_id) AS events
                    FROM order_views v",
        },
        || Views,
    )
    .await;
}
