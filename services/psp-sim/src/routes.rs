//! The provider's HTTP API: charges and refunds by idempotency key, their
//! look-ups and lists, and the control routes tests use to read and steer it.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Serialize;
use service_kit::http::ApiError;
use std::time::Duration;

use crate::headers::{in_time, key, not_after};
use crate::ledger::{ListQuery, Page};
use crate::{
    Charge, ChargeRequest, Fault, Faults, InFlight, Ledger, PendingCharge, Refund, RefundRequest,
    Simulator,
};

pub(crate) async fn create_charge(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<Response, ApiError> {
    let key = key(&headers)?;
    let not_after = not_after(&headers)?;
    sim.note_traceparent(&key, &headers);
    let _counted = InFlight::new(&sim, &key);
    sim.draw_refusal()?;
    if let Some(existing) = sim.replay_charge(&key, &req)? {
        return Ok((StatusCode::OK, Json(existing)).into_response());
    }
    let fault = sim.draw_fault().await?;
    // Checked once processing starts: nothing below awaits before booking.
    in_time(not_after)?;
    let request = PendingCharge {
        amount_cents: req.amount_cents,
        currency: req.currency.clone(),
        customer_id: req.customer_id.clone(),
        created_at: Utc::now(),
        not_after,
    };
    if let Fault::LandLate { hang, land } = fault {
        if !sim.start_landing(&key, request) {
            return sim.answer_replay(&key, &req);
        }
        let (landing, key) = (sim.clone(), key.clone());
        tokio::spawn(async move {
            tokio::time::sleep(land).await;
            landing.ledger().land(&key);
        });
        tokio::time::sleep(hang).await;
        return Err(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            "injected: still processing",
        ));
    }
    let charge = {
        let mut ledger = sim.ledger();
        // Another request with this key may have won while we slept.
        if ledger.charges.contains_key(&key) || ledger.landing.contains_key(&key) {
            drop(ledger);
            return sim.answer_replay(&key, &req);
        }
        let declined = req.customer_id.starts_with("decline");
        let status = match (&fault, declined) {
            (_, true) => "declined",
            (Fault::Pending(_), false) => "pending",
            _ => "succeeded",
        };
        let charge = ledger.book(&key, request, status);
        if let (Fault::Pending(fail), "pending") = (&fault, status) {
            ledger.settling.insert(key.clone());
            let settle = Duration::from_millis(match ledger.faults.settle_ms {
                0 => 200,
                ms => ms,
            });
            let (sim, key, fail) = (sim.clone(), key.clone(), *fail);
            tokio::spawn(async move {
                tokio::time::sleep(settle).await;
                sim.ledger().settle(&key, fail);
            });
        }
        charge
    };
    Ok(Simulator::after(fault, (StatusCode::CREATED, Json(charge)).into_response()).await)
}

pub(crate) async fn create_refund(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    Json(req): Json<RefundRequest>,
) -> Result<Response, ApiError> {
    let key = key(&headers)?;
    let not_after = not_after(&headers)?;
    sim.note_traceparent(&key, &headers);
    let _counted = InFlight::new(&sim, &key);
    sim.draw_refusal()?;
    let params = serde_json::to_value(&req).unwrap_or_default();
    {
        let mut ledger = sim.ledger();
        if ledger.reused("refund", &key, params.clone()) {
            return Err(reused());
        }
        if let Some(existing) = ledger.refunds.get(&key).cloned() {
            return Ok((StatusCode::OK, Json(existing)).into_response());
        }
    }
    let fault = sim.draw_fault().await?;
    in_time(not_after)?;
    let refund = {
        let mut ledger = sim.ledger();
        if let Some(existing) = ledger.refunds.get(&key).cloned() {
            return Ok((StatusCode::OK, Json(existing)).into_response());
        }
        let charge = match (&req.charge_id, &req.charge_key) {
            (_, Some(by_key)) => ledger.charges.get_mut(by_key),
            (Some(id), None) => ledger.charges.values_mut().find(|c| &c.charge_id == id),
            (None, None) => None,
        };
        let Some(charge) = charge else {
            // By key, 404 says only that nothing is booked under it yet.
            let status = if req.charge_key.is_some() {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::UNPROCESSABLE_ENTITY
            };
            return Err(ApiError::new(
                status,
                "unknown_charge",
                "no charge with that id or key",
            ));
        };
        if charge.status == "pending" {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "charge_pending",
                "the charge has not settled yet",
            ));
        }
        if charge.status != "succeeded" {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "charge_not_succeeded",
                "nothing was charged to refund",
            ));
        }
        if req.amount_cents <= 0 || req.amount_cents > charge.amount_cents - charge.refunded_cents {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "amount_exceeds_charge",
                "the refund exceeds what is left of the charge",
            ));
        }
        let (charge_id, charge_key) = (charge.charge_id.clone(), charge.key.clone());
        let fails = ledger.faults.refund_fail_next > 0;
        let status = if fails {
            ledger.faults.refund_fail_next -= 1;
            "failed"
        } else {
            let charge = ledger.charges.get_mut(&charge_key).expect("found above");
            charge.refunded_cents += req.amount_cents;
            "succeeded"
        };
        let refund = Refund {
            refund_id: format!("re_{}", uuid::Uuid::new_v4().simple()),
            key: key.clone(),
            charge_id,
            charge_key,
            status: status.into(),
            amount_cents: req.amount_cents,
            created_at: Utc::now(),
        };
        ledger.refunds.insert(key.clone(), refund.clone());
        *ledger.times_refunded.entry(key).or_default() += 1;
        refund
    };
    Ok(Simulator::after(fault, (StatusCode::CREATED, Json(refund)).into_response()).await)
}

fn reused() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "idempotency_key_reused",
        "this key was used with other parameters",
    )
}

fn in_progress() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "request_in_progress",
        "a request with this key is still being processed",
    )
}

impl Simulator {
    /// Marks `key` as landing unless another request with it won meanwhile.
    fn start_landing(&self, key: &str, request: PendingCharge) -> bool {
        let mut ledger = self.ledger();
        if ledger.charges.contains_key(key) || ledger.landing.contains_key(key) {
            return false;
        }
        ledger.landing.insert(key.to_owned(), request);
        true
    }

    fn answer_replay(&self, key: &str, req: &ChargeRequest) -> Result<Response, ApiError> {
        Ok(match self.replay_charge(key, req)? {
            Some(existing) => (StatusCode::OK, Json(existing)).into_response(),
            None => in_progress().into_response(),
        })
    }

    /// A replayed key answers what it first did (its current state), a key
    /// reused with other parameters is 409, and one still landing is 409.
    fn replay_charge(&self, key: &str, req: &ChargeRequest) -> Result<Option<Charge>, ApiError> {
        let mut ledger = self.ledger();
        if ledger.reused("charge", key, serde_json::to_value(req).unwrap_or_default()) {
            return Err(reused());
        }
        if ledger.landing.contains_key(key) {
            return Err(in_progress());
        }
        Ok(ledger.charges.get(key).cloned())
    }
}

/// `GET /charges`: charges created in a window, oldest first, by pages.
pub(crate) async fn list_charges(
    State(sim): State<Simulator>,
    Query(q): Query<ListQuery>,
) -> Json<Page<Charge>> {
    let ledger = sim.ledger();
    Json(q.page(ledger.charges.values().cloned(), |c| {
        (c.created_at, c.key.clone())
    }))
}

/// `GET /refunds`: refunds created in a window, oldest first, by pages.
pub(crate) async fn list_refunds(
    State(sim): State<Simulator>,
    Query(q): Query<ListQuery>,
) -> Json<Page<Refund>> {
    let ledger = sim.ledger();
    Json(q.page(ledger.refunds.values().cloned(), |r| {
        (r.created_at, r.key.clone())
    }))
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

/// Every charge key's money: charged, refunded, times charged.
pub(crate) async fn control_ledger(State(sim): State<Simulator>) -> Json<Vec<crate::KeyMoney>> {
    Json(sim.money())
}

/// Lands and settles everything in progress now.
pub(crate) async fn control_settle(State(sim): State<Simulator>) -> StatusCode {
    sim.settle_all();
    StatusCode::NO_CONTENT
}
