//! `reliability`: the operator's tool over any service database and queue.
//!
//! Roles and databases, migrations, outbox status and its DLQ table, the
//! broker-side dead letters of a consumer, maintenance jobs, dev tokens.

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use reliability::{TenantId, auth::JwtKeys, broker, db, maintenance, relay};
use sqlx::postgres::PgConnectOptions;

#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the roles, then each database with the reliability tables.
    Setup {
        /// A superuser connection (creates roles and databases).
        #[arg(
            long,
            env = "ADMIN_DATABASE_URL",
            default_value = "postgres://postgres@127.0.0.1:5432/postgres"
        )]
        admin_url: String,
        /// Databases to create and migrate, e.g. orders inventory.
        databases: Vec<String>,
    },
    /// Outbox health: pending rows, oldest pending age, most attempts, DLQ rows.
    OutboxStatus {
        /// The service database, as the owner role.
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
    },
    /// Outbox rows that exhausted their attempts.
    OutboxDlqList {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Put outbox DLQ rows back in the outbox (same id, attempts reset).
    OutboxDlqRedrive {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
        /// Outbox ids to re-drive; none means all.
        ids: Vec<i64>,
    },
    /// Dead-lettered messages of a consumer queue (left in place).
    DlqList {
        #[arg(
            long,
            env = "AMQP_URL",
            default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
        )]
        amqp_url: String,
        #[arg(long)]
        queue: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Move a consumer's dead letters back onto its queue.
    DlqRedrive {
        #[arg(
            long,
            env = "AMQP_URL",
            default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
        )]
        amqp_url: String,
        #[arg(long)]
        queue: String,
        #[arg(long, default_value_t = usize::MAX)]
        limit: usize,
    },
    /// Run archival, partition upkeep and key cleanup once.
    Maintenance {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
    },
    /// Print a development token for a tenant.
    Token {
        #[arg(long, env = "JWT_SECRET", default_value = "dev-secret-change-me")]
        secret: String,
        #[arg(long)]
        tenant: i64,
        #[arg(long, default_value_t = 86400)]
        ttl_secs: u64,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    match Cli::parse().command {
        Command::Setup {
            admin_url,
            databases,
        } => {
            let admin_opts = PgConnectOptions::from_str(&admin_url).context("parse admin URL")?;
            let admin = db::pool(admin_opts.clone(), 1)
                .await
                .context("connect as superuser")?;
            db::ensure_roles(&admin).await.context("create roles")?;
            for name in databases {
                db::ensure_database(&admin, &name)
                    .await
                    .with_context(|| format!("create database {name}"))?;
                let owner = db::pool(
                    db::options_for_role(&admin_opts.clone().database(&name), db::OWNER_ROLE),
                    1,
                )
                .await?;
                db::migrate(&owner, None)
                    .await
                    .with_context(|| format!("migrate {name}"))?;
                println!("database {name}: ready");
            }
        }
        Command::OutboxStatus { database_url } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            println!(
                "{}",
                serde_json::to_string(&relay::outbox_status(&pool).await?)?
            );
        }
        Command::OutboxDlqList {
            database_url,
            limit,
        } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            for row in relay::list_dlq(&pool, limit).await? {
                println!("{}", serde_json::to_string(&row)?);
            }
        }
        Command::OutboxDlqRedrive { database_url, ids } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            let moved =
                relay::redrive_dlq(&pool, (!ids.is_empty()).then_some(ids.as_slice())).await?;
            println!("re-drove {moved} outbox row(s)");
        }
        Command::DlqList {
            amqp_url,
            queue,
            limit,
        } => {
            let conn = broker::connect(&amqp_url, "reliability-cli").await?;
            for letter in broker::peek_dead_letters(&conn, &queue, limit).await? {
                println!("{}", serde_json::to_string(&letter)?);
            }
        }
        Command::DlqRedrive {
            amqp_url,
            queue,
            limit,
        } => {
            let conn = broker::connect(&amqp_url, "reliability-cli").await?;
            let moved = broker::redrive_dead_letters(&conn, &queue, limit).await?;
            println!("re-drove {moved} message(s) onto {queue}");
        }
        Command::Maintenance { database_url } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            let report =
                maintenance::run_once(&pool, &maintenance::MaintenanceConfig::default()).await?;
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        Command::Token {
            secret,
            tenant,
            ttl_secs,
        } => {
            let tenant = TenantId::new(tenant)?;
            println!(
                "{}",
                JwtKeys::from_secret(secret.as_bytes()).mint(tenant, Duration::from_secs(ttl_secs))
            );
        }
    }
    Ok(())
}
