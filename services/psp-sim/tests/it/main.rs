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
    let resp = reqwest::Client::new()
        .post(format!("{url}/charges"))
        .header("X-Idempotency-Key", key)
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
