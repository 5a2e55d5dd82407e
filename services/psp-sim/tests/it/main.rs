//! The simulator keeps its promises: idempotent charges, declines, faults.

use psp_sim::{Application, Faults, Settings};
use serde_json::{Value, json};
use service_kit::service::ShutdownToken;

async fn start() -> (String, psp_sim::Simulator, ShutdownToken) {
    let app = Application::build(Settings::local(0)).await.unwrap();
    let (url, sim, stop) = (
        format!("http://127.0.0.1:{}", app.port()),
        app.simulator(),
        ShutdownToken::new(),
    );
    tokio::spawn(app.run_until_stopped(stop.clone()));
    (url, sim, stop)
}

async fn charge(url: &str, key: &str, customer: &str) -> (u16, Value) {
    post_charge(url, key, customer, None).await
}

/// A charge of 12.50 under `key`, with `X-Not-After` if given.
async fn post_charge(
    url: &str,
    key: &str,
    customer: &str,
    not_after: Option<&str>,
) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("{url}/charges"))
        .header("X-Idempotency-Key", key);
    if let Some(t) = not_after {
        request = request.header("X-Not-After", t);
    }
    let resp = request
        .json(&json!({"amount_cents": 1250, "currency": "EUR", "customer_id": customer}))
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap())
}

#[tokio::test]
async fn a_repeated_key_returns_the_same_charge_without_charging_again() {
    let (url, sim, stop) = start().await;
    let (s1, first) = charge(&url, "pay-1", "c-1").await;
    let (s2, again) = charge(&url, "pay-1", "c-1").await;
    assert_eq!((s1, s2), (201, 200));
    assert_eq!(first, again);
    assert_eq!(first["status"], "succeeded");
    assert_eq!(sim.times_charged("pay-1"), 1);
    stop.cancel();
}

#[tokio::test]
async fn customers_named_decline_are_declined_and_never_charged() {
    let (url, sim, stop) = start().await;
    let (status, body) = charge(&url, "pay-2", "decline-me").await;
    assert_eq!((status, body["status"].as_str()), (201, Some("declined")));
    assert_eq!(sim.total_charges(), 0);
    stop.cancel();
}

#[tokio::test]
async fn a_charge_that_fails_after_charging_is_found_again_by_its_key() {
    let (url, sim, stop) = start().await;
    sim.set_faults(Faults {
        charge_then_fail_next: 1,
        ..Faults::default()
    });
    let (status, _) = charge(&url, "pay-3", "c-1").await;
    assert_eq!(status, 500);
    let (status, body) = charge(&url, "pay-3", "c-1").await;
    assert_eq!((status, body["status"].as_str()), (200, Some("succeeded")));
    assert_eq!(sim.times_charged("pay-3"), 1);
    stop.cancel();
}

async fn charge_not_after(url: &str, key: &str, not_after: &str) -> (u16, Value) {
    post_charge(url, key, "c-1", Some(not_after)).await
}

#[tokio::test]
async fn a_request_past_its_not_after_books_nothing_and_leaves_its_key_free() {
    let (url, sim, stop) = start().await;
    let past = (chrono::Utc::now() - chrono::Duration::seconds(1)).to_rfc3339();
    let (status, body) = charge_not_after(&url, "pay-5", &past).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (422, Some("request_expired"))
    );
    assert_eq!(sim.total_charges(), 0);
    assert!(sim.money().is_empty(), "nothing booked under the key");
    // A later try under the same key, within its own bound, is served.
    let future = (chrono::Utc::now() + chrono::Duration::seconds(30)).to_rfc3339();
    let (status, body) = charge_not_after(&url, "pay-5", &future).await;
    assert_eq!((status, body["status"].as_str()), (201, Some("succeeded")));
    // Once the key holds a result, it answers it whatever the bound says.
    let (status, again) = charge_not_after(&url, "pay-5", &past).await;
    assert_eq!(
        (status, again["charge_id"].clone()),
        (200, body["charge_id"].clone())
    );
    let (status, body) = charge_not_after(&url, "pay-6", "yesterday").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("not_after_invalid"))
    );
    assert_eq!(sim.total_charges(), 1);
    stop.cancel();
}

#[tokio::test]
async fn a_late_landing_past_its_requests_not_after_is_dropped() {
    let (url, sim, stop) = start().await;
    sim.set_faults(Faults {
        land_late_next: 1,
        land_after_ms: 3_600_000,
        hang_ms: 1,
        ..Faults::default()
    });
    let soon = (chrono::Utc::now() + chrono::Duration::milliseconds(300)).to_rfc3339();
    let (status, _) = charge_not_after(&url, "pay-7", &soon).await;
    assert_eq!(status, 504);
    // The provider's processing outlives the request's bound.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while chrono::Utc::now() <= chrono::DateTime::parse_from_rfc3339(&soon).unwrap() {
        assert!(std::time::Instant::now() < until);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    sim.settle_all();
    assert!(!sim.busy());
    assert!(
        sim.money().is_empty(),
        "a landing past its bound books nothing"
    );
    stop.cancel();
}
