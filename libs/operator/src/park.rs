//! `park …`: an ordered subscription's parked aggregates, in one service's
//! database (docs/adr/0028, docs/runbooks.md "A parked aggregate").

use clap::Subcommand;
use reliability::consumer;
use sqlx::PgPool;

use crate::outbox::done;
use crate::render::print;
use crate::target::Confirm;

#[derive(Subcommand)]
pub enum ParkCommand {
    /// Parked aggregates, oldest first: why, the first event, how many wait.
    List {
        /// Only this consumer's (e.g. shipping.orders).
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Replay the aggregate's parked events in order through the handler
    /// (fix it first), then let the aggregate flow again. The running
    /// consumer does it within a few seconds; `park list` shows when.
    Unpark {
        #[command(flatten)]
        aggregate: Aggregate,
        #[command(flatten)]
        confirm: Confirm,
    },
    /// Drop the aggregate's first parked event for good, never applied.
    /// The rest stay parked until an unpark (none left: it flows again).
    Skip {
        #[command(flatten)]
        aggregate: Aggregate,
        #[command(flatten)]
        confirm: Confirm,
    },
}

#[derive(clap::Args)]
pub struct Aggregate {
    /// The consumer, as `park list` shows it.
    #[arg(long)]
    consumer: String,
    /// The tenant that owns the aggregate.
    #[arg(long)]
    tenant: i64,
    /// `<aggregate_type>:<aggregate_id>`, as `park list` shows it.
    aggregate: String,
}

impl Aggregate {
    fn parts(&self) -> anyhow::Result<(&str, &str)> {
        self.aggregate.split_once(':').ok_or_else(|| {
            anyhow::anyhow!(
                "aggregate `{}`: expected <aggregate_type>:<aggregate_id>",
                self.aggregate
            )
        })
    }
}

pub async fn run(pool: &PgPool, command: ParkCommand, json: bool) -> anyhow::Result<()> {
    match command {
        ParkCommand::List { consumer } => {
            print(json, &consumer::parked(pool, consumer.as_deref()).await?)
        }
        ParkCommand::Unpark { aggregate, confirm } => {
            let (kind, id) = aggregate.parts()?;
            let waiting = waiting(pool, &aggregate).await?;
            let action = format!(
                "replay {waiting} parked event(s) of {} (tenant {}) in order through {}, then resume it",
                aggregate.aggregate, aggregate.tenant, aggregate.consumer
            );
            let changed = match confirm.proceed(&action)? {
                true => u64::from(
                    consumer::unpark(pool, &aggregate.consumer, aggregate.tenant, kind, id).await?,
                ),
                false => 0,
            };
            done(json, action, u64::from(waiting > 0), changed, confirm)
        }
        ParkCommand::Skip { aggregate, confirm } => {
            let (kind, id) = aggregate.parts()?;
            let first =
                consumer::first_parked(pool, &aggregate.consumer, aggregate.tenant, kind, id)
                    .await?
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "{} of tenant {} is not parked in {}",
                            aggregate.aggregate,
                            aggregate.tenant,
                            aggregate.consumer
                        )
                    })?;
            let action = format!(
                "drop for good the first parked event of {} (tenant {}): message {} ({}, number {}): {}",
                aggregate.aggregate,
                aggregate.tenant,
                first.message_id,
                first.event_type,
                first
                    .aggregate_seq
                    .map_or_else(|| "-".to_owned(), |s| s.to_string()),
                first.envelope["payload"]
            );
            let changed = match confirm.proceed(&action)? {
                // Only the event shown: if it is no longer first, nothing.
                true => {
                    let skipped = consumer::skip(
                        pool,
                        &aggregate.consumer,
                        aggregate.tenant,
                        kind,
                        id,
                        first.message_id,
                    )
                    .await?;
                    if skipped.is_none() {
                        eprintln!(
                            "message {} is no longer the first parked event (replayed or skipped meanwhile): nothing dropped",
                            first.message_id
                        );
                    }
                    u64::from(skipped.is_some())
                }
                false => 0,
            };
            done(json, action, 1, changed, confirm)
        }
    }
}

async fn waiting(pool: &PgPool, aggregate: &Aggregate) -> anyhow::Result<i64> {
    let (kind, id) = aggregate.parts()?;
    Ok(consumer::parked(pool, Some(&aggregate.consumer))
        .await?
        .into_iter()
        .find(|p| {
            p.tenant_id == aggregate.tenant && p.aggregate_type == kind && p.aggregate_id == id
        })
        .map_or(0, |p| p.waiting))
}
