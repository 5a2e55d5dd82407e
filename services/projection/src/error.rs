use service_kit::http::{Domain, Failure};

/// Everything the projection's API can fail with: the shared failures (a
/// 404 when no event of the order has arrived, or it is another tenant's).
pub type Error = Failure<Projection>;

#[derive(Debug, thiserror::Error)]
pub enum Projection {}

impl Domain for Projection {
    const NOT_FOUND: &'static str = "order not found";
}
