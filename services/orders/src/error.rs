use service_kit::http::{Domain, Failure};

/// Everything a request or an event can fail with in orders: the shared
/// failures, answered with orders' codes (a 422 is `invalid_order`).
pub type Error = Failure<Orders>;

/// Orders has no failures of its own; it names its codes.
#[derive(Debug, thiserror::Error)]
pub enum Orders {}

impl Domain for Orders {
    const INVALID: &'static str = "invalid_order";
    const NOT_FOUND: &'static str = "order not found";
}
