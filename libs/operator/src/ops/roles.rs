//! Each process role's health, from its ops port's `/readyz`: up and
//! ready, up and not ready (with why), or down.

use futures_util::future::join_all;
use serde::Serialize;
use service_kit::service::{Role, ops_offset};
use std::time::Duration;

/// How long a role has to answer: a frozen process is down here.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// One process role to ask.
#[derive(Debug, Clone)]
pub struct RoleProbe {
    pub service: String,
    pub role: &'static str,
    pub port: u16,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoleLine {
    pub service: String,
    pub role: &'static str,
    pub port: u16,
    pub ready: bool,
    /// `ready`, or what `/readyz` said, or why it did not answer.
    pub state: String,
}

/// The roles of every service of the roster, at the ports `make up` gives
/// them (`<SERVICE>_PORT`, or the roster's, plus each role's offset): the
/// API's, the relay's where the service publishes, the consumers'.
pub fn roster_probes(services: &[String]) -> Vec<RoleProbe> {
    let mut probes = Vec::new();
    for s in contracts::roster::services() {
        if !services.iter().any(|n| n == s.name) {
            continue;
        }
        let var = format!("{}_PORT", s.name.to_uppercase().replace('-', "_"));
        let port = std::env::var(var)
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(s.port);
        let roles = [
            ("serve", Role::Serve, true),
            ("relay", Role::Relay, s.outbox),
            ("consume", Role::Consume, true),
        ];
        for (name, role, runs) in roles {
            if runs {
                probes.push(RoleProbe {
                    service: s.name.to_owned(),
                    role: name,
                    port: port.saturating_add(ops_offset(role)),
                });
            }
        }
    }
    probes
}

/// Asks every role at once, each within [`PROBE_TIMEOUT`].
pub async fn probe(host: &str, probes: &[RoleProbe]) -> Vec<RoleLine> {
    let http = reqwest::Client::builder()
        .timeout(PROBE_TIMEOUT)
        .build()
        .expect("an HTTP client with a timeout");
    join_all(probes.iter().map(|p| {
        let http = http.clone();
        async move {
            let url = format!("http://{host}:{}/readyz", p.port);
            let (ready, state) = match http.get(&url).send().await {
                Ok(r) if r.status().is_success() => (true, "ready".to_owned()),
                Ok(r) => {
                    let status = r.status();
                    let why = r.text().await.unwrap_or_default();
                    (
                        false,
                        format!(
                            "not ready ({status}): {}",
                            why.chars().take(300).collect::<String>()
                        ),
                    )
                }
                Err(e) => (false, format!("down: {e}")),
            };
            RoleLine {
                service: p.service.clone(),
                role: p.role,
                port: p.port,
                ready,
                state,
            }
        }
    }))
    .await
}
