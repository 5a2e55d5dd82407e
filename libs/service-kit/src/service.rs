//! What every service binary shares, so a service is only its routes,
//! handlers, consumers and domain SQL:
//!
//! - [`CommonSettings`]: broker, exchange, JWT secret, role URLs (clap + env);
//! - [`Databases`]: one pool per role, from the service's database URL;
//! - [`http_app`]: the HTTP stack of the contract (64 KiB body limit, JSON
//!   errors for 404/413/500, request id, trace context, per-route metrics)
//!   plus `/healthz`, `/readyz`, `/metrics`;
//! - [`Tasks`]: the server, relay, consumers and maintenance of one process,
//!   stopped together on SIGTERM or when one of them fails;
//! - [`Role`]: run everything (the default) or one part, so a part can be
//!   killed and restarted alone.

mod declare;
mod env;
mod http;
mod openapi;
mod runtime;
mod settings;
mod state;

pub use declare::*;
pub use env::*;
pub use http::*;
pub use openapi::*;
pub use runtime::*;
pub use settings::*;
pub use state::ApiState;

pub use reliability::shutdown::ShutdownToken;

/// Largest request body any route accepts (the contract's 413 limit).
pub const BODY_LIMIT: usize = 64 * 1024;

/// Logs as JSON when `LOG_FORMAT=json`, else human-readable; `RUST_LOG`
/// filters them (default `info`, and `warn` for the replication protocol's
/// crate, which says `info` at every status update the log relay sends).
/// With the `otel` feature, the service's
/// own spans, events and SQL inside each step join its exported trace
/// ([`trace::layer`](reliability::trace::layer)), whatever `RUST_LOG` says.
pub fn init_tracing() {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,pg_walstream=warn".into());
    let logs = match std::env::var("LOG_FORMAT").is_ok_and(|f| f == "json") {
        true => tracing_subscriber::fmt::layer()
            .json()
            .with_filter(filter)
            .boxed(),
        false => tracing_subscriber::fmt::layer().with_filter(filter).boxed(),
    };
    tracing_subscriber::registry()
        .with(logs)
        .with(reliability::trace::layer())
        .init();
}
