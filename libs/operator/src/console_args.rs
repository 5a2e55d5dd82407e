//! `reliability console`'s settings, and its start.

use std::net::{IpAddr, SocketAddr};

use anyhow::Context;
use operator::console::{self, Auth, Console};
use operator::ops;
use service_kit::admission::AdmissionLimits;

#[derive(clap::Args)]
pub struct Settings {
    /// The operator token every page asks for (a browser trades it for a
    /// session at /login; a script sends it as a bearer token). Required
    /// off loopback.
    #[arg(long, env = "CONSOLE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// No action buttons, and every POST refused.
    #[arg(long, env = "CONSOLE_READ_ONLY", value_parser = clap::builder::FalseyValueParser::new())]
    read_only: bool,
    /// The address it binds: loopback, so that only this host's operator
    /// reads tenants' data.
    #[arg(long, env = "OPS_BIND_ADDRESS", default_value = "127.0.0.1")]
    bind_address: IpAddr,
    #[arg(long, env = "CONSOLE_PORT", default_value_t = console::DEFAULT_PORT)]
    port: u16,
    /// The payment provider, asked for its record of an order's payments.
    #[arg(long, env = "PSP_URL", default_value = "http://127.0.0.1:8090")]
    psp_url: String,
}

impl Settings {
    pub async fn serve(self, estate: ops::Estate, limits: AdmissionLimits) -> anyhow::Result<()> {
        let addr = SocketAddr::new(self.bind_address, self.port);
        let auth = match self.token.as_deref().filter(|t| !t.is_empty()) {
            Some(token) => Auth::token(token),
            None => Auth::none(),
        };
        console::check_bind(&addr, &auth).map_err(anyhow::Error::msg)?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind {addr}"))?;
        eprintln!(
            "console on http://{addr}/{}{}",
            if auth.required() {
                " (token required)"
            } else {
                ""
            },
            if self.read_only { ", read-only" } else { "" }
        );
        let services: Vec<String> = estate.databases.iter().map(|(s, _)| s.clone()).collect();
        let console = Console {
            roles: ops::roles::roster_probes(&services),
            estate,
            auth,
            read_only: self.read_only,
            psp_url: self.psp_url,
            limits,
            samples: Default::default(),
        };
        console::serve(listener, console).await?;
        Ok(())
    }
}
