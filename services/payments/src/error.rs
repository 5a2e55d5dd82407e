use axum::http::StatusCode;
use reliability::http::ApiError;

/// Everything a request or an event can fail with in payments, and the one
/// place each maps to HTTP.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// 422: well-formed input that breaks a rule.
    #[error("{0}")]
    Invalid(String),
    /// 422: more than was captured and not yet refunded.
    #[error("the refund exceeds what was captured and not yet refunded")]
    RefundTooLarge,
    /// 404: no such payment for this tenant.
    #[error("payment not found")]
    NotFound,
    /// 503 while a dependency is down, else 500.
    #[error(transparent)]
    Internal(#[from] reliability::Error),
}

impl Error {
    pub fn api(&self) -> ApiError {
        match self {
            Self::Invalid(msg) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
                msg.clone(),
            ),
            Self::RefundTooLarge => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "refund_exceeds_captured",
                self.to_string(),
            ),
            Self::NotFound => {
                ApiError::new(StatusCode::NOT_FOUND, "not_found", "payment not found")
            }
            Self::Internal(e) => ApiError::failure(e),
        }
    }
}

reliability::service_error!(Error);
