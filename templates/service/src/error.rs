use service_kit::http::{Domain, Failure};

/// Everything a request can fail with in this service: the shared failures
/// (`Invalid` a 422 `invalid_item`, `NotFound`, `Internal`: a logged 500 or,
/// while a dependency is down, a 503), answered with this service's codes.
pub type Error = Failure<Items>;

/// This service's own failures (none yet) and their HTTP answers: add a
/// variant here, and its arm in `api`, for a rule of your domain.
#[derive(Debug, thiserror::Error)]
pub enum Items {}

impl Domain for Items {
    const INVALID: &'static str = "invalid_item";
    const NOT_FOUND: &'static str = "item not found";
}
