//! What a derived view's verification shares: its settings, what it
//! finds, and how an operator's one pass prints it (`projection verify`,
//! `graph verify`; docs/adr/0035).

use std::time::Duration;

use reliability::shutdown::ShutdownToken;
use serde::Serialize;

use crate::Sources;

/// Seconds between two scheduled passes.
const DEFAULT_INTERVAL_SECS: u64 = 600;
/// How long an order's rows must have been still before a view is held to them.
const DEFAULT_GRACE_SECS: u64 = 60;
/// How many orders a pass reads at a time.
pub const CHUNK: i64 = 500;

/// The scheduled pass of a view's consume role.
#[derive(Debug, Clone, clap::Args)]
pub struct VerifySettings {
    /// The sources the consume role verifies its view against, on a
    /// schedule: `orders=URL,inventory=URL,payments=URL`, each opened as
    /// the owner role (empty: no scheduled verification; `<service>
    /// verify` runs one pass).
    #[arg(long, env = "VERIFY_SOURCES", value_delimiter = ',')]
    pub verify_sources: Vec<String>,
    /// Seconds between two scheduled verification passes; each repairs what differs.
    #[arg(long, env = "VERIFY_INTERVAL_SECS", default_value_t = DEFAULT_INTERVAL_SECS)]
    pub verify_interval_secs: u64,
    /// How long an order's source rows must have been still before its
    /// view is held to them: the consumer's lag that is not yet drift.
    #[arg(long, env = "VERIFY_GRACE_SECS", default_value_t = DEFAULT_GRACE_SECS)]
    pub verify_grace_secs: u64,
}

impl VerifySettings {
    /// The sources and the interval, when a schedule is set.
    pub fn scheduled(&self) -> reliability::Result<Option<(Sources, Duration)>> {
        if self.verify_sources.is_empty() || self.verify_interval_secs == 0 {
            return Ok(None);
        }
        Ok(Some((
            Sources::lazy(&self.verify_sources)?,
            Duration::from_secs(self.verify_interval_secs),
        )))
    }

    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.verify_grace_secs)
    }
}

/// One entity whose view differs from its sources.
#[derive(Debug, Clone, Serialize)]
pub struct Difference {
    /// Which part of the view: `orders`, `history`, `customers`, `products`.
    pub view: &'static str,
    pub tenant_id: i64,
    /// The order id, `<aggregate_type>:<aggregate_id>`, a customer or a sku.
    pub entity: String,
    pub detail: String,
    pub repaired: bool,
}

/// Prints a pass's differences, a line each (JSON with `json`), then
/// `summary` (its counts, as a JSON object) with `differences` and
/// `remaining` added. Whether no difference remains.
pub fn print(differences: &[Difference], summary: serde_json::Value, json: bool) -> bool {
    for d in differences {
        if json {
            println!("{}", serde_json::to_string(d).unwrap_or_default());
        } else {
            let done = if d.repaired { "repaired" } else { "DIFFERS" };
            println!(
                "{:<9} tenant {:<6} {:<28} {done}: {}",
                d.view, d.tenant_id, d.entity, d.detail
            );
        }
    }
    let remaining = differences.iter().filter(|d| !d.repaired).count();
    let mut summary = summary;
    if let Some(map) = summary.as_object_mut() {
        map.insert("differences".into(), differences.len().into());
        map.insert("remaining".into(), remaining.into());
    }
    if json {
        println!("{summary}");
    } else {
        let fields: Vec<String> = summary
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{}: {v}", k.replace('_', " ")))
            .collect();
        println!("{}", fields.join(", "));
    }
    remaining == 0
}

/// The metrics a view's scheduled pass keeps (`<view>_verify_…`).
pub struct Schedule {
    /// Which derived view, for the logs: `projection`, `graph`.
    pub view: &'static str,
    /// Its parts, as `Difference::view` names them.
    pub parts: &'static [&'static str],
    pub metrics: &'static [reliability::metrics::Metric],
    pub differences: &'static str,
    pub repairs: &'static str,
    pub last_success: &'static str,
}

impl Schedule {
    /// `pass` every `every` until `stop`, each one's outcome in the
    /// metrics: a failed pass is logged, and the next comes on schedule.
    pub async fn run<F, Fut>(&self, every: Duration, stop: ShutdownToken, mut pass: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = reliability::Result<Vec<Difference>>>,
    {
        reliability::metrics::describe(self.metrics);
        loop {
            match pass().await {
                Ok(differences) => {
                    for &part in self.parts {
                        let of = differences.iter().filter(|d| d.view == part);
                        let found = of.clone().count();
                        let repaired = of.filter(|d| d.repaired).count();
                        metrics::gauge!(self.differences, "view" => part).set(found as f64);
                        metrics::counter!(self.repairs, "view" => part).increment(repaired as u64);
                        if found > 0 {
                            tracing::warn!(
                                view = self.view,
                                part,
                                found,
                                repaired,
                                "verify: a view differs from its sources"
                            );
                        }
                    }
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default();
                    metrics::gauge!(self.last_success).set(now.as_secs_f64());
                }
                Err(e) => tracing::warn!(
                    view = self.view,
                    error = %e,
                    "verify: the pass failed; the next one on schedule"
                ),
            }
            if tokio::time::timeout(every, stop.cancelled()).await.is_ok() {
                return;
            }
        }
    }
}
