use axum::http::StatusCode;
use service_kit::http::{ApiError, Domain, Failure};

/// Everything a request or an event can fail with in inventory: the shared
/// failures (`Invalid` a 422 `invalid_adjustment`, `NotFound`, `Internal`)
/// and inventory's own.
pub type Error = Failure<Inventory>;

/// Inventory's own failures, and their HTTP answers.
#[derive(Debug, thiserror::Error)]
pub enum Inventory {
    /// 422: the adjustment would leave less stock than is reserved.
    #[error("the adjustment would take on_hand below what is reserved")]
    BelowReserved,
}

impl Domain for Inventory {
    const INVALID: &'static str = "invalid_adjustment";
    const NOT_FOUND: &'static str = "product not found";

    fn api(&self) -> ApiError {
        match self {
            Self::BelowReserved => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "insufficient_stock",
                self.to_string(),
            ),
        }
    }
}
