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
    /// Print JSON lines instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the roles, then each database with the reliability tables; and
    /// declare every subscriber queue of the topology, so that events wait
    /// for a consumer that has never run.
    Setup {
        /// A superuser connection (creates roles and databases).
        #[arg(
            long,
            env = "ADMIN_DATABASE_URL",
            default_value = "postgres://postgres@127.0.0.1:5432/postgres"
        )]
        admin_url: String,
        /// The broker whose topology to declare.
        #[arg(
            long,
            env = "AMQP_URL",
            default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
        )]
        amqp_url: String,
        /// The events exchange.
        #[arg(long, env = "EVENTS_EXCHANGE", default_value = "commerce.events")]
        exchange: String,
        /// Prefix of every queue name, as the services are given it.
        #[arg(long, env = "QUEUE_PREFIX", default_value = "")]
        queue_prefix: String,
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
    /// One outbox DLQ row in full, payload included.
    OutboxDlqShow {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
        id: i64,
    },
    /// Delete outbox DLQ rows for good (the ids given, or all with --all).
    OutboxDlqPurge {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
        ids: Vec<i64>,
        #[arg(long, conflicts_with = "ids")]
        all: bool,
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
    /// Delete a consumer's dead letters for good.
    DlqPurge {
        #[arg(
            long,
            env = "AMQP_URL",
            default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
        )]
        amqp_url: String,
        #[arg(long)]
        queue: String,
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
    /// Consumer progress per source and tenant.
    Offsets {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Forget a consumer's offsets (and with --forget-processed its dedup
    /// records, so a replay applies everything again).
    OffsetsReset {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
        #[arg(long)]
        consumer: String,
        #[arg(long)]
        forget_processed: bool,
    },
    /// What a tenant's Idempotency-Key stored (every scope).
    IdempotencyKey {
        #[arg(long, env = "OWNER_DATABASE_URL")]
        database_url: String,
        #[arg(long)]
        tenant: i64,
        #[arg(long)]
        key: String,
    },
    /// Delete queues by name (each with its `.dlq`), e.g. leftovers of
    /// interrupted test runs: `rabbitmqctl -q list_queues name | grep … | xargs reliability delete-queues`.
    DeleteQueues {
        #[arg(
            long,
            env = "AMQP_URL",
            default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
        )]
        amqp_url: String,
        queues: Vec<String>,
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
    let cli = Cli::parse();
    let json = cli.json;
    match cli.command {
        Command::Setup {
            admin_url,
            amqp_url,
            exchange,
            queue_prefix,
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
            let queues: Vec<broker::QueueSpec> = contracts::topology::ALL
                .iter()
                .map(|sub| broker::QueueSpec::for_subscription(sub, &exchange, &queue_prefix))
                .collect();
            let conn = broker::connect(&amqp_url, "reliability-setup")
                .await
                .context("connect to the broker")?;
            let channel = broker::bounded(conn.create_channel()).await?;
            broker::bounded(broker::declare_topology(&channel, &queues))
                .await
                .context("declare the subscriber queues")?;
            let _ = conn.close(200, "setup done".into()).await;
            for q in &queues {
                println!("queue {}: bound to {}", q.queue, q.bindings.join(", "));
            }
        }
        Command::OutboxStatus { database_url } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            print(json, &[relay::outbox_status(&pool).await?])?;
        }
        Command::OutboxDlqList {
            database_url,
            limit,
        } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            print(json, &relay::list_dlq(&pool, limit).await?)?;
        }
        Command::OutboxDlqShow { database_url, id } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            match relay::show_dlq(&pool, id).await? {
                Some(entry) if json => println!("{}", serde_json::to_string(&entry)?),
                Some(entry) => println!("{}", serde_json::to_string_pretty(&entry)?),
                None => anyhow::bail!("no outbox DLQ row {id}"),
            }
        }
        Command::OutboxDlqPurge {
            database_url,
            ids,
            all,
        } => {
            anyhow::ensure!(all || !ids.is_empty(), "name the ids to purge, or --all");
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            let purged = relay::purge_dlq(&pool, (!all).then_some(ids.as_slice())).await?;
            println!("purged {purged} outbox DLQ row(s)");
        }
        Command::DeleteQueues { amqp_url, queues } => {
            let conn = broker::connect(&amqp_url, "reliability-cli").await?;
            let channel = conn.create_channel().await?;
            for q in &queues {
                channel
                    .queue_delete(
                        q.as_str().into(),
                        lapin::options::QueueDeleteOptions::default(),
                    )
                    .await?;
            }
            println!("deleted {} queue(s)", queues.len());
        }
        Command::DlqPurge { amqp_url, queue } => {
            let conn = broker::connect(&amqp_url, "reliability-cli").await?;
            let purged = broker::purge_dead_letters(&conn, &queue).await?;
            println!(
                "purged {purged} message(s) from {}",
                broker::dead_letter_queue(&queue)
            );
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
            print(
                json,
                &broker::peek_dead_letters(&conn, &queue, limit).await?,
            )?;
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
            print(json, &[report])?;
        }
        Command::Offsets {
            database_url,
            consumer,
        } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            print(
                json,
                &reliability::consumer::offsets(&pool, consumer.as_deref()).await?,
            )?;
        }
        Command::OffsetsReset {
            database_url,
            consumer,
            forget_processed,
        } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            let (offsets, processed) =
                reliability::consumer::reset_offsets(&pool, &consumer, forget_processed).await?;
            println!("{consumer}: {offsets} offset row(s) and {processed} dedup record(s) deleted");
        }
        Command::IdempotencyKey {
            database_url,
            tenant,
            key,
        } => {
            let pool = db::pool(PgConnectOptions::from_str(&database_url)?, 1).await?;
            let records =
                reliability::idempotency::lookup(&pool, TenantId::new(tenant)?, &key).await?;
            if records.is_empty() && !json {
                println!(
                    "no record of key {key:?} for tenant {tenant} (never used, or expired and cleaned up)"
                );
            }
            print(json, &records)?;
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

/// Rows as JSON lines, or as `field: value` blocks for a person.
fn print<T: serde::Serialize>(json: bool, rows: &[T]) -> anyhow::Result<()> {
    for row in rows {
        let value = serde_json::to_value(row)?;
        if json {
            println!("{value}");
            continue;
        }
        match value {
            serde_json::Value::Object(fields) => {
                let width = fields.keys().map(String::len).max().unwrap_or(0);
                for (k, v) in fields {
                    let v = match v {
                        serde_json::Value::String(s) => s,
                        serde_json::Value::Null => "-".to_owned(),
                        other => other.to_string(),
                    };
                    println!("{k:>width$}  {v}");
                }
                println!();
            }
            other => println!("{other}"),
        }
    }
    if rows.is_empty() && !json {
        println!("(none)");
    }
    Ok(())
}
