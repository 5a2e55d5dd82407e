//! Where a command acts: a service's database, found the way the service
//! finds it, and the broker.

use std::io::IsTerminal as _;
use std::str::FromStr;

use anyhow::Context;
use clap::Args;
use reliability::db;
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A service's database URL as the service reads it: `<SERVICE>_DATABASE_URL`,
/// else the local default; as the owner role.
pub fn service_options(service: &str) -> anyhow::Result<PgConnectOptions> {
    let var = format!("{}_DATABASE_URL", service.to_uppercase().replace('-', "_"));
    let url =
        std::env::var(&var).unwrap_or_else(|_| format!("postgres://127.0.0.1:5432/{service}"));
    let base = PgConnectOptions::from_str(&url).with_context(|| format!("parse {var}"))?;
    Ok(db::options_for_role(&base, db::OWNER_ROLE))
}

#[derive(Args, Debug, Clone)]
pub struct Db {
    /// The service whose database to open (one of services/roster.txt).
    /// Its URL is the one the service reads,
    /// <SERVICE>_DATABASE_URL (default postgres://127.0.0.1:5432/<service>),
    /// opened as the owner role.
    #[arg(long, short, global = true)]
    pub service: Option<String>,
    /// The owner role's full URL instead of --service.
    #[arg(
        long,
        env = "OWNER_DATABASE_URL",
        global = true,
        hide_env_values = true
    )]
    pub database_url: Option<String>,
}

impl Db {
    pub async fn pool(&self) -> anyhow::Result<PgPool> {
        let options = match (&self.database_url, &self.service) {
            (Some(url), _) => PgConnectOptions::from_str(url).context("parse --database-url")?,
            (None, Some(service)) => service_options(service)?,
            (None, None) => anyhow::bail!(
                "which database? --service {} (or --database-url / OWNER_DATABASE_URL)",
                contracts::roster::names().join("|")
            ),
        };
        db::pool(options, 1)
            .await
            .context("connect to the database")
    }
}

#[derive(Args, Debug, Clone)]
pub struct Broker {
    /// The broker.
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL, global = true, hide_env_values = true)]
    pub amqp_url: String,
}

impl Broker {
    pub async fn connect(&self) -> anyhow::Result<lapin::Connection> {
        reliability::broker::connect(&self.amqp_url, "reliability-cli")
            .await
            .context("connect to the broker")
    }
}

/// `--dry-run` and `--yes` of every command that changes or deletes.
#[derive(Args, Debug, Clone, Copy)]
pub struct Confirm {
    /// Say what would change, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Go ahead without asking (needed when no terminal can ask).
    #[arg(long, short)]
    pub yes: bool,
}

impl Confirm {
    /// Prints what `action` touches; true if it should go ahead.
    pub fn proceed(self, action: &str) -> anyhow::Result<bool> {
        eprintln!("{action}");
        if self.dry_run {
            eprintln!("dry run: nothing changed");
            return Ok(false);
        }
        if self.yes {
            return Ok(true);
        }
        anyhow::ensure!(
            std::io::stdin().is_terminal(),
            "not changed: pass --yes to go ahead (there is no terminal to ask), or --dry-run to only look"
        );
        eprint!("go ahead? [y/N] ");
        let mut answer = String::new();
        std::io::stdin().read_line(&mut answer)?;
        Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
    }
}

/// What a changing command did (or, dry, would do).
#[derive(serde::Serialize)]
pub struct Done {
    pub action: String,
    pub matched: u64,
    pub changed: u64,
    pub dry_run: bool,
}
