//! `reliability console`: the operator's web page over what `status` and
//! `explain` read (the services' databases, the broker and its management
//! API), with the buttons that act on it.
//!
//! Server-rendered HTML (askama templates under `templates/`), no script:
//! every page reads and every action works without JavaScript. Tenants'
//! data is for the operator only, so it binds to loopback by default and
//! refuses any other address without a token ([`check_bind`]). Every action
//! is a POST behind the token and a CSRF token ([`auth`]), and answers
//! plainly when there is nothing left to do, so a double click or a second
//! operator does nothing twice. Read-only mode draws no buttons and
//! refuses every POST.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::middleware;
use axum::routing::{get, post};
use service_kit::admission::AdmissionLimits;

use crate::ops;

pub mod auth;
mod letters;
mod overview;
mod pages;
mod parked;
pub mod sampler;
mod story;
mod stuck;

pub use auth::Auth;

/// The port it listens on unless told (`CONSOLE_PORT`): beside the
/// services' 8081-8085 and the provider's 8090.
pub const DEFAULT_PORT: u16 = 8089;

/// What the console reads and how it may act.
pub struct Console {
    pub estate: ops::Estate,
    pub auth: Auth,
    /// No action buttons, and every POST refused.
    pub read_only: bool,
    /// The payment provider, asked for its record of an order's payments.
    pub psp_url: String,
    /// The services' admission settings, as `status` reads them.
    pub limits: AdmissionLimits,
    /// The process roles whose `/readyz` the overview asks, on
    /// 127.0.0.1 (`ops::roles::roster_probes`: `make up`'s).
    pub roles: Vec<ops::roles::RoleProbe>,
    /// What the roles' `/metrics` said over the last hour ([`serve`]
    /// keeps it).
    pub samples: Arc<sampler::Samples>,
}

/// The console's routes: every one behind [`auth::require`] but the login.
pub fn router(console: Console) -> Router {
    let console = Arc::new(console);
    Router::new()
        .route("/", get(overview::overview))
        .route("/orders", get(story::order))
        .route("/outbox/{service}/redrive", post(overview::redrive_outbox))
        .route("/dead-letters", get(letters::list))
        .route("/dead-letters/redrive", post(letters::redrive))
        .route(
            "/dead-letters/drop",
            get(letters::ask_drop).post(letters::drop),
        )
        .route("/parked", get(parked::list))
        .route("/stuck", get(stuck::list))
        .route("/parked/unpark", post(parked::unpark))
        .route("/parked/skip", get(parked::ask_skip).post(parked::skip))
        .route_layer(middleware::from_fn_with_state(
            console.clone(),
            auth::require,
        ))
        .route("/login", get(auth::login_form).post(auth::login))
        .with_state(console)
}

/// Refuses to serve tenants' data off loopback to whoever asks.
pub fn check_bind(addr: &SocketAddr, auth: &Auth) -> Result<(), String> {
    if addr.ip().is_loopback() || auth.required() {
        Ok(())
    } else {
        Err(format!(
            "the console would show every tenant's orders on {addr} to anyone: \
             set CONSOLE_TOKEN (or CONSOLE_TOKEN_FILE), or bind to 127.0.0.1"
        ))
    }
}

/// Serves until the process is stopped, reading the roles' metrics
/// meanwhile.
pub async fn serve(listener: tokio::net::TcpListener, console: Console) -> std::io::Result<()> {
    let sampler = console
        .samples
        .clone()
        .run("127.0.0.1".into(), console.roles.clone());
    let sampling = tokio::spawn(sampler);
    let served = axum::serve(listener, router(console)).await;
    sampling.abort();
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_loopback_it_starts_only_with_a_token() {
        let lan: SocketAddr = "0.0.0.0:8089".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8089".parse().unwrap();
        assert!(check_bind(&lan, &Auth::none()).is_err());
        assert!(check_bind(&lan, &Auth::token("t")).is_ok());
        assert!(check_bind(&local, &Auth::none()).is_ok());
    }
}
