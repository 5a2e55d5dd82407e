//! `graph verify`: one verification pass for an operator
//! (docs/runbooks.md, "A view differs from its sources").

use std::sync::Arc;

use clap::Parser;

use crate::GraphSettings;
use crate::verify::Verifier;

/// Compare each order's node and edges, each customer's order count and
/// each product's units ordered with the sources, and re-derive what
/// differs (with --repair). Exits 1 while a difference remains.
#[derive(Debug, Parser)]
#[command(name = "graph verify")]
struct Verify {
    /// Re-derive each difference from the sources, beside the live consumer.
    #[arg(long)]
    repair: bool,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Only this tenant's orders, customers and products.
    #[arg(long)]
    tenant: Option<i64>,
    #[command(flatten)]
    graph: GraphSettings,
}

/// Runs `graph verify ARGS…` (the first argument is the command).
/// Whether no difference remains.
pub async fn verify(args: impl IntoIterator<Item = String>) -> reliability::Result<bool> {
    let cmd = Verify::parse_from(args);
    let schedule = &cmd.graph.verify;
    if schedule.verify_sources.is_empty() {
        return Err(reliability::Error::Config(
            "graph verify needs VERIFY_SOURCES (or --verify-sources): orders=URL,inventory=URL,payments=URL".into(),
        ));
    }
    let verifier = Verifier::new(
        Arc::new(cmd.graph.store()),
        sources::Sources::lazy(&schedule.verify_sources)?,
        schedule.grace(),
        sources::verify::CHUNK,
    );
    let report = match cmd.tenant {
        Some(tenant) => verifier.run_tenant(tenant, cmd.repair).await?,
        None => verifier.run_once(cmd.repair).await?,
    };
    let summary = serde_json::json!({
        "orders_checked": report.orders_checked,
        "orders_settling": report.orders_settling,
        "grace_secs": schedule.verify_grace_secs,
        "tenants_checked": report.tenants_checked,
    });
    Ok(sources::verify::print(
        &report.differences,
        summary,
        cmd.json,
    ))
}
