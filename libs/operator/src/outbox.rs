//! `outbox …`, `offsets …`, `idempotency key`, `maintenance …`: one
//! service database's reliability tables.

use clap::Subcommand;
use operator::ops::outbox;
use reliability::TenantId;
use service_kit::idempotency;
use sqlx::PgPool;

use crate::render::print;
use crate::target::{Confirm, Done};

#[derive(Subcommand)]
pub enum OutboxCommand {
    /// Pending rows, oldest pending age, most attempts, DLQ rows.
    Status,
    /// Rows that exhausted their attempts (the DLQ table).
    Dlq {
        #[command(subcommand)]
        command: OutboxDlq,
    },
}

#[derive(Subcommand)]
pub enum OutboxDlq {
    /// List them.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// One in full, payload included.
    Show {
        /// Its outbox id.
        id: i64,
    },
    /// Put rows back in the outbox (same id, attempts reset): the relay
    /// publishes them again.
    Redrive {
        /// Outbox ids; none means all.
        ids: Vec<i64>,
        #[command(flatten)]
        confirm: Confirm,
    },
    /// Delete rows for good.
    Purge {
        /// Outbox ids.
        ids: Vec<i64>,
        /// Every row.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        #[command(flatten)]
        confirm: Confirm,
    },
}

#[derive(Subcommand)]
pub enum OffsetsCommand {
    /// Consumer progress per source and tenant.
    List {
        /// Only this consumer, e.g. projection.views.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Forget a consumer's offsets (and with --forget-processed its dedup
    /// records, so that a replay applies everything again).
    Reset {
        /// The consumer, e.g. projection.views.
        #[arg(long)]
        consumer: String,
        /// Its dedup records too.
        #[arg(long)]
        forget_processed: bool,
        #[command(flatten)]
        confirm: Confirm,
    },
}

#[derive(Subcommand)]
pub enum IdempotencyCommand {
    /// What a tenant's Idempotency-Key stored, in every scope.
    Key {
        /// The tenant.
        #[arg(long)]
        tenant: i64,
        /// The key as the client sent it.
        #[arg(long)]
        key: String,
    },
}

#[derive(Subcommand)]
pub enum MaintenanceCommand {
    /// Archive processed rows, create and drop archive partitions, delete
    /// expired keys and old dedup records, once (what every service does on
    /// its interval: nothing a policy would keep is removed).
    Run,
    /// Each step's last success and failure.
    Last,
}

async fn dlq_count(pool: &PgPool, ids: Option<&[i64]>) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_messages_dlq WHERE $1::bigint[] IS NULL OR id = ANY($1)",
    )
    .bind(ids)
    .fetch_one(pool)
    .await?;
    Ok(n as u64)
}

pub async fn outbox(pool: &PgPool, command: OutboxCommand, json: bool) -> anyhow::Result<()> {
    match command {
        OutboxCommand::Status => print(json, &[outbox::outbox_status(pool).await?]),
        OutboxCommand::Dlq { command } => match command {
            OutboxDlq::List { limit } => print(json, &outbox::list_dlq(pool, limit).await?),
            OutboxDlq::Show { id } => {
                let entry = outbox::show_dlq(pool, id)
                    .await?
                    .ok_or_else(|| anyhow::anyhow!("no outbox DLQ row {id}"))?;
                match json {
                    true => println!("{}", serde_json::to_string(&entry)?),
                    false => println!("{}", serde_json::to_string_pretty(&entry)?),
                }
                Ok(())
            }
            OutboxDlq::Redrive { ids, confirm } => {
                let ids = (!ids.is_empty()).then_some(ids.as_slice());
                let matched = dlq_count(pool, ids).await?;
                let action = format!("re-drive {matched} outbox DLQ row(s) into the outbox");
                let changed = match confirm.proceed(&action)? {
                    true => outbox::redrive_dlq(pool, ids).await?,
                    false => 0,
                };
                done(json, action, matched, changed, confirm)
            }
            OutboxDlq::Purge { ids, all, confirm } => {
                anyhow::ensure!(all || !ids.is_empty(), "name the ids to purge, or --all");
                let ids = (!all).then_some(ids.as_slice());
                let matched = dlq_count(pool, ids).await?;
                let action = format!("delete {matched} outbox DLQ row(s) for good");
                let changed = match confirm.proceed(&action)? {
                    true => outbox::purge_dlq(pool, ids).await?,
                    false => 0,
                };
                done(json, action, matched, changed, confirm)
            }
        },
    }
}

pub async fn offsets(pool: &PgPool, command: OffsetsCommand, json: bool) -> anyhow::Result<()> {
    match command {
        OffsetsCommand::List { consumer } => print(
            json,
            &operator::ops::offsets::offsets(pool, consumer.as_deref()).await?,
        ),
        OffsetsCommand::Reset {
            consumer,
            forget_processed,
            confirm,
        } => {
            let (offsets, processed): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM consumer_offsets WHERE consumer = $1),
                        (SELECT count(*) FROM processed_messages WHERE consumer = $1)",
            )
            .bind(&consumer)
            .fetch_one(pool)
            .await?;
            let processed = if forget_processed { processed } else { 0 };
            let action = format!(
                "{consumer}: delete {offsets} offset row(s) and {processed} dedup record(s)"
            );
            let changed = match confirm.proceed(&action)? {
                true => {
                    let (a, b) =
                        operator::ops::offsets::reset_offsets(pool, &consumer, forget_processed)
                            .await?;
                    a + b
                }
                false => 0,
            };
            done(json, action, (offsets + processed) as u64, changed, confirm)
        }
    }
}

pub async fn idempotency(
    pool: &PgPool,
    command: IdempotencyCommand,
    json: bool,
) -> anyhow::Result<()> {
    let IdempotencyCommand::Key { tenant, key } = command;
    let records = idempotency::lookup(pool, TenantId::new(tenant)?, &key).await?;
    if records.is_empty() && !json {
        println!(
            "no record of key {key:?} for tenant {tenant} (never used, or expired and cleaned up)"
        );
        return Ok(());
    }
    print(json, &records)
}

pub async fn maintenance(
    pool: &PgPool,
    command: MaintenanceCommand,
    json: bool,
) -> anyhow::Result<()> {
    match command {
        MaintenanceCommand::Run => {
            let config = maintenance::MaintenanceConfig::default();
            print(json, &[maintenance::run_once(pool, &config).await?])
        }
        MaintenanceCommand::Last => print(json, &maintenance::last_runs(pool).await?),
    }
}

pub fn done(
    json: bool,
    action: String,
    matched: u64,
    changed: u64,
    confirm: Confirm,
) -> anyhow::Result<()> {
    let done = Done {
        action,
        matched,
        changed,
        dry_run: confirm.dry_run,
    };
    if json {
        println!("{}", serde_json::to_string(&done)?);
    } else if !done.dry_run {
        println!("done: {} changed", done.changed);
    }
    Ok(())
}
