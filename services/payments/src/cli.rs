//! `payments reconcile`: one reconciliation pass for an operator, against
//! the database and provider the service uses (docs/runbooks.md).

use std::str::FromStr;
use std::time::Duration;

use clap::Parser;
use reliability::db;
use sqlx::postgres::PgConnectOptions;

use crate::provider::Psp;
use crate::reconcile::Reconciler;

/// Compare the provider's lists of charges and refunds with ours, and
/// repair what a rule says how to (unless --dry-run).
#[derive(Debug, Parser)]
#[command(name = "payments reconcile")]
struct Reconcile {
    /// Only report: write nothing.
    #[arg(long)]
    dry_run: bool,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// How far back the provider's lists are read, in hours.
    #[arg(long, env = "PSP_RECONCILE_WINDOW_HOURS", default_value_t = 48)]
    window_hours: u64,
    /// The payment provider's base URL.
    #[arg(long, env = "PSP_URL", default_value = "http://127.0.0.1:8090")]
    psp_url: String,
    /// The payments database, opened as the owner role.
    #[arg(
        long,
        env = "PAYMENTS_DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/payments",
        hide_env_values = true
    )]
    database_url: String,
}

/// Runs `payments reconcile ARGS…` (the first argument is the command).
pub async fn reconcile(args: impl IntoIterator<Item = String>) -> reliability::Result<()> {
    let cmd = Reconcile::parse_from(args);
    let base = PgConnectOptions::from_str(&cmd.database_url)?;
    let owner = db::pool(db::options_for_role(&base, db::OWNER_ROLE), 2).await?;
    let psp = Psp::new(&cmd.psp_url, Duration::from_secs(10));
    let reconciler = Reconciler::new(owner, psp, Duration::from_secs(cmd.window_hours * 3600));
    let report = reconciler.run_once(!cmd.dry_run).await?;
    for m in &report.mismatches {
        if cmd.json {
            println!("{}", serde_json::to_string(m).unwrap_or_default());
        } else {
            let done = if m.repaired {
                "repaired"
            } else {
                "NEEDS A PERSON"
            };
            println!("{:<32} {:<28} {done}: {}", m.kind, m.key, m.detail);
        }
    }
    let summary = serde_json::json!({
        "charges_seen": report.charges_seen,
        "refunds_seen": report.refunds_seen,
        "mismatches": report.mismatches.len(),
        "repaired": report.mismatches.iter().filter(|m| m.repaired).count(),
        "dry_run": cmd.dry_run,
    });
    if cmd.json {
        println!("{summary}");
    } else {
        println!(
            "{} charges and {} refunds of the last {} h read; {} mismatches, {} repaired{}",
            report.charges_seen,
            report.refunds_seen,
            cmd.window_hours,
            report.mismatches.len(),
            summary["repaired"],
            if cmd.dry_run {
                " (dry run: nothing written)"
            } else {
                ""
            }
        );
    }
    Ok(())
}
