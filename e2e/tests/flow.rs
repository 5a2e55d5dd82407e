//! Orders travel through inventory and payments to `confirmed` or
//! `cancelled`, with the projection and the graph following, all five services running
//! their relays and consumers against the real broker.

use std::sync::Arc;
use std::time::Duration;

use e2e::Stack;
use serde_json::json;
use testkit::wait_until;

#[tokio::test]
async fn a_paid_order_is_confirmed_its_stock_committed_and_charged_once_then_refunded_once() {
    let stack = Stack::start().await.unwrap();
    stack.stock(1, "SKU-1", 10).await;
    let order_id = stack.order(1, "c-1", "SKU-1", 2).await;

    let view = stack.settled(1, order_id).await;
    assert_eq!(view["status"], "confirmed", "{view}");
    assert_eq!(
        (
            view["payment_status"].as_str(),
            view["reservation_status"].as_str()
        ),
        (Some("captured"), Some("committed"))
    );
    wait_until(Duration::from_secs(20), "stock committed", || async {
        stack.inventory.get(1, "/products/SKU-1").await.1
            == json!({"sku": "SKU-1", "on_hand": 8, "reserved": 0, "available": 8})
    })
    .await;
    assert_eq!(stack.psp.total_charges(), 1);
    // Every event found a queue: no outbox keeps anything back (StockAdjusted included).
    for db in [&stack.dbs.orders, &stack.dbs.inventory, &stack.dbs.payments] {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            // What is left, and why: a refusal backs a row off for longer
            // than this wait, and its last_error names the cause.
            let pending: Vec<(i64, String, i32, Option<String>, f64)> = sqlx::query_as(
                "SELECT id, event_type, attempts, last_error,
                        EXTRACT(EPOCH FROM available_at - now())::float8
                 FROM outbox_messages WHERE processed_at IS NULL ORDER BY id",
            )
            .fetch_all(&db.owner)
            .await
            .unwrap();
            if pending.is_empty() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "outbox not drained after 20 s (id, type, attempts, last error, due in s): {pending:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let (_, payments) = stack
        .payments
        .get(1, &format!("/payments?order_id={order_id}"))
        .await;
    assert_eq!(payments[0]["status"], "captured");
    assert_eq!(payments[0]["amount_cents"], 2500);

    // The same refund request retried three times: one refund.
    let body = json!({"payment_id": payments[0]["payment_id"], "amount_cents": 500}).to_string();
    for _ in 0..3 {
        let (status, _, refund) = stack
            .payments
            .post(1, "/refunds", "refund-once", &body)
            .await;
        assert_eq!(status, 201, "{refund}");
    }
    wait_until(
        Duration::from_secs(20),
        "refund seen by the projection",
        || async {
            stack
                .projection
                .get(1, &format!("/orders/{order_id}"))
                .await
                .1["refunded_cents"]
                == 500
        },
    )
    .await;
    assert_eq!(stack.psp.total_refunds(), 1);
    // The graph tells the same story (ADR 0030).
    let path = format!("/graph/orders/{order_id}");
    wait_until(
        Duration::from_secs(20),
        "the refund in the graph",
        || async {
            stack.graph.get(1, &path).await.1["payments"][0]["refunds"][0]["amount_cents"] == 500
        },
    )
    .await;
    let (_, node) = stack.graph.get(1, &path).await;
    assert_eq!(
        (&node["status"], &node["customer_id"], &node["lines"]),
        (
            &json!("confirmed"),
            &json!("c-1"),
            &json!([{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250,
                     "reserved": true, "released": false}])
        ),
        "{node}"
    );

    // The order's path is one trace: every event the order caused carries its
    // trace id (the refund, a request of its own, has its own trace).
    let traces: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT headers->>'traceparent' FROM outbox_messages WHERE aggregate_id = $1",
    )
    .bind(order_id.to_string())
    .fetch_all(&stack.dbs.orders.owner)
    .await
    .unwrap();
    let trace_id = |t: &Option<String>| {
        t.as_deref()
            .and_then(|t| t.split('-').nth(1))
            .map(str::to_owned)
    };
    let first = trace_id(&traces[0]).expect("OrderPlaced carries a traceparent");
    for other in [&stack.dbs.inventory, &stack.dbs.payments] {
        let theirs: Vec<Option<String>> = sqlx::query_scalar("SELECT headers->>'traceparent' FROM outbox_messages WHERE payload->>'order_id' = $1 AND event_type <> 'RefundIssued'",
        )
            .bind(order_id.to_string())
            .fetch_all(&other.owner)
            .await
            .unwrap();
        assert!(!theirs.is_empty());
        assert!(
            theirs
                .iter()
                .all(|t| trace_id(t).as_deref() == Some(first.as_str())),
            "{theirs:?} vs {first}"
        );
    }

    // The provider call is part of the order's trace too.
    let payment_id = payments[0]["payment_id"].as_i64().unwrap();
    let charged_with = stack.psp.traceparent(&format!("pay-1-{payment_id}"));
    assert_eq!(
        trace_id(&charged_with).as_deref(),
        Some(first.as_str()),
        "the charge carries the order's trace: {charged_with:?}"
    );

    let refund_trace: Option<String> = sqlx::query_scalar(
        "SELECT headers->>'traceparent' FROM outbox_messages WHERE event_type = 'RefundIssued'",
    )
    .fetch_one(&stack.dbs.payments.owner)
    .await
    .unwrap();
    assert!(
        trace_id(&refund_trace).is_some_and(|t| t != first),
        "the refund continues its request's trace"
    );

    // The projection, rebuilt from the sources' history, ends with the same view.
    let before = stack
        .projection
        .get(1, &format!("/orders/{order_id}"))
        .await
        .1;
    let sources = vec![
        ("orders".to_owned(), stack.dbs.orders.owner.clone()),
        ("inventory".to_owned(), stack.dbs.inventory.owner.clone()),
        ("payments".to_owned(), stack.dbs.payments.owner.clone()),
    ];
    let report = projection::rebuild::rebuild(&stack.dbs.projection.databases(), &sources)
        .await
        .unwrap();
    assert!(report.replayed.iter().all(|(_, n)| *n > 0), "{report:?}");
    let after = stack
        .projection
        .get(1, &format!("/orders/{order_id}"))
        .await
        .1;
    assert_eq!(after, before);
    stack.stop().await;
}

#[tokio::test]
async fn out_of_stock_and_declined_orders_are_cancelled_without_a_charge_and_release_their_stock() {
    let stack = Stack::start().await.unwrap();
    stack.stock(1, "SKU-2", 5).await;
    let too_many = stack.order(1, "c-1", "SKU-2", 6).await;
    let unknown = stack.order(1, "c-1", "NO-SUCH-SKU", 1).await;
    let declined = stack.order(1, "decline-1", "SKU-2", 3).await;

    let view = stack.settled(1, too_many).await;
    assert_eq!(
        (view["status"].as_str(), view["reservation_status"].as_str()),
        (Some("cancelled"), Some("rejected"))
    );
    let (_, order) = stack.orders.get(1, &format!("/orders/{too_many}")).await;
    assert_eq!(
        order["cancel_reason"],
        "inventory_rejected: insufficient_stock: SKU-2"
    );
    assert_eq!(stack.settled(1, unknown).await["status"], "cancelled");

    let view = stack.settled(1, declined).await;
    assert_eq!(
        (
            view["status"].as_str(),
            view["payment_status"].as_str(),
            view["reservation_status"].as_str()
        ),
        (Some("cancelled"), Some("failed"), Some("released"))
    );
    wait_until(
        Duration::from_secs(20),
        "declined order's reservation released",
        || async {
            stack.inventory.get(1, "/products/SKU-2").await.1
                == json!({"sku": "SKU-2", "on_hand": 5, "reserved": 0, "available": 5})
        },
    )
    .await;
    assert_eq!(stack.psp.total_charges(), 0);
    let (_, payments) = stack
        .payments
        .get(1, &format!("/payments?order_id={too_many}"))
        .await;
    assert_eq!(payments, json!([]), "no payment for an order without stock");
    stack.stop().await;
}

#[tokio::test]
async fn twenty_concurrent_orders_for_ten_units_sell_exactly_ten() {
    let stack = Arc::new(Stack::start().await.unwrap());
    let (_, confirmed) = stack.race_for_ten(1, "HOT").await;
    assert_eq!(confirmed, 10);
    let (_, product) = stack.inventory.get(1, "/products/HOT").await;
    assert_eq!(
        product,
        json!({"sku": "HOT", "on_hand": 0, "reserved": 0, "available": 0})
    );
    assert_eq!(stack.psp.total_charges(), 10);
    Arc::into_inner(stack).unwrap().stop().await;
}

/// The projection's rebuild runs beside the live consumer (two appliers of
/// the same orders' events): whatever interleaves, the views end as a
/// rebuild alone makes them (ADR 0006, 0010).
#[tokio::test]
async fn a_rebuild_beside_the_live_projection_consumer_loses_nothing() {
    let stack = Stack::start().await.unwrap();
    stack.stock(1, "SKU-9", 1000).await;
    let sources = vec![
        ("orders".to_owned(), stack.dbs.orders.owner.clone()),
        ("inventory".to_owned(), stack.dbs.inventory.owner.clone()),
        ("payments".to_owned(), stack.dbs.payments.owner.clone()),
    ];
    let projection = stack.dbs.projection.databases();
    let placing = async {
        let mut ids = Vec::new();
        for i in 0..24 {
            let customer = if i % 5 == 4 { "decline-x" } else { "c-1" };
            ids.push(stack.order(1, customer, "SKU-9", 1).await);
        }
        ids
    };
    let rebuilding = async {
        for _ in 0..3 {
            projection::rebuild::rebuild(&projection, &sources)
                .await
                .unwrap();
        }
    };
    let (ids, ()) = tokio::join!(placing, rebuilding);
    let views = || async {
        let mut all = Vec::new();
        for id in &ids {
            all.push(stack.settled(1, *id).await);
        }
        all
    };
    let live = views().await;
    projection::rebuild::rebuild(&projection, &sources)
        .await
        .unwrap();
    assert_eq!(
        live,
        views().await,
        "the views the race left equal a rebuild alone"
    );
    stack.stop().await;
}

/// Verification (docs/adr/0035): a clean stack verifies clean; drift put
/// into each kind of row is named, entity by entity, once the grace has
/// passed and not before; a repair beside the live consumers mends it.
#[tokio::test]
async fn verify_names_each_drift_and_its_repair_leaves_none() {
    use projection::verify::{Sources, Verifier};
    let stack = Stack::start().await.unwrap();
    stack.stock(1, "SKU-V", 100).await;
    let mut ids = Vec::new();
    for customer in ["c-1", "c-2", "decline-x"] {
        let id = stack.order(1, customer, "SKU-V", 1).await;
        stack.settled(1, id).await;
        ids.push(id);
    }
    let (flipped, lost, spurious) = (ids[0], ids[1], ids[2]);
    let projection = &stack.dbs.projection.owner;
    let applied = |id: i64| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM aggregate_history WHERE aggregate_type = 'order' AND aggregate_id = $1",
        )
        .bind(id.to_string())
        .fetch_one(projection)
        .await
        .unwrap()
    };
    wait_until(
        Duration::from_secs(20),
        "the order's history applied",
        || async { applied(flipped).await >= 2 },
    )
    .await;
    let sources = Sources {
        orders: stack.dbs.orders.owner.clone(),
        inventory: stack.dbs.inventory.owner.clone(),
        payments: stack.dbs.payments.owner.clone(),
    };
    let verifier = |grace| Verifier::new(projection.clone(), sources.clone(), grace, 2);
    let differences = |report: projection::verify::Report| {
        let mut found: Vec<(String, String, bool)> = report
            .differences
            .into_iter()
            .map(|d| (d.view.to_owned(), d.entity, d.repaired))
            .collect();
        found.sort();
        found
    };
    let clean = verifier(Duration::ZERO).run_once(false).await.unwrap();
    assert_eq!(
        differences(clean),
        vec![],
        "a stack left alone verifies clean"
    );

    // A status flipped; an applied event lost (its row, and the view as a
    // recompute without it leaves it); an event no source emitted; two
    // events of a history swapped.
    for drift in [
        format!("UPDATE order_views SET status = 'cancelled' WHERE order_id = {flipped}"),
        format!(
            "DELETE FROM order_view_events WHERE order_id = {lost} AND event_type = 'PaymentCaptured'"
        ),
        format!("UPDATE order_views SET payment_status = 'pending' WHERE order_id = {lost}"),
        format!(
            "INSERT INTO order_view_events (tenant_id, order_id, source, message_id, event_type, occurred_at, payload)
             VALUES (1, {spurious}, 'payments', 999999, 'RefundIssued', now(), '{{\"amount_cents\": 100}}')"
        ),
        format!("UPDATE order_views SET refunded_cents = 100 WHERE order_id = {spurious}"),
        // (1 -> -2 -> 2, 2 -> -1 -> 1: the key is checked row by row)
        format!(
            "UPDATE aggregate_history SET position = position - 3
             WHERE aggregate_type = 'order' AND aggregate_id = '{flipped}' AND position IN (1, 2)"
        ),
        format!(
            "UPDATE aggregate_history SET position = -position
             WHERE aggregate_type = 'order' AND aggregate_id = '{flipped}' AND position < 0"
        ),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(drift))
            .execute(projection)
            .await
            .unwrap();
    }
    let fresh = verifier(Duration::from_secs(3600))
        .run_once(false)
        .await
        .unwrap();
    assert_eq!(
        fresh.orders_settling, 3,
        "within the grace, no order is held to its sources"
    );
    assert_eq!(
        differences(fresh),
        vec![("history".into(), format!("order:{flipped}"), false)],
        "a history out of order is wrong at any age"
    );
    let named = |repaired| {
        let mut all = vec![
            ("history".to_owned(), format!("order:{flipped}"), repaired),
            ("orders".to_owned(), flipped.to_string(), repaired),
            ("orders".to_owned(), lost.to_string(), repaired),
            ("orders".to_owned(), spurious.to_string(), repaired),
        ];
        all.sort();
        all
    };
    let found = verifier(Duration::ZERO).run_once(false).await.unwrap();
    assert_eq!(differences(found), named(false), "each drift named");
    let repaired = verifier(Duration::ZERO).run_once(true).await.unwrap();
    assert_eq!(differences(repaired), named(true), "each repaired");
    let after = verifier(Duration::ZERO).run_once(false).await.unwrap();
    assert_eq!(
        differences(after),
        vec![],
        "nothing differs after the repair"
    );
    let history: Vec<String> = sqlx::query_scalar(
        "SELECT event_type FROM aggregate_history
         WHERE aggregate_type = 'order' AND aggregate_id = $1 ORDER BY position",
    )
    .bind(flipped.to_string())
    .fetch_all(projection)
    .await
    .unwrap();
    assert_eq!(history, ["OrderPlaced", "OrderConfirmed"]);
    stack.stop().await;
}
