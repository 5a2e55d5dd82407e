//! The Prometheus recorder and `/metrics`.
//!
//! Metrics this crate records (labels in braces):
//! - relay: `outbox_lag_seconds{source}`, `outbox_throughput{source}`,
//!   `outbox_failures{source,event_type}`, `outbox_dlq_depth{source}`, `outbox_max_attempts{source}`;
//! - consumers: `consumer_messages_total{consumer,outcome}`,
//!   `consumer_dead_lettered_total{consumer,reason}`, `consumer_retries_total{consumer}`,
//!   `consumer_dlq_depth{consumer}`;
//! - idempotency: `idempotency_cache_hits_total{scope}`,
//!   `idempotency_cache_misses_total{scope}`, `idempotency_check_duration{scope}` (seconds).

use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once (later calls, e.g. from several
/// in-process test apps, get the same handle) and keeps it tidy.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(&[
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0,
                ])
                .expect("bucket list is not empty")
                .install_recorder()
                .expect("no other metrics recorder is installed in this process");
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                })
                .expect("spawning a thread");
            handle
        })
        .clone()
}

/// `GET /metrics` in Prometheus text format. Needs no token.
pub fn router<S: Clone + Send + Sync + 'static>(handle: PrometheusHandle) -> Router<S> {
    Router::new().route("/metrics", get(move || std::future::ready(handle.render())))
}
