//! The operator's views over the whole running system: `reliability
//! status` and `reliability explain order` (the CLI prints exactly these).

use std::time::Duration;

use e2e::Stack;
use operator::ops::{explain, status};
use reliability::TenantId;
use support::estate;
use testkit::wait_until;

mod support;

const ORDER_TABLES: &[(&str, &str)] = &[
    ("orders", "orders"),
    ("inventory", "reservations"),
    ("payments", "payments"),
    ("projection", "order_views"),
];

#[tokio::test]
async fn explain_follows_an_order_through_every_service_and_names_where_it_is_stuck() {
    let stack = Stack::start().await.unwrap();
    let estate = estate(&stack).await;
    let tenant = TenantId::new(1).unwrap();
    stack.stock(1, "SKU-X", 5).await;
    let order_id = stack.order(1, "c-x", "SKU-X", 1).await;
    stack.settled(1, order_id).await;

    // Settled: every event the order caused reached every subscriber.
    wait_until(Duration::from_secs(20), "nothing stuck", || async {
        explain::explain(&estate, tenant, "order_id", order_id, ORDER_TABLES)
            .await
            .unwrap()
            .stuck
            .is_none()
    })
    .await;
    let e = explain::explain(&estate, tenant, "order_id", order_id, ORDER_TABLES)
        .await
        .unwrap();
    let tables: Vec<(&str, &str)> = e
        .rows
        .iter()
        .map(|r| (r.service.as_str(), r.table.as_str()))
        .collect();
    assert_eq!(tables, ORDER_TABLES, "one row per service: {e:?}");
    assert_eq!(e.rows[0].row["status"], "confirmed");
    let types: Vec<&str> = e.events.iter().map(|ev| ev.event_type.as_str()).collect();
    for wanted in [
        "OrderPlaced",
        "InventoryReserved",
        "PaymentCaptured",
        "OrderConfirmed",
    ] {
        assert!(types.contains(&wanted), "{types:?}");
    }
    let placed = e
        .events
        .iter()
        .find(|ev| ev.event_type == "OrderPlaced")
        .unwrap();
    let mut consumers: Vec<&str> = placed
        .deliveries
        .iter()
        .map(|d| d.consumer.as_str())
        .collect();
    consumers.sort_unstable();
    assert_eq!(
        consumers,
        [
            "graph.edges",
            "inventory.stock",
            "projection.history",
            "projection.views"
        ]
    );
    for d in &placed.deliveries {
        // The graph keeps its checkpoints in the graph (ADR 0030): what
        // PostgreSQL shows is that its queue holds nothing.
        let want = if d.consumer == "graph.edges" {
            "consumed"
        } else {
            "applied"
        };
        assert_eq!(d.state, want, "{d:?}");
    }

    // The provider's record under the payment's key, beside ours.
    let mut e = e;
    let charges = explain::ProviderItems {
        service: "payments",
        sql: "SELECT payment_id, status FROM payments WHERE tenant_id = $1 AND order_id = $2",
        path: "charges",
        key: contracts::provider::charge_key,
    };
    explain::provider_view(&estate, &stack.psp_url, &[charges], &mut e)
        .await
        .unwrap();
    assert_eq!(e.provider.len(), 1, "{:?}", e.provider);
    assert!(e.provider[0].key.starts_with("pay-1-"));
    assert_eq!(e.provider[0].ours, "captured");
    let theirs = e.provider[0]
        .provider
        .as_ref()
        .expect("the provider has it");
    assert_eq!(theirs["status"], "succeeded");

    // An event of this order that exhausted its attempts: explain names it
    // and where it is; status lists the DLQ row as a problem.
    let stuck_id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_messages_dlq
           (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers,
            occurred_at, attempts, last_error)
         VALUES (999999, 1, 'order', $1::text, 'OrderCancelled', 1,
                 jsonb_build_object('order_id', $1, 'reason', 'test'), '{}', now(), 10, 'unroutable')
         RETURNING id",
    )
    .bind(order_id)
    .fetch_one(&stack.dbs.orders.owner)
    .await
    .unwrap();
    let e = explain::explain(&estate, tenant, "order_id", order_id, ORDER_TABLES)
        .await
        .unwrap();
    let why = e.stuck.expect("stuck");
    assert!(
        why.contains(&format!("OrderCancelled orders#{stuck_id}")) && why.contains("outbox DLQ"),
        "{why}"
    );
    // Tenant 99 has two orders the saga never heard of, and a bound of 2.
    for _ in 0..2 {
        sqlx::query("INSERT INTO orders (tenant_id, customer_id, currency, total_cents) VALUES (99, 'c', 'EUR', 1)")
            .execute(&stack.dbs.orders.owner)
            .await
            .unwrap();
    }
    // And one undecided for ten minutes: stuck, not in flight.
    sqlx::query("INSERT INTO orders (tenant_id, customer_id, currency, total_cents, created_at) VALUES (99, 'c', 'EUR', 1, now() - interval '10 minutes')")
        .execute(&stack.dbs.orders.owner)
        .await
        .unwrap();
    // And a refund that ended failed: money promised back, not given.
    sqlx::raw_sql(
        "WITH p AS (INSERT INTO payments (tenant_id, order_id, customer_id, amount_cents, currency, status)
                    VALUES (99, 1, 'c', 500, 'EUR', 'captured') RETURNING payment_id)
         INSERT INTO refunds (tenant_id, payment_id, amount_cents, status, last_error)
         SELECT 99, payment_id, 200, 'failed', 'the provider failed the refund it had accepted' FROM p",
    )
    .execute(&stack.dbs.payments.owner)
    .await
    .unwrap();
    let limits =
        service_kit::admission::AdmissionLimits::parse(1000, "99=2", Duration::ZERO).unwrap();
    let work = [status::WorkInFlight {
        service: "orders",
        table: "orders",
        in_flight: "status = 'pending'",
        since: "created_at",
        key: "order_id",
    }];
    let mut s = status::status(&estate).await;
    status::admission(&estate, &work, &limits, &mut s).await;
    assert!(
        s.problems
            .iter()
            .any(|p| p.starts_with("orders: 1 outbox row(s) in the DLQ table")),
        "{:?}",
        s.problems
    );
    assert!(
        s.problems.iter().any(
            |p| p.starts_with("orders: tenant 99 is at its admission bound (2 in flight of 2)")
        ),
        "{:?}",
        s.problems
    );
    assert!(
        s.problems.iter().any(|p| p.starts_with(
            "payments: 1 refund(s) ended failed in the last 24 h, the latest: the provider failed"
        )),
        "{:?}",
        s.problems
    );
    let line = s
        .admission
        .iter()
        .find(|a| a.tenant_id == 99)
        .expect("tenant 99 shown");
    assert_eq!((line.in_flight, line.stuck, line.bound), (2, 1, 2));
    assert!(
        s.problems
            .iter()
            .any(|p| p
                .starts_with("orders: tenant 99 has 1 order(s) undecided for over 300 s: stuck")),
        "{:?}",
        s.problems
    );
    // Connections counted against the server's limit, per service database.
    assert_eq!(s.connections.len(), 4, "{:?}", s.connections);
    for c in &s.connections {
        assert!(
            c.database >= 1 && c.server >= c.database && c.server_max > 0,
            "{c:?}"
        );
    }
    // Each consumer is attached, with nothing waiting.
    for line in &s.consumers {
        assert!(line.consumers.unwrap_or(0) > 0, "{line:?}");
        assert_eq!(line.dlq, Some(0), "{line:?}");
    }
    let projection = s
        .consumers
        .iter()
        .find(|c| c.consumer == "projection.views")
        .unwrap();
    assert!(projection.applied.unwrap_or(0) >= 4, "{projection:?}");
    stack.stop().await;
}

/// The console reads these series from the services' `/metrics` by name.
#[test]
fn the_console_reads_the_series_the_services_write() {
    use operator::ops::scrape;
    assert!(payments::reconcile::MISMATCHES.ends_with(scrape::FINDINGS_SUFFIX));
    assert!(payments::reconcile::REPAIRS.ends_with(scrape::REPAIRS_SUFFIX));
    assert!(projection::verify::DIFFERENCES.ends_with(scrape::DRIFT_SUFFIX));
    let age = reliability::metrics::CONSUMER_EVENT_AGE;
    assert_eq!(format!("{age}_sum"), scrape::EVENT_AGE_SUM);
    assert_eq!(format!("{age}_count"), scrape::EVENT_AGE_COUNT);
}
