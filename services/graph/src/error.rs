use axum::http::StatusCode;
use service_kit::http::{ApiError, Domain, Failure};

use crate::store::StoreError;

/// Everything the graph's API can fail with: the shared failures (a 404
/// for a node the tenant does not have, another tenant's included) and
/// the graph store's.
pub type Error = Failure<Graph>;

#[derive(Debug, thiserror::Error)]
pub enum Graph {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A row of the store that does not read as its answer: our bug, a
    /// 500, never the 503 of a store that is down (a client would retry
    /// it as an outage).
    #[error("graph row: {0}")]
    Row(String),
}

impl Domain for Graph {
    const NOT_FOUND: &'static str = "not found";

    fn api(&self) -> ApiError {
        match self {
            // The same answer as a database outage (api.md): retry later.
            Self::Store(StoreError::Unavailable(e)) => {
                tracing::warn!(error = %e, "graph store unavailable; answering 503");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "a dependency is unavailable; retry later",
                )
                .with_retry_after(2)
            }
            other => ApiError::internal(other),
        }
    }
}

impl From<StoreError> for Failure<Graph> {
    fn from(e: StoreError) -> Self {
        Failure::Domain(Graph::Store(e))
    }
}
