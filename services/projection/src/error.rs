use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
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

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Internal(e.into())
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        match self {
            Self::NotFound => {
                ApiError::new(StatusCode::NOT_FOUND, "not_found", "order not found").into_response()
            }
            Self::Internal(e) => ApiError::failure(&e).into_response(),
        }
    }
}
