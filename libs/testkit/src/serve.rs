//! A service of this repository, started in the test's own process.

use clap::Args;

use super::ApiClient;
use service_kit::service::{self, Databases, Service, Settings, ShutdownToken};

/// A service running in the test's process: its API client, its ops URL
/// (`/metrics`, `/readyz`), and the token that stops it.
pub struct Served {
    pub api: ApiClient,
    pub ops: String,
    pub stop: ShutdownToken,
}

/// Starts `service` on `dbs` with `settings`, running until
/// [`Served::stop`] is cancelled; its client signs tokens with the
/// settings' keys.
pub async fn serve<X: Args + Clone + Send + Sync>(
    service: &'static Service<X>,
    settings: Settings<X>,
    dbs: Databases,
) -> Served {
    let jwt = settings.common.jwt_keys();
    let stop = ShutdownToken::new();
    let app = service::start(service, settings, dbs, stop.clone())
        .await
        .expect("start the service");
    let api = ApiClient::new(app.port(), jwt);
    let ops = format!("http://127.0.0.1:{}", app.ops_port());
    tokio::spawn(app.run_until_stopped());
    Served { api, ops, stop }
}
