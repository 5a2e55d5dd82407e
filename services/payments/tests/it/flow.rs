use std::sync::Arc;

use payments::worker::AFTER_PROVIDER;
use psp_sim::Faults;
use reliability::Error;
use reliability::failpoint::{Action, FailPoints};
use serde_json::json;

use crate::TestApp;

#[tokio::test]
async fn a_reserved_order_is_charged_once_and_captured() {
    let app = TestApp::spawn().await;
    app.reserve(1, 10, "c-1", 2500).await;
    app.reserve(1, 10, "c-1", 2500).await; // a redelivered event: still one payment
    let worker = app.worker(FailPoints::none());
    assert_eq!(worker.process_due().await.unwrap(), 1);
    let (payment_id, status, _) = app.payment(10).await;
    assert_eq!(status, "captured");
    assert_eq!(app.psp.times_charged(&format!("pay-1-{payment_id}")), 1);
    assert_eq!(app.events().await, ["PaymentCaptured"]);
    assert_eq!(worker.process_due().await.unwrap(), 0, "nothing left to do");

    let (status, body) = app.api.get(1, "/payments?order_id=10").await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!([{"payment_id": payment_id, "order_id": 10, "status": "captured", "amount_cents": 2500, "currency": "EUR", "refunded_cents": 0}])
    );
    let (_, other_tenant) = app.api.get(2, "/payments?order_id=10").await;
    assert_eq!(other_tenant, json!([]));
    app.stop().await;
}

#[tokio::test]
async fn a_declined_customer_fails_the_payment_without_a_charge() {
    let app = TestApp::spawn().await;
    app.reserve(1, 11, "decline-me", 900).await;
    app.worker(FailPoints::none()).process_due().await.unwrap();
    assert_eq!(app.payment(11).await.1, "failed");
    assert_eq!(app.psp.total_charges(), 0);
    let reason: String = sqlx::query_scalar(
        "SELECT payload->>'reason' FROM outbox_messages WHERE event_type = 'PaymentFailed'",
    )
    .fetch_one(&app.db.owner)
    .await
    .unwrap();
    assert_eq!(reason, "declined");
    app.stop().await;
}

#[tokio::test]
async fn a_provider_that_charges_then_errors_or_times_out_still_charges_once() {
    let app = TestApp::spawn().await;
    app.reserve(1, 12, "c-1", 100).await;
    app.reserve(1, 13, "c-1", 200).await;
    app.psp.set_faults(Faults {
        charge_then_fail_next: 1,
        charge_then_hang_next: 1,
        hang_ms: 2000,
        ..Faults::default()
    });
    let worker = app.worker(FailPoints::none());
    worker.process_due().await.unwrap();
    assert_eq!(
        (app.payment(12).await.1, app.payment(13).await.1),
        ("pending".into(), "pending".into()),
        "both unknown to us"
    );
    assert_eq!(app.psp.total_charges(), 2, "yet the provider charged both");

    app.expire_leases().await;
    worker.process_due().await.unwrap();
    assert_eq!(
        (app.payment(12).await.1, app.payment(13).await.1),
        ("captured".into(), "captured".into())
    );
    assert_eq!(
        app.psp.total_charges(),
        2,
        "the retries found the same charges"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_crash_between_the_providers_answer_and_the_record_does_not_charge_twice() {
    let app = TestApp::spawn().await;
    app.reserve(1, 14, "c-1", 700).await;
    let crashing = FailPoints::none();
    crashing.arm(AFTER_PROVIDER, Action::Error);
    let err = app.worker(crashing).process_due().await.unwrap_err();
    assert!(matches!(err, Error::FailPoint(AFTER_PROVIDER)), "{err}");
    let (payment_id, status, _) = app.payment(14).await;
    assert_eq!(status, "pending");
    assert_eq!(app.psp.times_charged(&format!("pay-1-{payment_id}")), 1);

    // Within the lease nobody retries; after it, a new worker does.
    let restarted = app.worker(FailPoints::none());
    assert_eq!(restarted.process_due().await.unwrap(), 0);
    app.expire_leases().await;
    restarted.process_due().await.unwrap();
    assert_eq!(app.payment(14).await.1, "captured");
    assert_eq!(app.psp.times_charged(&format!("pay-1-{payment_id}")), 1);
    assert_eq!(app.events().await, ["PaymentCaptured"]);
    app.stop().await;
}

#[tokio::test]
async fn a_refund_is_issued_once_and_never_beyond_the_capture() {
    let app = Arc::new(TestApp::spawn().await);
    app.reserve(1, 15, "c-1", 1000).await;
    let worker = app.worker(FailPoints::none());
    worker.process_due().await.unwrap();
    let (payment_id, _, _) = app.payment(15).await;

    let body = json!({"payment_id": payment_id, "amount_cents": 600}).to_string();
    let (status, replayed, first) = app.api.post(1, "/refunds", "r-1", &body).await;
    assert_eq!((status, replayed), (201, false), "{first}");
    assert_eq!(first["status"], "pending");
    let (status, replayed, again) = app.api.post(1, "/refunds", "r-1", &body).await;
    assert_eq!((status, replayed, &again), (201, true, &first));

    // Another 600 would exceed the 1000 captured.
    let (status, _, err) = app.api.post(1, "/refunds", "r-2", &body).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("refund_exceeds_captured"))
    );
    // Another tenant cannot refund it, nor learn it exists.
    let (status, _, _) = app.api.post(2, "/refunds", "r-3", &body).await;
    assert_eq!(status, 404);
    let (status, _, _) = app
        .api
        .post(
            1,
            "/refunds",
            "r-4",
            &json!({"payment_id": payment_id, "amount_cents": 0}).to_string(),
        )
        .await;
    assert_eq!(status, 422);
    // An amount whose sum with the refunded would overflow: 422, not 500.
    let (status, _, err) = app
        .api
        .post(
            1,
            "/refunds",
            "r-5",
            &json!({"payment_id": payment_id, "amount_cents": i64::MAX}).to_string(),
        )
        .await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("refund_exceeds_captured"))
    );

    worker.process_due().await.unwrap();
    worker.process_due().await.unwrap();
    assert_eq!(app.psp.total_refunds(), 1);
    assert_eq!(app.payment(15).await.2, 600);
    assert_eq!(app.events().await, ["PaymentCaptured", "RefundIssued"]);
    let (_, listed) = app.api.get(1, "/payments?order_id=15").await;
    assert_eq!(listed[0]["refunded_cents"], 600);

    // Racing refunds of the remaining 400: one wins.
    let racers = futures_util::future::join_all((0..2).map(|i| {
        let app = app.clone();
        async move {
            let body = json!({"payment_id": payment_id, "amount_cents": 300}).to_string();
            app.api
                .post(1, "/refunds", &format!("race-{i}"), &body)
                .await
                .0
        }
    }))
    .await;
    let mut statuses = racers.clone();
    statuses.sort_unstable();
    assert_eq!(statuses, [201, 422]);
    Arc::into_inner(app).unwrap().stop().await;
}
