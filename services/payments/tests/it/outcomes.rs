//! The outcome rules of ADR 0011: money that may have moved is never
//! written off on a 4xx alone, a non-final answer is not a failure, nothing
//! retries forever, and a refund keeps its key.

use std::time::Duration;

use payments::worker::WorkerConfig;
use psp_sim::Faults;
use reliability::failpoint::FailPoints;

use crate::TestApp;

/// Whether the payment's last try left its outcome unknown.
async fn unknown(app: &TestApp, order_id: i64) -> bool {
    sqlx::query_scalar("SELECT outcome_unknown FROM payments WHERE order_id = $1")
        .bind(order_id)
        .fetch_one(&app.db.owner)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_refusal_after_an_unknown_outcome_looks_the_key_up_instead_of_failing() {
    let app = TestApp::spawn().await;
    let worker = app.worker(FailPoints::none());
    // Order 1: charged, then a 500; the retry is refused (4xx).
    app.reserve(1, 1, "c-1", 100).await;
    app.psp.set_faults(Faults {
        charge_then_fail_next: 1,
        ..Faults::default()
    });
    worker.process_due().await.unwrap();
    assert!(unknown(&app, 1).await);
    app.psp.set_faults(Faults {
        reject_next: 1,
        ..Faults::default()
    });
    app.expire_leases().await;
    worker.process_due().await.unwrap();
    assert_eq!(
        app.payment(1).await.1,
        "captured",
        "the look-up found the charge"
    );

    // Order 2: a 503 before any charge, then refused, and the look-up
    // finds nothing under the key. Inside the provider's processing bound
    // that proves nothing (the first request may still land): pending.
    app.reserve(1, 2, "c-1", 100).await;
    app.psp.set_faults(Faults {
        fail_next: 1,
        ..Faults::default()
    });
    worker.process_due().await.unwrap();
    app.psp.set_faults(Faults {
        reject_next: 1,
        ..Faults::default()
    });
    app.expire_leases().await;
    worker.process_due().await.unwrap();
    assert_eq!(app.payment(2).await.1, "pending", "inside the grace window");
    // Past it, nothing found under the key is final: failing it is safe.
    let past_grace = WorkerConfig {
        grace: Duration::ZERO,
        ..WorkerConfig::default()
    };
    let worker = app.worker_with(past_grace, Duration::from_millis(300), FailPoints::none());
    app.psp.set_faults(Faults {
        reject_next: 1,
        ..Faults::default()
    });
    app.expire_leases().await;
    worker.process_due().await.unwrap();
    assert_eq!(app.payment(2).await.1, "failed");
    assert_eq!(app.psp.total_charges(), 1, "money moved for order 1 only");
    assert_eq!(app.events().await, ["PaymentCaptured", "PaymentFailed"]);
    app.stop().await;
}

#[tokio::test]
async fn a_pending_answer_is_not_a_failure() {
    let app = TestApp::spawn().await;
    let worker = app.worker(FailPoints::none());
    app.reserve(1, 3, "c-1", 100).await;
    app.psp.set_faults(Faults {
        pending_next: 1,
        ..Faults::default()
    });
    worker.process_due().await.unwrap();
    assert_eq!(app.payment(3).await.1, "pending");
    assert!(unknown(&app, 3).await, "not final: asked again later");
    app.psp.settle_all(); // the provider's processing time passes
    app.expire_leases().await;
    worker.process_due().await.unwrap();
    assert_eq!(app.payment(3).await.1, "captured");
    assert_eq!(app.psp.total_charges(), 1);
    app.stop().await;
}

#[tokio::test]
async fn past_the_deadline_a_payment_fails_and_what_it_may_have_charged_is_refunded_by_key() {
    let app = TestApp::spawn().await;
    // Order 4 was charged but we never learned it; order 5 was never charged
    // (a 503) yet is just as unknown to us; order 6 was never tried before
    // its deadline.
    let first = app.worker(FailPoints::none());
    app.reserve(1, 4, "c-1", 400).await;
    app.psp.set_faults(Faults {
        charge_then_fail_next: 1,
        ..Faults::default()
    });
    first.process_due().await.unwrap();
    // Order 4's next try waits (its backoff is 200 ms, less than a loaded
    // machine takes to reach the next pass, which then retried it under
    // order 5's faults and found its charge): the next pass is order 5's.
    sqlx::query(
        "UPDATE payments SET next_attempt_at = now() + interval '1 hour' WHERE order_id = 4",
    )
    .execute(&app.db.owner)
    .await
    .unwrap();
    app.reserve(1, 5, "c-1", 500).await;
    app.psp.set_faults(Faults {
        fail_next: 1,
        ..Faults::default()
    });
    first.process_due().await.unwrap();
    assert!(unknown(&app, 4).await && unknown(&app, 5).await);
    app.reserve(1, 6, "c-1", 600).await;
    app.psp.set_faults(Faults {
        fail_next: 1_000,
        ..Faults::default()
    });

    let late = WorkerConfig {
        deadline: Duration::ZERO,
        grace: Duration::ZERO,
        ..WorkerConfig::default()
    };
    let worker = app.worker_with(late, Duration::from_millis(300), FailPoints::none());
    app.expire_leases().await;
    worker.process_due().await.unwrap();
    // Order 6 had no try before its deadline: it gets one (a 503) before
    // it may fail, so an outage of ours alone fails nothing.
    assert_eq!(app.payment(6).await.1, "pending");
    app.expire_leases().await;
    worker.process_due().await.unwrap();
    for order in [4, 5, 6] {
        assert_eq!(app.payment(order).await.1, "failed", "order {order}");
    }
    app.psp.set_faults(Faults::default());
    app.expire_leases().await;
    worker.process_due().await.unwrap(); // the refunds by key
    assert_eq!(app.psp.total_charges(), 1);
    assert_eq!(app.psp.total_refunds(), 1, "order 4's charge came back");
    assert_eq!(app.payment(4).await.2, 400);
    assert_eq!(
        app.payment(5).await.2,
        0,
        "nothing to refund under order 5's key"
    );
    assert_eq!(app.payment(6).await.2, 0);
    let mut events = app.events().await;
    events.sort();
    assert_eq!(
        events,
        [
            "PaymentFailed",
            "PaymentFailed",
            "PaymentFailed",
            "RefundIssued"
        ]
    );
    app.stop().await;
}

#[tokio::test]
async fn a_refund_with_an_unknown_outcome_keeps_its_key_and_is_issued_once() {
    let app = TestApp::spawn().await;
    let worker = app.worker(FailPoints::none());
    app.reserve(1, 7, "c-1", 1000).await;
    worker.process_due().await.unwrap();
    let (payment_id, _, _) = app.payment(7).await;
    let body = serde_json::json!({"payment_id": payment_id, "amount_cents": 300}).to_string();
    assert_eq!(app.api.post(1, "/refunds", "r-1", &body).await.0, 201);

    // Refunded, then a 500; then refused: the look-up by key finds it.
    app.psp.set_faults(Faults {
        charge_then_fail_next: 1,
        ..Faults::default()
    });
    worker.process_due().await.unwrap();
    app.psp.set_faults(Faults {
        reject_next: 1,
        ..Faults::default()
    });
    app.expire_leases().await;
    worker.process_due().await.unwrap();
    let status: String = sqlx::query_scalar("SELECT status FROM refunds")
        .fetch_one(&app.db.owner)
        .await
        .unwrap();
    assert_eq!(status, "succeeded");
    assert_eq!(app.psp.total_refunds(), 1);
    assert_eq!(
        app.payment(7).await.2,
        300,
        "the amount stays refunded, not given back"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_provider_timeout_that_outlives_the_lease_is_refused_at_startup() {
    let db = testkit::TestDb::with_migrations(&payments::MIGRATIONS).await;
    let settings = payments::Settings {
        role: service_kit::service::Role::Consume,
        service: payments::PspSettings {
            psp_timeout_ms: 30_000,
            psp_lease_secs: 30,
            ..Default::default()
        },
        ..payments::Settings::local(testkit::common_settings())
    };
    let stop = service_kit::service::ShutdownToken::new();
    let refused = service_kit::service::start(&payments::SERVICE, settings, db.databases(), stop)
        .await
        .err()
        .expect("a timeout of 30 s with a 30 s lease is refused");
    assert!(refused.to_string().contains("PSP_TIMEOUT_MS"), "{refused}");
    db.cleanup().await;
}

/// The worker's claim runs with its owner's rights (SECURITY DEFINER): a
/// temporary table named `payments` in the caller's session must not
/// stand in for ours. Before `pg_temp` came last in its `search_path`,
/// PostgreSQL searched the session's temporary tables first, and this
/// table (no such columns) broke the claim.
#[tokio::test]
async fn a_temporary_table_named_payments_changes_nothing_for_the_claim() {
    let db = testkit::TestDb::with_migrations(&payments::MIGRATIONS).await;
    let mut conn = db.app.acquire().await.unwrap();
    sqlx::raw_sql("CREATE TEMP TABLE payments (id bigint); CREATE TEMP TABLE refunds (id bigint)")
        .execute(&mut *conn)
        .await
        .unwrap();
    let claimed: Vec<(String, i64, i64, i32)> =
        sqlx::query_as("SELECT * FROM claim_due_work(10, 2, '{}', '{}', 30)")
            .fetch_all(&mut *conn)
            .await
            .expect("the claim reads our tables, not the session's");
    assert!(claimed.is_empty(), "{claimed:?}");
    conn.detach();
    db.cleanup().await;
}

/// A worker of the previous release calls the five-argument claim through
/// a rolling upgrade (payments migration 1007): it still leases a due
/// payment, numbering its attempt, and the six-argument claim returns the
/// row the call needs.
#[tokio::test]
async fn both_claims_lease_a_due_payment_and_the_new_one_returns_its_row() {
    let db = testkit::TestDb::with_migrations(&payments::MIGRATIONS).await;
    sqlx::query(
        "INSERT INTO payments (tenant_id, order_id, customer_id, amount_cents, currency)
         VALUES (1, 7, 'c-1', 1250, 'EUR'), (1, 8, 'c-2', 990, 'EUR')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let old: Vec<(String, i64, i64, i32)> =
        sqlx::query_as("SELECT * FROM claim_due_work(1, 2, '{}', '{}', 30)")
            .fetch_all(&db.app)
            .await
            .unwrap();
    assert_eq!(old.len(), 1, "{old:?}");
    assert_eq!((old[0].0.as_str(), old[0].3), ("charge", 1));
    type Row = (String, i64, i64, i32, i64, String, i64, String, bool, bool);
    let new: Vec<Row> = sqlx::query_as(
        "SELECT kind, tenant_id, id, attempt, order_id, customer_id, amount_cents, currency,
                outcome_unknown, expired
         FROM claim_due_work(10, 2, '{}', '{}', 30, 900)",
    )
    .fetch_all(&db.app)
    .await
    .unwrap();
    assert_eq!(new.len(), 1, "the other payment is leased: {new:?}");
    let (kind, _, id, attempt, order, customer, amount, currency, unknown, expired) =
        new[0].clone();
    assert_ne!(id, old[0].2);
    // Both payments are due at the same instant, so either claim may take
    // either one: the row must be the one the old claim left.
    let (order_id, customer_id, amount_cents): (i64, String, i64) = sqlx::query_as(
        "SELECT order_id, customer_id, amount_cents FROM payments WHERE payment_id = $1",
    )
    .bind(id)
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(
        (
            kind.as_str(),
            attempt,
            order,
            customer.as_str(),
            amount,
            currency.as_str()
        ),
        (
            "charge",
            1,
            order_id,
            customer_id.as_str(),
            amount_cents,
            "EUR"
        )
    );

    assert!(!unknown && !expired);
    db.cleanup().await;
}

/// Refunds that can never succeed end, where they were retried every
/// 30 s for good and kept their amount reserved (issue 43): one the
/// provider took and then failed (its 2xx says `failed`, on every try
/// under the key), and one by the charge's key that a captured charge has
/// no room left for.
#[tokio::test]
async fn a_refund_that_can_never_succeed_ends_failed_and_gives_its_amount_back() {
    let app = TestApp::spawn().await;
    let worker = app.worker(FailPoints::none());
    app.reserve(1, 1, "c-1", 500).await;
    worker.process_due().await.unwrap();
    let (payment, status, _) = app.payment(1).await;
    assert_eq!(status, "captured");
    let statuses = || async {
        sqlx::query_scalar::<_, String>(
            // Ids are opaque (ADR 0017), not in the order of creation.
            "SELECT status FROM refunds WHERE payment_id = $1 ORDER BY created_at",
        )
        .bind(payment)
        .fetch_all(&app.db.owner)
        .await
        .unwrap()
    };

    app.psp.set_faults(Faults {
        refund_fail_next: 1,
        ..Faults::default()
    });
    assert_eq!(app.refund(payment, "r-1", 200).await, 201);
    worker.process_due().await.unwrap();
    assert_eq!(statuses().await, ["failed"], "a refund the provider failed");
    assert_eq!(app.payment(1).await.2, 0, "its amount is given back");

    // 300 refunded; then a refund by the charge's key of 400, counted in
    // our books, which the charge has no room for.
    assert_eq!(app.refund(payment, "r-2", 300).await, 201);
    worker.process_due().await.unwrap();
    assert_eq!(statuses().await, ["failed", "succeeded"], "300 refunded");
    sqlx::query(
        "WITH r AS (INSERT INTO refunds (tenant_id, payment_id, amount_cents, charge_key)
                    VALUES (1, $1, 400, $2) RETURNING amount_cents)
         UPDATE payments SET refunded_cents = least(amount_cents, refunded_cents + (SELECT amount_cents FROM r))
         WHERE payment_id = $1",
    )
    .bind(payment)
    .bind(format!("pay-1-{payment}"))
    .execute(&app.db.owner)
    .await
    .unwrap();
    worker.process_due().await.unwrap();
    let all = statuses().await;
    assert_eq!(all.last().map(String::as_str), Some("failed"), "{all:?}");
    assert_eq!(app.payment(1).await.2, 300, "the books follow the refunds");
    app.stop().await;
}
