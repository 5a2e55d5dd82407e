//! The HTTP error shape of the contract: `{"error": {"code", "message"}}`.
//! Services map their own error enum onto [`ApiError`] in one place.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

mod failure;
pub use failure::{Domain, Failure, read_one};

/// A client-facing error: status, a stable snake_case code, a human message.
/// Never carries SQL text or a stack trace.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Seconds for a `Retry-After` header (425, 429, 503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    #[must_use]
    pub fn with_retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// The answer to a failed operation: 503 with `Retry-After` while a
    /// dependency is down (the request changed nothing, so a retry is safe
    /// and its Idempotency-Key is still free), else a logged 500.
    pub fn failure(cause: &reliability::Error) -> Self {
        if cause.is_unavailable() {
            tracing::warn!(error = %cause, "dependency unavailable; answering 503");
            metrics::counter!(crate::metrics::HTTP_UNAVAILABLE).increment(1);
            Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "a dependency is unavailable; retry later",
            )
            .with_retry_after(2)
        } else {
            Self::internal(cause)
        }
    }

    /// A 500 whose cause is logged here, once, and never shown to the client.
    pub fn internal(cause: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal error",
        )
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message.clone(),
            },
        }
    }
}

/// The body of every error response.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Stable, snake_case: what a client branches on.
    #[schema(example = "not_found")]
    pub code: String,
    /// For people; never SQL text or a stack trace.
    pub message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// JSON has one number type: `2` and `2.0` are the same number, and a
/// client (or a schema-driven generator) may send either for an integer
/// field. `#[serde(deserialize_with = "reliability::http::integer")]`
/// accepts any integral number that fits an `i64`, and nothing else.
pub fn integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    use serde::Deserialize;
    use serde::de::Error;
    let n = serde_json::Number::deserialize(d)?;
    integral(&n).ok_or_else(|| D::Error::custom(format!("expected an integer, got {n}")))
}

/// `n` as an `i64` if it is an integer in range (`3` or `3.0`).
pub fn integral(n: &serde_json::Number) -> Option<i64> {
    n.as_i64().or_else(|| {
        // 2^63 is exactly representable; anything at or beyond it is out.
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= -(2f64.powi(63)) && *f < 2f64.powi(63))
            .map(|f| f as i64)
    })
}

#[cfg(test)]
mod tests {
    use super::integral;

    #[test]
    fn integral_numbers_in_any_spelling_fit_and_others_do_not() {
        let n = |s: &str| serde_json::from_str::<serde_json::Number>(s).unwrap();
        assert_eq!(integral(&n("3")), Some(3));
        assert_eq!(integral(&n("3.0")), Some(3));
        assert_eq!(integral(&n("-1e3")), Some(-1000));
        assert_eq!(integral(&n("9223372036854775807")), Some(i64::MAX));
        assert_eq!(integral(&n("3.5")), None);
        assert_eq!(integral(&n("9223372036854775808")), None);
        assert_eq!(integral(&n("1e300")), None);
    }
}
