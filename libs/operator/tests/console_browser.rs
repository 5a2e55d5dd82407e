//! The console in a real browser: Playwright (`playwright-core` from npm,
//! `tests/browser/`) drives Debian's chromium, headless, against a console
//! over a real PostgreSQL and RabbitMQ holding a dead-letter group, a
//! parked aggregate and a stuck order (issue 45). Each step keeps a
//! screenshot under `target/tmp/console-screenshots/`. Without chromium or
//! the npm module (`scripts/browser.sh` installs both) it says so and
//! passes, except where `CONSOLE_BROWSER_TESTS=required` (CI), where it
//! fails.

use std::path::Path;

use operator::console::Auth;
use testkit::{DEADLINE, TestDb, browser, wait_until};

mod support;

const TOKEN: &str = "browser-test-token";

#[tokio::test]
async fn an_operator_signs_in_re_drives_a_group_skips_and_unparks_and_reads_an_order_in_chromium() {
    if !browser::available() {
        return;
    }
    let db = TestDb::new().await;
    let letters = support::letters(&db).await;
    sqlx::raw_sql(
        "INSERT INTO parked_aggregates (tenant_id, consumer, source, aggregate_type, aggregate_id, error)
         VALUES (1, 'shop.views', 'orders', 'order', '42', 'handler: no such status');
         INSERT INTO parked_events (tenant_id, consumer, source, aggregate_type, aggregate_id,
                                    message_id, aggregate_seq, event_type, envelope)
         VALUES (1, 'shop.views', 'orders', 'order', '42', 900, 3, 'OrderConfirmed', '{}'),
                (1, 'shop.views', 'orders', 'order', '42', 901, 4, 'OrderShipped', '{}');",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let sources = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE TABLE orders (tenant_id bigint, order_id bigint, status text, created_at timestamptz);
         INSERT INTO orders VALUES (1, 42, 'pending', now() - interval '1 hour');
         CREATE TABLE payments (tenant_id bigint, payment_id bigint, order_id bigint, status text,
                                attempts int);
         INSERT INTO payments VALUES (1, 5, 42, 'pending', 2);
         CREATE TABLE refunds (tenant_id bigint, refund_id bigint, payment_id bigint, status text);",
    )
    .execute(&sources.owner)
    .await
    .unwrap();
    // One database plays the orders' and the payments'.
    let databases = vec![
        ("orders".to_owned(), sources.owner.clone()),
        ("payments".to_owned(), sources.owner.clone()),
        ("shop".to_owned(), db.owner.clone()),
    ];
    let estate = letters.estate(databases).await;
    let url = support::serve(estate, Auth::token(TOKEN), false, Vec::new()).await;

    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let args = vec![url, TOKEN.into(), shots.display().to_string()];
    let (passed, said) = browser::run("console.mjs", args, 120).await;
    assert!(
        passed,
        "the browser run failed (screenshots in {}):\n{said}",
        shots.display()
    );

    // What the clicks did, in the stores themselves.
    wait_until(
        DEADLINE,
        "the group on the queue, the other letter kept",
        || async {
            letters.broker.depth(&letters.spec.queue).await == 2
                && letters.broker.depth(&letters.dlq).await == 1
        },
    )
    .await;
    let left: Vec<(i64, bool)> = sqlx::query_as(
        "SELECT e.message_id, a.release_requested_at IS NOT NULL
         FROM parked_events e JOIN parked_aggregates a USING (tenant_id, consumer, source, aggregate_type, aggregate_id)",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert_eq!(left, [(901, true)], "900 dropped, 901 to replay");
    let queue = letters.spec.queue.clone();
    letters.broker.cleanup(&[&queue]).await;
    db.cleanup().await;
    sources.cleanup().await;
}
