//! The metrics the kit records (HTTP requests, Idempotency-Keys, rate
//! limits, admission), catalogued like the pipeline's
//! ([`reliability::metrics::CATALOGUE`]): the service's runtime gives each its
//! HELP text, and the docs and the dashboard are checked against both lists.

use Kind::{Counter, Gauge, Histogram};
use reliability::metrics::{Kind, Metric};

pub const IDEMPOTENCY_HITS: &str = "idempotency_cache_hits_total";
pub const IDEMPOTENCY_MISSES: &str = "idempotency_cache_misses_total";
pub const IDEMPOTENCY_CONFLICTS: &str = "idempotency_conflicts_total";
pub const IDEMPOTENCY_IN_FLIGHT: &str = "idempotency_in_flight_total";
pub const IDEMPOTENCY_CHECK_DURATION: &str = "idempotency_check_duration_seconds";
pub const HTTP_REQUESTS: &str = "http_requests_total";
pub const HTTP_REQUEST_DURATION: &str = "http_request_duration_seconds";
pub const HTTP_RATE_LIMITED: &str = "http_rate_limited_total";
pub const HTTP_UNAVAILABLE: &str = "http_unavailable_total";

#[rustfmt::skip]
pub const CATALOGUE: &[Metric] = &[
    Metric::new(IDEMPOTENCY_HITS, Counter, &["scope"], "Requests answered from a stored Idempotency-Key response."),
    Metric::new(IDEMPOTENCY_MISSES, Counter, &["scope"], "Requests that claimed a fresh Idempotency-Key."),
    Metric::new(IDEMPOTENCY_CONFLICTS, Counter, &["scope"], "Keys reused with a different request (422)."),
    Metric::new(IDEMPOTENCY_IN_FLIGHT, Counter, &["scope"], "Requests refused because the same key was still being processed (409)."),
    Metric::new(IDEMPOTENCY_CHECK_DURATION, Histogram, &["scope"], "Time to claim or replay an Idempotency-Key."),
    Metric::new(HTTP_REQUESTS, Counter, &["method", "route", "status"], "HTTP requests, by matched route."),
    Metric::new(HTTP_REQUEST_DURATION, Histogram, &["method", "route"], "HTTP request latency."),
    Metric::new(HTTP_RATE_LIMITED, Counter, &["scope"], "Requests refused by the per-tenant rate limit (429)."),
    Metric::new(HTTP_UNAVAILABLE, Counter, &[], "Requests answered 503 because a dependency was unavailable."),
    Metric::new(crate::admission::ADMITTED, Counter, &[], "Requests a gated route admitted: the tenant was under its bound of work in flight."),
    Metric::new(crate::admission::REFUSED, Counter, &[], "Requests a gated route refused (429 backlog_full): the tenant was at its bound of work in flight."),
    Metric::new(crate::admission::UNKNOWN, Counter, &[], "Requests admitted because the tenant's work in flight could not be counted."),
    Metric::new(crate::admission::STUCK, Gauge, &[], "Work undecided past ADMISSION_STUCK_AFTER_SECS, of the tenants this process counted in the last minute: it no longer counts against their bound."),
];
