//! The extractor's side: the caller, the key, the body and its hash checked
//! before anything is claimed, then the claim.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{FromRef, FromRequest, FromRequestParts, MatchedPath, Request};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use super::claim::{Claim, claim, still_in_flight};
use super::{HEADER, IdempotencyConfig, Idempotent};
use crate::admission::Backlog;
use crate::auth::{JwtKeys, Tenant};
use crate::http::ApiError;
use reliability::Result;

fn bad_request(code: &'static str, message: &str) -> Response {
    ApiError::new(StatusCode::BAD_REQUEST, code, message).into_response()
}

/// 1 to 255 visible ASCII characters.
fn parse_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let bad = |code, message: &str| ApiError::new(StatusCode::BAD_REQUEST, code, message);
    let raw = headers.get(HEADER).ok_or_else(|| {
        bad(
            "idempotency_key_missing",
            "the Idempotency-Key header is required",
        )
    })?;
    let bytes = raw.as_bytes();
    if bytes.is_empty() || bytes.len() > 255 || !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(bad(
            "idempotency_key_invalid",
            "Idempotency-Key must be 1 to 255 visible ASCII characters",
        ));
    }
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

/// SHA-256 of the body in RFC 8785 canonical form: key order, whitespace and
/// number spelling (`2.0` vs `2`) do not change it.
///
/// RFC 8785 writes every number as an IEEE double, so two integers past
/// ±2^53 can share a canonical form, and a second request would be
/// answered with the first's response for a body it never sent. Such
/// integers are hashed once more, exactly, after the canonical form and a
/// NUL byte (which the canonical form, escaping every control character,
/// never holds): bodies within I-JSON's range hash as RFC 8785 says.
pub fn request_hash(body: &serde_json::Value) -> Vec<u8> {
    let canonical = serde_jcs::to_vec(body).expect("a parsed JSON value always serializes");
    let mut hash = Sha256::new();
    hash.update(&canonical);
    let mut inexact = Vec::new();
    integers_past_doubles(body, &mut inexact);
    if !inexact.is_empty() {
        hash.update([0]);
        hash.update(inexact.join(",").as_bytes());
    }
    hash.finalize().to_vec()
}

/// The largest integer an IEEE double holds exactly.
const EXACT: u64 = 1 << 53;

/// Every integer of `v` that a double cannot hold, in the value's order.
fn integers_past_doubles(v: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    match v {
        Value::Number(n) => {
            let past = n.as_u64().is_some_and(|u| u > EXACT)
                || n.as_i64().is_some_and(|i| i.unsigned_abs() > EXACT);
            if past {
                out.push(n.to_string());
            }
        }
        Value::Array(items) => items.iter().for_each(|i| integers_past_doubles(i, out)),
        Value::Object(fields) => fields.values().for_each(|f| integers_past_doubles(f, out)),
        _ => {}
    }
}

impl<S, T> FromRequest<S> for Idempotent<T>
where
    S: Send + Sync,
    IdempotencyConfig: FromRef<S>,
    JwtKeys: FromRef<S>,
    T: DeserializeOwned + Send,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let started = Instant::now();
        let (mut parts, body) = req.into_parts();
        let Tenant(tenant) = Tenant::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let key = parse_key(&parts.headers).map_err(IntoResponse::into_response)?;
        let route = parts
            .extensions
            .get::<MatchedPath>()
            .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
        let scope = format!("{} {route}", parts.method);
        let backlog = parts.extensions.get::<Backlog>().cloned();

        let bytes = Bytes::from_request(Request::from_parts(parts, body), state)
            .await
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "payload_too_large",
                        "the body exceeds the size limit",
                    )
                    .into_response()
                } else {
                    bad_request("unreadable_body", "the request body could not be read")
                }
            })?;
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|_| bad_request("malformed_json", "the body is not valid JSON"))?;
        let hash = request_hash(&value);
        let body: T = serde_json::from_value(value).map_err(|e| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_body",
                format!("the body does not match the schema: {e}"),
            )
            .into_response()
        })?;

        let config = IdempotencyConfig::from_ref(state);
        if let Err(wait) = config.rate_limit.check(tenant) {
            return Err(crate::rate_limit::rate_limited(&scope, wait).into_response());
        }
        let Some(in_flight) = config.enter((tenant, scope.clone(), key.clone())).await else {
            metrics::counter!(crate::metrics::IDEMPOTENCY_IN_FLIGHT, "scope" => scope).increment(1);
            return Err(still_in_flight());
        };
        let outcome = claim(&config, tenant, &scope, &key, &hash).await;
        metrics::histogram!(crate::metrics::IDEMPOTENCY_CHECK_DURATION, "scope" => scope.clone())
            .record(started.elapsed().as_secs_f64());
        let counter = |name: &'static str| metrics::counter!(name, "scope" => scope.clone());
        match outcome {
            Ok(Claim::Fresh(tx)) => {
                // Admission after the key's look-up (ADR 0027, amended in
                // session 34): a retry of accepted work gets its stored
                // answer even at the bound, and a refusal rolls the claim
                // back, so the key stays free and nothing is written.
                if let Some(backlog) = backlog
                    && let Err(secs) = backlog.admit(tenant).await
                {
                    let _ = tx.rollback().await;
                    return Err(ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "backlog_full",
                        "this tenant has as much work in flight as it may have; retry later",
                    )
                    .with_retry_after(secs)
                    .into_response());
                }
                counter(crate::metrics::IDEMPOTENCY_MISSES).increment(1);
                Ok(Self {
                    body,
                    tx,
                    scope,
                    key,
                    _in_flight: in_flight,
                })
            }
            Ok(Claim::Replayed(response)) => {
                counter(crate::metrics::IDEMPOTENCY_HITS).increment(1);
                Err(response)
            }
            Ok(Claim::Conflict(response)) => {
                counter(crate::metrics::IDEMPOTENCY_CONFLICTS).increment(1);
                Err(response)
            }
            Ok(Claim::InFlight) => {
                counter(crate::metrics::IDEMPOTENCY_IN_FLIGHT).increment(1);
                Err(still_in_flight())
            }
            Err(e) => Err(ApiError::failure(&e).into_response()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    #[test]
    fn hash_ignores_key_order_whitespace_and_number_spelling() {
        let a: serde_json::Value =
            serde_json::from_str(r#"{"b": [1, {"y": 2.0, "x": "s"}], "a": 1}"#).unwrap();
        let b: serde_json::Value =
            serde_json::from_str(r#"{"a":1,"b":[1,{"x":"s","y":2}]}"#).unwrap();
        assert_eq!(request_hash(&a), request_hash(&b));
        assert_ne!(
            request_hash(&a),
            request_hash(&json!({"a": 2, "b": [1, {"x": "s", "y": 2}]}))
        );
    }

    /// RFC 8785's own example (section 3.2.3): numbers as doubles, keys
    /// sorted, strings escaped as it says.
    #[test]
    fn the_canonical_form_is_rfc_8785s() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let value: serde_json::Value = serde_json::from_str(input).unwrap();
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(
            String::from_utf8(serde_jcs::to_vec(&value).unwrap()).unwrap(),
            expected
        );
        assert_eq!(
            request_hash(&value),
            Sha256::digest(expected.as_bytes()).to_vec()
        );
    }

    #[test]
    fn integers_past_2_pow_53_hash_apart() {
        let hash = |v: serde_json::Value| request_hash(&v);
        // Within a double's exact range: RFC 8785's hash, nothing added.
        let small = json!({"q": 9_007_199_254_740_992_u64});
        assert_eq!(
            hash(small.clone()),
            Sha256::digest(serde_jcs::to_vec(&small).unwrap()).to_vec()
        );
        // Past it: the same canonical form, different hashes.
        let (a, b) = (
            json!({"a": [{"q": 9_007_199_254_740_993_u64}]}),
            json!({"a": [{"q": 9_007_199_254_740_992_u64}]}),
        );
        assert_eq!(
            serde_jcs::to_vec(&a).unwrap(),
            serde_jcs::to_vec(&b).unwrap()
        );
        assert_ne!(hash(a.clone()), hash(b));
        assert_eq!(hash(a.clone()), hash(a));
        assert_ne!(
            hash(json!({"q": -9_007_199_254_740_993_i64})),
            hash(json!({"q": -9_007_199_254_740_992_i64}))
        );
    }

    #[test]
    fn keys_must_be_visible_ascii_of_bounded_length() {
        let mut h = HeaderMap::new();
        assert!(parse_key(&h).is_err());
        h.insert(HEADER, HeaderValue::from_static("order-1"));
        assert_eq!(parse_key(&h).unwrap(), "order-1");
        h.insert(HEADER, HeaderValue::from_static("has space"));
        assert!(parse_key(&h).is_err());
        h.insert(HEADER, HeaderValue::from_str(&"k".repeat(256)).unwrap());
        assert!(parse_key(&h).is_err());
        h.insert(HEADER, HeaderValue::from_str(&"k".repeat(255)).unwrap());
        assert!(parse_key(&h).is_ok());
    }
}
