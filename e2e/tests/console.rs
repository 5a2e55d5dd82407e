//! The operator's console in a real browser against a whole stack started
//! by the test (issue 45): Playwright drives Debian's chromium (see
//! `testkit::browser`) through two incidents of one order.
//!
//! - A poison message: orders' saga cannot confirm the order (a check
//!   constraint a bad migration left), so its `PaymentCaptured` is
//!   dead-lettered with the database's error. The overview shows the dead
//!   letter, the group page its cause; after the fix, a click re-drives it
//!   and the order completes.
//! - A parked aggregate: the projection's history refuses the order's
//!   `OrderPlaced` (another constraint), parks the order, and keeps its
//!   later `OrderConfirmed` waiting behind it. After the fix, a click
//!   unparks it, and the history holds both, in order.
//!
//! The fixes (dropping the constraints) are made before the browser
//! starts, as a deploy would; the letter and the parked order wait for an
//! operator all the same. Screenshots go to
//! `target/tmp/console-stack-screenshots/`.

use std::path::Path;
use std::sync::Arc;

use e2e::Stack;
use operator::console::{self, Auth, Console};
use operator::ops;
use testkit::{DEADLINE, browser, wait_until};

mod support;

const TOKEN: &str = "stack-browser-test-token";

/// The console over `stack`, on a spare port: its URL.
async fn serve(stack: &Stack) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let roles = stack
        .ops_ports
        .iter()
        .map(|(service, port)| ops::roles::RoleProbe {
            service: (*service).to_owned(),
            role: "all",
            port: *port,
        })
        .collect();
    let console = Console {
        estate: support::estate(stack).await,
        auth: Auth::token(TOKEN),
        read_only: false,
        psp_url: stack.psp_url.clone(),
        limits: service_kit::admission::AdmissionLimits::parse(1000, "", Default::default())
            .unwrap(),
        roles,
        samples: Arc::default(),
    };
    tokio::spawn(console::serve(listener, console));
    url
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_operator_re_drives_a_poison_message_and_unparks_an_order_in_chromium_and_it_completes()
{
    if !browser::available() {
        return;
    }
    let stack = Stack::start().await.unwrap();
    let (orders, history) = (&stack.dbs.orders.owner, &stack.dbs.projection.owner);
    sqlx::raw_sql(
        "ALTER TABLE orders ADD CONSTRAINT held_for_review CHECK (status <> 'confirmed') NOT VALID",
    )
    .execute(orders)
    .await
    .unwrap();
    sqlx::raw_sql(
        "ALTER TABLE aggregate_history ADD CONSTRAINT no_placed_orders
           CHECK (event_type <> 'OrderPlaced') NOT VALID",
    )
    .execute(history)
    .await
    .unwrap();
    stack.stock(1, "SKU-C", 5).await;
    let order_id = stack.order(1, "c-console", "SKU-C", 1).await;
    let dlq = reliability::broker::dead_letter_queue(&format!(
        "{}{}",
        stack.common.queue_prefix,
        contracts::topology::ORDERS_SAGA.consumer
    ));
    let broker = testkit::Broker::new().await;
    wait_until(
        DEADLINE,
        "the saga's PaymentCaptured dead-lettered, the order parked in the history",
        || async {
            broker.depth(&dlq).await == 1
                && count(history, "SELECT count(*) FROM parked_aggregates").await == 1
        },
    )
    .await;
    // The fixes, deployed; nothing moves until an operator says so.
    sqlx::raw_sql("ALTER TABLE orders DROP CONSTRAINT held_for_review")
        .execute(orders)
        .await
        .unwrap();
    sqlx::raw_sql("ALTER TABLE aggregate_history DROP CONSTRAINT no_placed_orders")
        .execute(history)
        .await
        .unwrap();

    let url = serve(&stack).await;
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-stack-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let args = vec![
        url,
        TOKEN.into(),
        shots.display().to_string(),
        "1".into(),
        order_id.to_string(),
    ];
    let (passed, said) = browser::run("stack.mjs", args, 240).await;
    assert!(
        passed,
        "the browser run failed (screenshots in {}):\n{said}",
        shots.display()
    );

    // What the clicks did, in the stores themselves.
    let view = stack.settled(1, order_id).await;
    assert_eq!(view["status"], "confirmed", "{view}");
    assert_eq!(broker.depth(&dlq).await, 0);
    let path = format!("/history/order/{order_id}");
    wait_until(DEADLINE, "the order's history, in order", || async {
        let (_, h) = stack.projection.get(1, &path).await;
        let types: Vec<&str> = h
            .as_array()
            .map(|e| e.iter().filter_map(|e| e["type"].as_str()).collect())
            .unwrap_or_default();
        types == ["OrderPlaced", "OrderConfirmed"]
    })
    .await;
    assert_eq!(
        count(history, "SELECT count(*) FROM parked_aggregates").await,
        0
    );
    broker.cleanup(&[]).await;
    stack.stop().await;
}
