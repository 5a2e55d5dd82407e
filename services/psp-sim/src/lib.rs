//! psp-sim: a stand-in for an external payment provider, for the local
//! stack and the tests. It owns nothing of ours: its state is in memory, as
//! a third party's would be out of our reach.
//!
//! - `POST /charges` and `POST /refunds` are idempotent on
//!   `X-Idempotency-Key`: 201 the first time, 200 with the same result after.
//!   A customer id starting with `decline` is declined.
//! - `/control/*` lets tests inject latency, errors before or after the
//!   charge, and hangs, and read how many charges each key caused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use reliability::http::ApiError;
use reliability::service::ShutdownToken;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

#[derive(Debug, Clone, clap::Parser)]
#[command(version, about = "Payment-provider simulator")]
pub struct Settings {
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PSP_SIM_PORT", default_value_t = 8090)]
    pub port: u16,
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
    charge_id: String,
    amount_cents: i64,
}

enum Fault {
    None,
    FailAfter,
    HangAfter(Duration),
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
        }
    }
}

async fn create_charge(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<Response, ApiError> {
    let key = key(&headers)?;
    if let Some(existing) = sim.ledger().charges.get(&key).cloned() {
        return Ok((StatusCode::OK, Json(existing)).into_response());
    }
    let fault = sim.draw_fault().await?;
    let charge = {
        let mut ledger = sim.ledger();
        // Another request with this key may have won while we slept.
        if let Some(existing) = ledger.charges.get(&key).cloned() {
            return Ok((StatusCode::OK, Json(existing)).into_response());
        }
        let declined = req.customer_id.starts_with("decline");
        let charge = Charge {
            charge_id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
            status: if declined { "declined" } else { "succeeded" },
            amount_cents: req.amount_cents,
            currency: req.currency,
            customer_id: req.customer_id,
        };
        ledger.charges.insert(key.clone(), charge.clone());
        if !declined {
            *ledger.times_charged.entry(key).or_default() += 1;
        }
        charge
    };
    Ok(Simulator::after(fault, (StatusCode::CREATED, Json(charge)).into_response()).await)
}

async fn create_refund(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    Json(req): Json<RefundRequest>,
) -> Result<Response, ApiError> {
    let key = key(&headers)?;
    if let Some(existing) = sim.ledger().refunds.get(&key).cloned() {
        return Ok((StatusCode::OK, Json(existing)).into_response());
    }
    let fault = sim.draw_fault().await?;
    let refund = {
        let mut ledger = sim.ledger();
        if let Some(existing) = ledger.refunds.get(&key).cloned() {
            return Ok((StatusCode::OK, Json(existing)).into_response());
        }
        if !ledger
            .charges
            .values()
            .any(|c| c.charge_id == req.charge_id && c.status == "succeeded")
        {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_charge",
                "no succeeded charge with that id",
            ));
        }
        let refund = Refund {
            refund_id: format!("re_{}", uuid::Uuid::new_v4().simple()),
            charge_id: req.charge_id,
            status: "succeeded",
            amount_cents: req.amount_cents,
        };
        ledger.refunds.insert(key.clone(), refund.clone());
        *ledger.times_refunded.entry(key).or_default() += 1;
        refund
    };
    Ok(Simulator::after(fault, (StatusCode::CREATED, Json(refund)).into_response()).await)
}

#[derive(Debug, Serialize)]
struct KeyCount {
    key: String,
    times_charged: u32,
}

async fn control_charges(State(sim): State<Simulator>) -> Json<serde_json::Value> {
    let ledger = sim.ledger();
    let mut per_key: Vec<KeyCount> = ledger
        .times_charged
        .iter()
        .map(|(k, n)| KeyCount {
            key: k.clone(),
            times_charged: *n,
        })
        .collect();
    per_key.sort_by(|a, b| a.key.cmp(&b.key));
    let total: u32 = per_key.iter().map(|k| k.times_charged).sum();
    let refunds: u32 = ledger.times_refunded.values().sum();
    Json(
        serde_json::json!({ "charges": per_key, "total_charges": total, "total_refunds": refunds }),
    )
}

async fn control_charge(
    State(sim): State<Simulator>,
    Path(key): Path<String>,
) -> Json<serde_json::Value> {
    let ledger = sim.ledger();
    Json(serde_json::json!({
        "key": key,
        "times_charged": ledger.times_charged.get(&key).copied().unwrap_or(0),
        "charge": ledger.charges.get(&key),
    }))
}

async fn control_faults(State(sim): State<Simulator>, Json(faults): Json<Faults>) -> Json<Faults> {
    sim.ledger().faults = faults.clone();
    Json(faults)
}

async fn control_reset(State(sim): State<Simulator>) -> StatusCode {
    *sim.ledger() = Ledger::default();
    StatusCode::NO_CONTENT
}

/// The simulator's routes around `sim` (shared so tests can inspect it).
pub fn router(sim: Simulator) -> Router {
    Router::new()
        .route("/charges", post(create_charge))
        .route("/refunds", post(create_refund))
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

    pub fn total_charges(&self) -> u32 {
        self.ledger().times_charged.values().sum()
    }

    pub fn total_refunds(&self) -> u32 {
        self.ledger().times_refunded.values().sum()
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
        let listener = TcpListener::bind(("127.0.0.1", settings.port)).await?;
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
