//! The whole stack with `RELAY_MODE=log` (docs/adr/0038): each service's
//! outbox reaches the broker through a logical replication slot of its
//! database, and twenty orders for ten units still sell exactly ten, each
//! settled everywhere, the ordered history included. Skipped where the
//! server's `wal_level` is not `logical`, except under
//! `LOG_RELAY_TESTS=required` (CI).

use std::sync::Arc;

use e2e::Stack;
use service_kit::service::RelayMode;
use testkit::{DEADLINE, wait_until};

#[tokio::test]
async fn with_the_log_relay_twenty_orders_for_ten_units_sell_exactly_ten_and_every_view_settles() {
    let admin = sqlx::PgPool::connect(&testkit::database_url())
        .await
        .unwrap();
    if !testkit::logical_decoding(&admin).await {
        return;
    }
    let stack = Arc::new(
        Stack::start_with(|c| c.relay.mode = RelayMode::Log)
            .await
            .unwrap(),
    );
    for db in [&stack.dbs.orders, &stack.dbs.inventory, &stack.dbs.payments] {
        wait_until(
            DEADLINE,
            "each source's log relay holds its slot",
            || async {
                let slot = log_relay::slot_for(&db.url());
                log_relay::slot_status(&db.admin, &slot)
                    .await
                    .unwrap()
                    .is_some_and(|s| s.active)
            },
        )
        .await;
    }
    let (ids, confirmed) = stack.race_for_ten(1, "HOT").await;
    for id in &ids {
        let path = format!("/history/order/{id}");
        wait_until(DEADLINE, "the order's history, placed first", || async {
            let (_, h) = stack.projection.get(1, &path).await;
            h[0]["type"] == "OrderPlaced" && h.as_array().is_some_and(|h| h.len() == 2)
        })
        .await;
    }
    assert_eq!(confirmed, 10);
    assert_eq!(stack.psp.total_charges(), 10);
    Arc::into_inner(stack).unwrap().stop().await;
}
