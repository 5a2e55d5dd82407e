//! What a request's headers ask of the provider: the idempotency key it is
//! made under, and the instant after which it may book nothing.

use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, Utc};
use service_kit::http::ApiError;

/// The instant after which this request may book nothing, if it says.
pub(crate) fn not_after(headers: &HeaderMap) -> Result<Option<DateTime<Utc>>, ApiError> {
    let Some(value) = headers.get("x-not-after") else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| DateTime::parse_from_rfc3339(v).ok())
        .map(|t| Some(t.with_timezone(&Utc)))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "not_after_invalid",
                "X-Not-After must be an RFC 3339 instant",
            )
        })
}

/// Refuses a request whose `X-Not-After` has passed: nothing is booked.
pub(crate) fn in_time(not_after: Option<DateTime<Utc>>) -> Result<(), ApiError> {
    match not_after {
        Some(t) if Utc::now() > t => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "request_expired",
            "the request arrived after its X-Not-After: nothing was done",
        )),
        _ => Ok(()),
    }
}

pub(crate) fn key(headers: &HeaderMap) -> Result<String, ApiError> {
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
