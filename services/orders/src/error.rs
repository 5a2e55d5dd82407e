use axum::http::StatusCode;
use reliability::http::ApiError;

/// Everything a request or an event can fail with in this service, and
/// (in `api`) the one place each maps to HTTP.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// 422: well-formed input that breaks a rule.
    #[error("{0}")]
    Invalid(String),
    /// 404: no such order for this tenant (another tenant's id looks the same).
    #[error("order not found")]
    NotFound,
    /// 503 while a dependency is down, else 500: logged once here, shown to
    /// the client as a generic message.
    #[error(transparent)]
    Internal(#[from] reliability::Error),
}

impl Error {
    pub fn api(&self) -> ApiError {
        match self {
            Self::Invalid(msg) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_order",
                msg.clone(),
            ),
            Self::NotFound => ApiError::new(StatusCode::NOT_FOUND, "not_found", "order not found"),
            Self::Internal(e) => ApiError::failure(e),
        }
    }
}

reliability::service_error!(Error);
