//! psp-sim: a stand-in for an external payment provider, for the local
//! stack and the tests. It owns nothing of ours: its state is in memory, as
//! a third party's would be out of our reach.
//!
//! - `POST /charges` and `POST /refunds` are idempotent on
//!   `X-Idempotency-Key`: 201 the first time, 200 with the same result after.
//!   A customer id starting with `decline` is declined.
//! - `GET /charges/{key}` and `GET /refunds/{key}` look a request up by its
//!   idempotency key (404: nothing was done under it), as real providers
//!   let a merchant find a payment by its reference.
//! - A refund names the charge by id, or by the key it was made under.
//! - `/control/*` lets tests inject latency, errors before or after the
//!   charge, 4xx refusals, non-final answers and hangs, and read how many
//!   charges each key caused and how many calls were in flight at most.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use reliability::http::ApiError;
use reliability::service::ShutdownToken;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

mod routes;
use routes::{
    charge_by_key, control_charge, control_charges, control_faults, control_reset, create_charge,
    create_refund, refund_by_key,
};

#[derive(Debug, Clone, clap::Parser)]
#[command(version, about = "Payment-provider simulator")]
pub struct Settings {
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PSP_SIM_PORT", default_value_t = 8090)]
    pub port: u16,
    /// Address to listen on (0.0.0.0 in containers, where payments reaches
    /// it by service name).
    #[arg(long, env = "BIND_ADDRESS", default_value = "127.0.0.1")]
    pub bind_address: String,
}

impl Settings {
    /// On loopback, `port` (0 picks a free one).
    pub fn local(port: u16) -> Self {
        Self {
            port,
            bind_address: "127.0.0.1".into(),
        }
    }
}

/// Faults applied to the next requests (each counter is used up one request at a time).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Added to every charge and refund.
    pub latency_ms: u64,
    /// Answer 503 before charging.
    pub fail_next: u32,
    /// Charge, then answer 500 (the caller cannot know it was charged).
    pub charge_then_fail_next: u32,
    /// Charge, then hang for `hang_ms` (the caller times out).
    pub charge_then_hang_next: u32,
    pub hang_ms: u64,
    /// Answer 422 before charging (a refusal that says nothing about earlier tries).
    pub reject_next: u32,
    /// Charge, but answer `"status": "pending"` (not final); a repeat of the key
    /// answers the final status.
    pub pending_next: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct Charge {
    pub charge_id: String,
    pub status: &'static str,
    pub amount_cents: i64,
    pub currency: String,
    pub customer_id: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Refund {
    pub refund_id: String,
    pub charge_id: String,
    pub status: &'static str,
    pub amount_cents: i64,
}

#[derive(Default)]
struct Ledger {
    charges: HashMap<String, Charge>,
    refunds: HashMap<String, Refund>,
    /// How many times a key made money move. Above 1 would be a double charge.
    times_charged: HashMap<String, u32>,
    times_refunded: HashMap<String, u32>,
    faults: Faults,
    /// Charge and refund calls being served now, and the most at once:
    /// overall and per key prefix (`pay-<tenant>`: per tenant of ours).
    in_flight: HashMap<String, u32>,
    peak_in_flight: HashMap<String, u32>,
    /// The last `traceparent` each key's charge or refund came with.
    traceparents: HashMap<String, String>,
}

#[derive(Clone, Default)]
pub struct Simulator(Arc<Mutex<Ledger>>);

#[derive(Debug, Deserialize)]
struct ChargeRequest {
    amount_cents: i64,
    currency: String,
    customer_id: String,
}

#[derive(Debug, Deserialize)]
struct RefundRequest {
    #[serde(default)]
    charge_id: Option<String>,
    /// The idempotency key the charge was made under, instead of its id.
    #[serde(default)]
    charge_key: Option<String>,
    amount_cents: i64,
}

enum Fault {
    None,
    FailAfter,
    HangAfter(Duration),
    Pending,
}

/// Counts one call in flight (overall and under its key's prefix) while alive.
struct InFlight {
    sim: Simulator,
    prefix: String,
}

impl InFlight {
    fn new(sim: &Simulator, key: &str) -> Self {
        let prefix = key.rsplit_once('-').map_or(key, |(p, _)| p).to_owned();
        let mut ledger = sim.ledger();
        for name in ["", prefix.as_str()] {
            let now = ledger.in_flight.entry(name.to_owned()).or_default();
            *now += 1;
            let now = *now;
            let peak = ledger.peak_in_flight.entry(name.to_owned()).or_default();
            *peak = (*peak).max(now);
        }
        Self {
            sim: sim.clone(),
            prefix,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut ledger = self.sim.ledger();
        for name in ["", self.prefix.as_str()] {
            if let Some(n) = ledger.in_flight.get_mut(name) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

fn key(headers: &HeaderMap) -> Result<String, ApiError> {
    headers
        .get("x-idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "idempotency_key_missing",
                "X-Idempotency-Key is required",
            )
        })
}

impl Simulator {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.0.lock().expect("ledger lock poisoned")
    }

    /// An injected 4xx, drawn before the key is even looked at: real
    /// providers refuse retries too (a changed body, a conflict), and a
    /// refusal says nothing about what an earlier try did.
    fn draw_refusal(&self) -> Result<(), ApiError> {
        let f = &mut self.ledger().faults;
        if f.reject_next > 0 {
            f.reject_next -= 1;
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "rejected",
                "injected refusal",
            ));
        }
        Ok(())
    }

    /// Latency, then the fault this request draws.
    async fn draw_fault(&self) -> Result<Fault, ApiError> {
        let latency = self.ledger().faults.latency_ms;
        if latency > 0 {
            tokio::time::sleep(Duration::from_millis(latency)).await;
        }
        let mut ledger = self.ledger();
        let f = &mut ledger.faults;
        if f.fail_next > 0 {
            f.fail_next -= 1;
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "injected failure",
            ));
        }
        if f.charge_then_fail_next > 0 {
            f.charge_then_fail_next -= 1;
            return Ok(Fault::FailAfter);
        }
        if f.charge_then_hang_next > 0 {
            f.charge_then_hang_next -= 1;
            return Ok(Fault::HangAfter(Duration::from_millis(f.hang_ms.max(1))));
        }
        if f.pending_next > 0 {
            f.pending_next -= 1;
            return Ok(Fault::Pending);
        }
        Ok(Fault::None)
    }

    async fn after(fault: Fault, response: Response) -> Response {
        match fault {
            Fault::None => response,
            Fault::FailAfter => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "injected failure after charging",
            )
            .into_response(),
            Fault::HangAfter(d) => {
                tokio::time::sleep(d).await;
                response
            }
            Fault::Pending => response,
        }
    }
}

/// The simulator's routes around `sim` (shared so tests can inspect it).
pub fn router(sim: Simulator) -> Router {
    Router::new()
        .route("/charges", post(create_charge))
        .route("/charges/{key}", get(charge_by_key))
        .route("/refunds", post(create_refund))
        .route("/refunds/{key}", get(refund_by_key))
        .route("/control/charges", get(control_charges))
        .route("/control/charges/{key}", get(control_charge))
        .route("/control/faults", post(control_faults))
        .route("/control/reset", post(control_reset))
        .route(
            "/healthz",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .route(
            "/readyz",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .with_state(sim)
}

impl Simulator {
    /// Times money moved for `key` (0 or 1 unless something double-charged).
    pub fn times_charged(&self, key: &str) -> u32 {
        self.ledger().times_charged.get(key).copied().unwrap_or(0)
    }

    fn note_traceparent(&self, key: &str, headers: &HeaderMap) {
        if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
            self.ledger()
                .traceparents
                .insert(key.to_owned(), tp.to_owned());
        }
    }

    /// The `traceparent` the last charge or refund under `key` came with.
    pub fn traceparent(&self, key: &str) -> Option<String> {
        self.ledger().traceparents.get(key).cloned()
    }

    pub fn total_charges(&self) -> u32 {
        self.ledger().times_charged.values().sum()
    }

    pub fn total_refunds(&self) -> u32 {
        self.ledger().times_refunded.values().sum()
    }

    /// The most calls served at once, overall (`prefix` "") or under one
    /// key prefix (`pay-1`: tenant 1's charges).
    pub fn peak_in_flight(&self, prefix: &str) -> u32 {
        self.ledger()
            .peak_in_flight
            .get(prefix)
            .copied()
            .unwrap_or(0)
    }

    pub fn set_faults(&self, faults: Faults) {
        self.ledger().faults = faults;
    }
}

/// A bound simulator, ready to run.
pub struct Application {
    listener: TcpListener,
    sim: Simulator,
}

impl Application {
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let listener = TcpListener::bind((settings.bind_address.as_str(), settings.port))
            .await
            .map_err(|e| {
                anyhow::anyhow!("bind {}:{}: {e}", settings.bind_address, settings.port)
            })?;
        Ok(Self {
            listener,
            sim: Simulator::default(),
        })
    }

    pub fn port(&self) -> u16 {
        self.listener.local_addr().map_or(0, |a| a.port())
    }

    pub fn simulator(&self) -> Simulator {
        self.sim.clone()
    }

    pub async fn run_until_stopped(self, shutdown: ShutdownToken) -> anyhow::Result<()> {
        tracing::info!(port = self.port(), "psp-sim listening");
        reliability::service::serve(self.listener, router(self.sim), shutdown).await?;
        Ok(())
    }
}
