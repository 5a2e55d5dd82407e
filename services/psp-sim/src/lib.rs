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
//! - A refund names the charge by id, or by the key it was made under; it
//!   never exceeds what is left of the charge, and a charge still pending
//!   cannot be refunded yet (409).
//! - A key reused with other parameters is 409, as real providers answer.
//! - A charge or refund sent with `X-Not-After` (RFC 3339) books nothing
//!   after that instant: past it, a new request is refused (422
//!   `request_expired`, nothing booked under its key, only its parameters
//!   for the reuse check, so a later try with the same key and parameters
//!   is served), and a late landing is dropped. A key that
//!   already holds a result answers it whatever the header says. The
//!   caller's fence against its own stalled requests (docs/adr/0011).
//! - `GET /charges` and `GET /refunds` list by creation time
//!   (`created_gte`, `created_lt`, `limit`, `starting_after`), as real
//!   providers' list APIs do: what reconciliation reads.
//! - A charge can be accepted `pending` and settle later, or land after
//!   its caller gave up (invisible to look-ups until it does).
//! - `/control/*` lets tests inject latency, errors before or after the
//!   charge, 4xx refusals, pending charges, late landings and hangs, and
//!   read each key's money and how many calls were in flight at most.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use service_kit::http::ApiError;
use service_kit::service::ShutdownToken;
use tokio::net::TcpListener;

mod headers;
mod ledger;
mod routes;
pub use ledger::{Charge, KeyMoney, Page, Refund};
use ledger::{Ledger, PendingCharge};
use routes::{
    charge_by_key, control_charge, control_charges, control_faults, control_ledger, control_reset,
    control_settle, create_charge, create_refund, list_charges, list_refunds, refund_by_key,
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
    /// Accept as `"status": "pending"`: the charge settles (succeeds) after
    /// `settle_ms`, as an asynchronous capture or 3-D Secure does; until
    /// then a replay or a look-up answers pending, and a refund of it is 409.
    pub pending_next: u32,
    /// Like `pending_next`, but the charge then fails.
    pub pending_fail_next: u32,
    /// How long a pending charge takes to settle (0: 200 ms).
    pub settle_ms: u64,
    /// Take the request, answer 504 after `hang_ms`, and land the charge
    /// `land_after_ms` after the request: a charge that lands after its
    /// caller gave up. Until it lands, a look-up finds nothing and a replay
    /// of the key is 409 (in progress).
    pub land_late_next: u32,
    pub land_after_ms: u64,
    /// Accept a refund and answer it `"status": "failed"`, the money left
    /// where it was: a provider that fails refunds after taking them. A
    /// replay of its key answers the same failed refund.
    pub refund_fail_next: u32,
}

#[derive(Clone, Default)]
pub struct Simulator(Arc<Mutex<Ledger>>);

#[derive(Debug, Deserialize, Serialize)]
struct ChargeRequest {
    amount_cents: i64,
    currency: String,
    customer_id: String,
}

#[derive(Debug, Deserialize, Serialize)]
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
    /// Accepted as `pending`; settles later (to `failed` if `true`).
    Pending(bool),
    /// Accepted, answered 504 after `hang`, landed after `land`.
    LandLate {
        hang: Duration,
        land: Duration,
    },
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
            return Ok(Fault::Pending(false));
        }
        if f.pending_fail_next > 0 {
            f.pending_fail_next -= 1;
            return Ok(Fault::Pending(true));
        }
        if f.land_late_next > 0 {
            f.land_late_next -= 1;
            return Ok(Fault::LandLate {
                hang: Duration::from_millis(f.hang_ms.max(1)),
                land: Duration::from_millis(f.land_after_ms),
            });
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
            Fault::Pending(_) | Fault::LandLate { .. } => response,
        }
    }
}

/// The simulator's routes around `sim` (shared so tests can inspect it).
pub fn router(sim: Simulator) -> Router {
    Router::new()
        .route("/charges", post(create_charge).get(list_charges))
        .route("/charges/{key}", get(charge_by_key))
        .route("/refunds", post(create_refund).get(list_refunds))
        .route("/refunds/{key}", get(refund_by_key))
        .route("/control/charges", get(control_charges))
        .route("/control/charges/{key}", get(control_charge))
        .route("/control/faults", post(control_faults))
        .route("/control/reset", post(control_reset))
        .route("/control/ledger", get(control_ledger))
        .route("/control/settle", post(control_settle))
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

    /// Calls being served now, overall (`prefix` "") or under one prefix.
    pub fn in_flight(&self, prefix: &str) -> u32 {
        self.ledger().in_flight.get(prefix).copied().unwrap_or(0)
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

    /// Every charge's money, by key.
    pub fn money(&self) -> Vec<KeyMoney> {
        self.ledger().money()
    }

    /// Lands every late charge and settles every pending one now, as if
    /// the provider's processing time had passed.
    pub fn settle_all(&self) {
        self.ledger().settle_all();
    }

    /// Whether any charge is still landing or pending.
    pub fn busy(&self) -> bool {
        let l = self.ledger();
        !l.landing.is_empty() || !l.settling.is_empty()
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
        service_kit::service::serve(self.listener, router(self.sim), shutdown).await?;
        Ok(())
    }
}
