//! The HTTP error shape of the contract: `{"error": {"code", "message"}}`.
//! Services map their own error enum onto [`ApiError`] in one place.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

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
    pub fn failure(cause: &crate::Error) -> Self {
        if cause.is_unavailable() {
            tracing::warn!(error = %cause, "dependency unavailable; answering 503");
            metrics::counter!("http_unavailable_total").increment(1);
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
