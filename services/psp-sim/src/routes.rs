//! The provider's HTTP API: charges and refunds by idempotency key, their\n//! lookups, and the control routes tests use to read and steer it.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use reliability::http::ApiError;
use serde::Serialize;

use crate::{
    Charge, ChargeRequest, Fault, Faults, InFlight, Ledger, Refund, RefundRequest, Simulator, key,
};

pub(crate) async fn create_charge(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<Response, ApiError> {
    let key = key(&headers)?;
    sim.note_traceparent(&key, &headers);
    let _counted = InFlight::new(&sim, &key);
    sim.draw_refusal()?;
    if let Some(existing) = sim.ledger().charges.get(&key).cloned() {
        return Ok((StatusCode::OK, Json(existing)).into_response());
    }
    let fault = sim.draw_fault().await?;
    let pending = matches!(fault, Fault::Pending);
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
    let mut answer = charge;
    if pending && answer.status == "succeeded" {
        answer.status = "pending";
    }
    Ok(Simulator::after(fault, (StatusCode::CREATED, Json(answer)).into_response()).await)
}

pub(crate) async fn create_refund(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    Json(req): Json<RefundRequest>,
) -> Result<Response, ApiError> {
    let key = key(&headers)?;
    sim.note_traceparent(&key, &headers);
    let _counted = InFlight::new(&sim, &key);
    sim.draw_refusal()?;
    if let Some(existing) = sim.ledger().refunds.get(&key).cloned() {
        return Ok((StatusCode::OK, Json(existing)).into_response());
    }
    let fault = sim.draw_fault().await?;
    let refund = {
        let mut ledger = sim.ledger();
        if let Some(existing) = ledger.refunds.get(&key).cloned() {
            return Ok((StatusCode::OK, Json(existing)).into_response());
        }
        let charge = match (&req.charge_id, &req.charge_key) {
            (_, Some(by_key)) => ledger.charges.get(by_key),
            (Some(id), None) => ledger.charges.values().find(|c| &c.charge_id == id),
            (None, None) => None,
        };
        let Some(charge) = charge.filter(|c| c.status == "succeeded").cloned() else {
            // By key, 404 says what the caller needs: nothing was charged under it.
            let status = if req.charge_key.is_some() {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::UNPROCESSABLE_ENTITY
            };
            return Err(ApiError::new(
                status,
                "unknown_charge",
                "no succeeded charge with that id or key",
            ));
        };
        let refund = Refund {
            refund_id: format!("re_{}", uuid::Uuid::new_v4().simple()),
            charge_id: charge.charge_id,
            status: "succeeded",
            amount_cents: req.amount_cents,
        };
        ledger.refunds.insert(key.clone(), refund.clone());
        *ledger.times_refunded.entry(key).or_default() += 1;
        refund
    };
    Ok(Simulator::after(fault, (StatusCode::CREATED, Json(refund)).into_response()).await)
}

/// `GET /charges/{key}`: the charge made under `key`, or 404.
pub(crate) async fn charge_by_key(
    State(sim): State<Simulator>,
    Path(key): Path<String>,
) -> Result<Json<Charge>, ApiError> {
    found(
        sim.ledger().charges.get(&key).cloned(),
        "no charge under that key",
    )
}

/// `GET /refunds/{key}`: the refund made under `key`, or 404.
pub(crate) async fn refund_by_key(
    State(sim): State<Simulator>,
    Path(key): Path<String>,
) -> Result<Json<Refund>, ApiError> {
    found(
        sim.ledger().refunds.get(&key).cloned(),
        "no refund under that key",
    )
}

fn found<T>(item: Option<T>, missing: &str) -> Result<Json<T>, ApiError> {
    item.map(Json)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", missing))
}

#[derive(Debug, Serialize)]
struct KeyCount {
    key: String,
    times_charged: u32,
}

pub(crate) async fn control_charges(State(sim): State<Simulator>) -> Json<serde_json::Value> {
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
    let peak = ledger.peak_in_flight.get("").copied().unwrap_or(0);
    Json(serde_json::json!({
        "charges": per_key, "total_charges": total, "total_refunds": refunds, "peak_in_flight": peak,
    }))
}

pub(crate) async fn control_charge(
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

pub(crate) async fn control_faults(
    State(sim): State<Simulator>,
    Json(faults): Json<Faults>,
) -> Json<Faults> {
    sim.ledger().faults = faults.clone();
    Json(faults)
}

pub(crate) async fn control_reset(State(sim): State<Simulator>) -> StatusCode {
    *sim.ledger() = Ledger::default();
    StatusCode::NO_CONTENT
}
