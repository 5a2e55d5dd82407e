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

async fn logical() -> bool {
    let admin = sqlx::PgPool::connect(&testkit::database_url())
        .await
        .unwrap();
    let level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&admin)
        .await
        .unwrap();
    if level == "logical" {
        return true;
    }
    assert!(
        std::env::var("LOG_RELAY_TESTS").as_deref() != Ok("required"),
        "wal_level is {level}: CI sets it to logical (.ci/run)"
    );
    eprintln!("skipped: wal_level is {level}, not logical");
    false
}

#[tokio::test]
async fn with_the_log_relay_twenty_orders_for_ten_units_sell_exactly_ten_and_every_view_settles() {
    if !logical().await {
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
    stack.stock(1, "HOT", 10).await;
    let ids = futures_util::future::join_all((0..20).map(|i| {
        let stack = stack.clone();
        async move { stack.order(1, &format!("c-{i}"), "HOT", 1).await }
    }))
    .await;
    let mut confirmed = 0;
    for id in &ids {
        let view = stack.settled(1, *id).await;
        if view["status"] == "confirmed" {
            confirmed += 1;
        }
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
