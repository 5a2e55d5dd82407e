//! `projection verify`: one verification pass for an operator
//! (docs/runbooks.md, "A view differs from its sources").

use std::str::FromStr;
use std::time::Duration;

use clap::Parser;
use reliability::db;
use sqlx::postgres::PgConnectOptions;

use crate::verify::{Sources, Verifier};
use crate::{DEFAULT_VERIFY_GRACE_SECS, VERIFY_CHUNK};

/// Compare each order view and each ordered history with the sources, and
/// re-derive what differs (with --repair). Exits 1 while a difference remains.
#[derive(Debug, Parser)]
#[command(name = "projection verify")]
struct Verify {
    /// Re-derive each difference from the sources, beside the live consumers.
    #[arg(long)]
    repair: bool,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// `orders=URL,inventory=URL,payments=URL`, each opened as the owner role.
    #[arg(long, env = "VERIFY_SOURCES", value_delimiter = ',', required = true)]
    sources: Vec<String>,
    /// How long an order's source rows must have been still before its
    /// view is held to them.
    #[arg(long, env = "VERIFY_GRACE_SECS", default_value_t = DEFAULT_VERIFY_GRACE_SECS)]
    grace_secs: u64,
    /// The projection database, opened as the owner role.
    #[arg(
        long,
        env = "PROJECTION_DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/projection"
    )]
    database_url: String,
}

/// Runs `projection verify ARGS…` (the first argument is the command).
/// Whether no difference remains.
pub async fn verify(args: impl IntoIterator<Item = String>) -> reliability::Result<bool> {
    let cmd = Verify::parse_from(args);
    let base = PgConnectOptions::from_str(&cmd.database_url)?;
    let owner = db::pool(db::options_for_role(&base, db::OWNER_ROLE), 2).await?;
    let verifier = Verifier::new(
        owner,
        Sources::lazy(&cmd.sources)?,
        Duration::from_secs(cmd.grace_secs),
        VERIFY_CHUNK,
    );
    let report = verifier.run_once(cmd.repair).await?;
    for d in &report.differences {
        if cmd.json {
            println!("{}", serde_json::to_string(d).unwrap_or_default());
        } else {
            let done = if d.repaired { "repaired" } else { "DIFFERS" };
            println!(
                "{:<8} tenant {:<6} {:<28} {done}: {}",
                d.view, d.tenant_id, d.entity, d.detail
            );
        }
    }
    let remaining = report.differences.iter().filter(|d| !d.repaired).count();
    if cmd.json {
        println!(
            "{}",
            serde_json::json!({
                "orders_checked": report.orders_checked,
                "orders_settling": report.orders_settling,
                "histories_checked": report.histories_checked,
                "differences": report.differences.len(),
                "remaining": remaining,
            })
        );
    } else {
        println!(
            "{} orders ({} still settling, within {} s) and {} histories checked; {} differences, {} remaining",
            report.orders_checked,
            report.orders_settling,
            cmd.grace_secs,
            report.histories_checked,
            report.differences.len(),
            remaining
        );
    }
    Ok(remaining == 0)
}
