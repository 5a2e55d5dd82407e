use axum::http::StatusCode;
use reliability::http::ApiError;

/// Everything a request can fail with in this service, and the one place
/// each maps to HTTP.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// 422: well-formed input that breaks a rule.
    #[error("{0}")]
    Invalid(String),
    /// 404: no such item for this tenant.
    #[error("item not found")]
    NotFound,
    /// 500: logged once, shown as a generic message.
    #[error(transparent)]
    Internal(#[from] reliability::Error),
}

impl Error {
    pub fn api(&self) -> ApiError {
        match self {
            Self::Invalid(msg) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_item",
                msg.clone(),
            ),
            Self::NotFound => ApiError::new(StatusCode::NOT_FOUND, "not_found", "item not found"),
            Self::Internal(e) => ApiError::failure(e),
        }
    }
}

reliability::service_error!(Error);
