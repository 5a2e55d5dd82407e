use axum::http::StatusCode;
use reliability::http::ApiError;

/// Everything a request or an event can fail with in inventory, and the one
/// place each maps to HTTP.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// 422: well-formed input that breaks a rule.
    #[error("{0}")]
    Invalid(String),
    /// 422: the adjustment would leave less stock than is reserved.
    #[error("the adjustment would take on_hand below what is reserved")]
    BelowReserved,
    /// 404: no such product for this tenant.
    #[error("product not found")]
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
                "invalid_adjustment",
                msg.clone(),
            ),
            Self::BelowReserved => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "insufficient_stock",
                self.to_string(),
            ),
            Self::NotFound => {
                ApiError::new(StatusCode::NOT_FOUND, "not_found", "product not found")
            }
            Self::Internal(e) => ApiError::failure(e),
        }
    }
}

reliability::service_error!(Error);
