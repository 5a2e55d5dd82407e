use axum::http::StatusCode;
use service_kit::http::{ApiError, Domain, Failure};

/// Everything a request or an event can fail with in payments: the shared
/// failures (`Invalid` a 422 `invalid_request`, `NotFound`, `Internal`) and
/// payments' own.
pub type Error = Failure<Payments>;

/// Payments' own failures, and their HTTP answers.
#[derive(Debug, thiserror::Error)]
pub enum Payments {
    /// 422: more than was captured and not yet refunded.
    #[error("the refund exceeds what was captured and not yet refunded")]
    RefundTooLarge,
}

impl Domain for Payments {
    const NOT_FOUND: &'static str = "payment not found";

    fn api(&self) -> ApiError {
        match self {
            Self::RefundTooLarge => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "refund_exceeds_captured",
                self.to_string(),
            ),
        }
    }
}
