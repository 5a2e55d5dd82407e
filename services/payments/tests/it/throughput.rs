//! Many provider calls in flight, fairly (docs/adr/0011): the worker keeps
//! its slots full, no tenant takes more than its share, and a hung call
//! holds only its own slot.

use std::time::Duration;

use payments::worker::WorkerConfig;
use psp_sim::Faults;
use reliability::failpoint::FailPoints;
use service_kit::service::ShutdownToken;
use testkit::wait_until;

use crate::TestApp;

const DEADLINE: Duration = Duration::from_secs(30);

fn config(max_in_flight: usize, tenant_share: usize) -> WorkerConfig {
    WorkerConfig {
        max_in_flight,
        tenant_share,
        poll_interval: Duration::from_millis(50),
        ..WorkerConfig::default()
    }
}

#[tokio::test]
async fn calls_run_side_by_side_and_a_bursting_tenant_cannot_starve_another() {
    let app = TestApp::spawn().await;
    // Tenant 1 bursts 40 payments; tenant 2 has 3, recorded after them.
    for order in 1..=40 {
        app.reserve(1, order, "c-1", 100).await;
    }
    for order in 41..=43 {
        app.reserve(2, order, "c-2", 100).await;
    }
    app.psp.set_faults(Faults {
        latency_ms: 150,
        ..Faults::default()
    });
    let worker = app.worker_with(config(8, 4), Duration::from_secs(5), FailPoints::none());
    let stop = ShutdownToken::new();
    let running = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await }
    });

    wait_until(DEADLINE, "tenant 2's payments captured", || async {
        app.statuses(2).await.iter().all(|s| s == "captured")
    })
    .await;
    let tenant1_open = app
        .statuses(1)
        .await
        .iter()
        .filter(|s| *s == "pending")
        .count();
    assert!(
        tenant1_open >= 20,
        "tenant 2 went first in the queue of slots, not after tenant 1's burst ({tenant1_open} of 40 still open)"
    );
    wait_until(DEADLINE, "tenant 1's payments captured", || async {
        app.statuses(1).await.iter().all(|s| s == "captured")
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();

    assert_eq!(app.psp.total_charges(), 43, "one charge per payment");
    let (all, tenant1) = (app.psp.peak_in_flight(""), app.psp.peak_in_flight("pay-1"));
    assert!(
        (6..=8).contains(&all),
        "calls ran side by side, at most 8: peak {all}"
    );
    assert!(
        tenant1 <= 4,
        "tenant 1 never held more than its share of 4: peak {tenant1}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_hung_call_holds_only_its_own_slot() {
    let app = TestApp::spawn().await;
    app.reserve(1, 1, "c-1", 100).await;
    app.psp.set_faults(Faults {
        charge_then_hang_next: 1,
        hang_ms: 4_000,
        ..Faults::default()
    });
    let worker = app.worker_with(config(4, 4), Duration::from_secs(10), FailPoints::none());
    let stop = ShutdownToken::new();
    let running = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await }
    });
    wait_until(DEADLINE, "the first call hangs at the provider", || async {
        app.psp.peak_in_flight("") == 1
    })
    .await;
    for order in 2..=13 {
        app.reserve(1, order, "c-1", 100).await;
    }
    wait_until(DEADLINE, "the 12 later payments captured", || async {
        app.statuses(1)
            .await
            .iter()
            .filter(|s| *s == "captured")
            .count()
            == 12
    })
    .await;
    assert_eq!(
        app.payment(1).await.1,
        "pending",
        "the hung call is still out"
    );
    wait_until(DEADLINE, "the hung call answered", || async {
        app.payment(1).await.1 == "captured"
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(app.psp.total_charges(), 13);
    app.stop().await;
}

#[tokio::test]
async fn a_claim_skips_a_payment_another_worker_holds_instead_of_waiting_for_it() {
    let app = TestApp::spawn().await;
    app.reserve(1, 1, "c-1", 100).await;
    app.reserve(1, 2, "c-1", 100).await;
    // Another worker is in the middle of claiming order 1 (its row locked).
    let mut other = app.db.owner.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM payments WHERE order_id = 1 FOR UPDATE")
        .execute(&mut *other)
        .await
        .unwrap();
    let worker = app.worker(FailPoints::none());
    let took = tokio::time::timeout(Duration::from_secs(5), worker.process_due())
        .await
        .expect("the claim waited on a row another worker holds")
        .unwrap();
    assert_eq!(took, 1, "only the free payment");
    assert_eq!(app.payment(2).await.1, "captured");
    assert_eq!(app.payment(1).await.1, "pending");
    other.rollback().await.unwrap();
    worker.process_due().await.unwrap();
    assert_eq!(app.payment(1).await.1, "captured");
    app.stop().await;
}

#[tokio::test]
async fn a_tenants_share_covers_its_payments_and_refunds_together() {
    let app = TestApp::spawn().await;
    let share_of_two = app.worker_with(config(64, 2), Duration::from_secs(5), FailPoints::none());
    for order in 1..=4 {
        app.reserve(1, order, "c-1", 100).await;
    }
    assert_eq!(share_of_two.process_due().await.unwrap(), 2);
    // Two captured payments get a refund each; two payments still wait.
    for (order, key) in [(1, "r-1"), (2, "r-2")] {
        let (payment_id, status, _) = app.payment(order).await;
        assert_eq!(status, "captured");
        let body = serde_json::json!({"payment_id": payment_id, "amount_cents": 10}).to_string();
        assert_eq!(app.api.post(1, "/refunds", key, &body).await.0, 201);
    }
    assert_eq!(
        share_of_two.process_due().await.unwrap(),
        2,
        "two calls for the tenant in all, not two of each kind"
    );
    app.stop().await;
}
