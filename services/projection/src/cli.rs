//! `projection verify`: one verification pass for an operator
//! (docs/runbooks.md, "A view differs from its sources").

use std::str::FromStr;

use clap::Parser;
use reliability::db;
use sqlx::postgres::PgConnectOptions;

use crate::verify::{Sources, Verifier};

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
    #[command(flatten)]
    schedule: sources::VerifySettings,
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
        Sources::lazy(&cmd.schedule.verify_sources)?,
        cmd.schedule.grace(),
        sources::verify::CHUNK,
    );
    let report = verifier.run_once(cmd.repair).await?;
    let summary = serde_json::json!({
        "orders_checked": report.orders_checked,
        "orders_settling": report.orders_settling,
        "grace_secs": cmd.schedule.verify_grace_secs,
        "histories_checked": report.histories_checked,
    });
    Ok(sources::verify::print(
        &report.differences,
        summary,
        cmd.json,
    ))
}
