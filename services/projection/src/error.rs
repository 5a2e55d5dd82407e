use axum::http::StatusCode;
use reliability::http::ApiError;

/// Everything the projection's API can fail with, mapped to HTTP in one place.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// 404: no event of this order has arrived (or it is another tenant's).
    #[error("order not found")]
    NotFound,
    /// 503 while a dependency is down, else 500.
    #[error(transparent)]
    Internal(#[from] reliability::Error),
}

impl Error {
    pub fn api(&self) -> ApiError {
        match self {
            Self::NotFound => ApiError::new(StatusCode::NOT_FOUND, "not_found", "order not found"),
            Self::Internal(e) => ApiError::failure(e),
        }
    }
}

reliability::service_error!(Error);
