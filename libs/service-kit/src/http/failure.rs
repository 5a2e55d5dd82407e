//! The failures every service's API shares, and the one place they map to
//! HTTP; a service adds only its own (its [`Domain`]).

use std::fmt;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sqlx::PgPool;

use super::ApiError;
use reliability::{TenantId, TenantTx};

/// A service's own side of [`Failure`]: the codes its API answers the
/// shared failures with, and its domain failures' HTTP answers.
pub trait Domain: fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// The `code` of a 422 for input that breaks a rule (`invalid_order`).
    const INVALID: &'static str = "invalid_request";
    /// The message of a 404 (`order not found`).
    const NOT_FOUND: &'static str;

    /// The answer to one of the service's own failures.
    fn api(&self) -> ApiError {
        ApiError::internal(&self)
    }
}

/// Everything a request or an event can fail with in a service: the shared
/// failures, and the service's own in [`Failure::Domain`]. A service names
/// it once, `pub type Error = Failure<MyDomain>;`.
#[derive(Debug)]
pub enum Failure<D: Domain> {
    /// 422: well-formed input that breaks a rule.
    Invalid(String),
    /// 404: no such resource for this tenant (another tenant's looks the
    /// same: RLS hides it).
    NotFound,
    /// One of the service's own failures.
    Domain(D),
    /// 503 while a dependency is down, else 500: logged once, shown to the
    /// client as a generic message.
    Internal(reliability::Error),
}

impl<D: Domain> Failure<D> {
    /// The answer, the one place each failure maps to HTTP.
    pub fn api(&self) -> ApiError {
        match self {
            Self::Invalid(message) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                D::INVALID,
                message.clone(),
            ),
            Self::NotFound => ApiError::new(StatusCode::NOT_FOUND, "not_found", D::NOT_FOUND),
            Self::Domain(d) => d.api(),
            Self::Internal(e) => ApiError::failure(e),
        }
    }
}

/// A read of one resource in the tenant's transaction (RLS on): `find`'s row
/// as JSON, or the service's 404 when there is none, which is also what
/// another tenant's row looks like.
pub async fn read_one<T, D: Domain>(
    pool: &PgPool,
    tenant: TenantId,
    find: impl AsyncFnOnce(&mut TenantTx) -> Result<Option<T>, Failure<D>>,
) -> Result<Json<T>, Failure<D>> {
    let mut tx = TenantTx::begin(pool, tenant).await?;
    let row = find(&mut tx).await?.ok_or(Failure::NotFound)?;
    tx.commit().await?;
    Ok(Json(row))
}

impl<D: Domain> fmt::Display for Failure<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(message) => f.write_str(message),
            Self::NotFound => f.write_str(D::NOT_FOUND),
            Self::Domain(d) => fmt::Display::fmt(d, f),
            Self::Internal(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl<D: Domain> std::error::Error for Failure<D> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Internal(e) => Some(e),
            _ => None,
        }
    }
}

impl<D: Domain> From<reliability::Error> for Failure<D> {
    fn from(e: reliability::Error) -> Self {
        Self::Internal(e)
    }
}

impl<D: Domain> From<sqlx::Error> for Failure<D> {
    fn from(e: sqlx::Error) -> Self {
        Self::Internal(e.into())
    }
}

impl<D: Domain> From<serde_json::Error> for Failure<D> {
    fn from(e: serde_json::Error) -> Self {
        Self::Internal(e.into())
    }
}

impl<D: Domain> From<Failure<D>> for ApiError {
    fn from(e: Failure<D>) -> Self {
        e.api()
    }
}

impl<D: Domain> IntoResponse for Failure<D> {
    fn into_response(self) -> Response {
        self.api().into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    enum Shop {
        SoldOut,
    }

    impl fmt::Display for Shop {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("sold out")
        }
    }

    impl Domain for Shop {
        const INVALID: &'static str = "invalid_basket";
        const NOT_FOUND: &'static str = "basket not found";

        fn api(&self) -> ApiError {
            ApiError::new(StatusCode::CONFLICT, "sold_out", self.to_string())
        }
    }

    #[test]
    fn each_failure_answers_with_the_services_codes() {
        let answers: Vec<(StatusCode, &str, String)> = [
            Failure::Invalid("no lines".into()),
            Failure::NotFound,
            Failure::Domain(Shop::SoldOut),
            Failure::Internal(reliability::Error::Config("boom".into())),
        ]
        .iter()
        .map(|f| {
            let a = f.api();
            (a.status, a.code, a.message)
        })
        .collect();
        assert_eq!(
            answers,
            [
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "invalid_basket",
                    "no lines".into()
                ),
                (
                    StatusCode::NOT_FOUND,
                    "not_found",
                    "basket not found".into()
                ),
                (StatusCode::CONFLICT, "sold_out", "sold out".into()),
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "internal error".into()
                ),
            ]
        );
    }
}
