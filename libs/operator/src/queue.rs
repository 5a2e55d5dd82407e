//! `queue …`: a consumer's queue and its dead letters on the broker.

use clap::Subcommand;
use lapin::options::QueueDeleteOptions;
use reliability::broker;

use crate::outbox::done;
use crate::render::print;
use crate::target::Confirm;

#[derive(Subcommand)]
pub enum QueueCommand {
    /// A consumer queue's dead letters (its `.dlq`).
    Dlq {
        #[command(subcommand)]
        command: QueueDlq,
    },
    /// Whether an ordered subscription's K partitions are drained: each
    /// empty, with no consumer attached. The step before changing K
    /// (docs/runbooks.md, "Changing an ordered subscription's partitions"):
    /// exits 1 while any partition holds a message or a consumer.
    Drained {
        /// The subscription's queue name (its partitions are `<queue>.p<i>`).
        queue: String,
        /// Its partitions now (K).
        #[arg(long)]
        partitions: u16,
    },
    /// Delete queues (each with its `.dlq`), e.g. leftovers of interrupted
    /// test runs.
    Delete {
        /// Queue names.
        #[arg(required = true)]
        queues: Vec<String>,
        #[command(flatten)]
        confirm: Confirm,
    },
}

#[derive(Subcommand)]
pub enum QueueDlq {
    /// List dead letters (each is put back).
    List {
        /// The consumer's queue, e.g. inventory.stock.
        queue: String,
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Move dead letters back onto the consumer's queue: all, one
    /// (`--message-id`, as `list` shows it) or a group (`--event-type`).
    Redrive {
        /// The consumer's queue.
        queue: String,
        /// At most this many.
        #[arg(long, default_value_t = usize::MAX)]
        limit: usize,
        /// Only the dead letter with this message id (`source:id`).
        #[arg(long)]
        message_id: Option<String>,
        /// Only the dead letters of this event type (e.g. `orders.OrderPlaced`).
        #[arg(long)]
        event_type: Option<String>,
        #[command(flatten)]
        confirm: Confirm,
    },
    /// Delete them for good.
    Purge {
        /// The consumer's queue.
        queue: String,
        #[command(flatten)]
        confirm: Confirm,
    },
}

/// Messages in `queue`, or None if it does not exist.
async fn depth(conn: &lapin::Connection, queue: &str) -> anyhow::Result<Option<u32>> {
    Ok(broker::inspect_queue(conn, queue)
        .await
        .ok()
        .map(|(ready, _)| ready))
}

pub async fn run(
    conn: &lapin::Connection,
    command: QueueCommand,
    json: bool,
) -> anyhow::Result<()> {
    match command {
        QueueCommand::Dlq { command } => match command {
            QueueDlq::List { queue, limit } => print(
                json,
                &operator::dlq::peek_dead_letters(conn, &queue, limit).await?,
            ),
            QueueDlq::Redrive {
                queue,
                limit,
                message_id,
                event_type,
                confirm,
            } => {
                let dlq = broker::dead_letter_queue(&queue);
                let filter = operator::dlq::DeadLetterFilter {
                    message_id,
                    event_type,
                    message_ids: None,
                };
                let present = depth(conn, &dlq).await?.unwrap_or(0) as usize;
                // Only a filter needs the messages read to count them (each
                // read hands them back, a delivery more for a queue that
                // counts them); all of them are the DLQ's depth.
                let matching = if filter.message_id.is_none() && filter.event_type.is_none() {
                    present
                } else {
                    operator::dlq::peek_dead_letters(conn, &queue, present)
                        .await?
                        .iter()
                        .filter(|l| filter.matches(l))
                        .count()
                };
                let matched = matching.min(limit) as u64;
                let action = format!("move {matched} message(s) from {dlq} onto {queue}");
                let changed = match confirm.proceed(&action)? {
                    true => {
                        operator::dlq::redrive_dead_letters(conn, &queue, limit, &filter).await?
                            as u64
                    }
                    false => 0,
                };
                done(json, action, matched, changed, confirm)
            }
            QueueDlq::Purge { queue, confirm } => {
                let dlq = broker::dead_letter_queue(&queue);
                let matched = depth(conn, &dlq).await?.unwrap_or(0);
                let action = format!("delete {matched} message(s) of {dlq} for good");
                let changed = match confirm.proceed(&action)? {
                    true => u64::from(operator::dlq::purge_dead_letters(conn, &queue).await?),
                    false => 0,
                };
                done(json, action, u64::from(matched), changed, confirm)
            }
        },
        QueueCommand::Drained { queue, partitions } => {
            let mut spec = broker::QueueSpec::new(&queue, "", &[]);
            spec.partitions = partitions;
            let mut rows = Vec::new();
            let mut busy = Vec::new();
            for name in spec.queues() {
                let (ready, consumers) = broker::inspect_queue(conn, &name)
                    .await
                    .map_err(|e| anyhow::anyhow!("partition {name}: {e}"))?;
                if ready > 0 || consumers > 0 {
                    busy.push(format!("{name} ({ready} ready, {consumers} consumers)"));
                }
                rows.push(
                    serde_json::json!({"queue": name, "ready": ready, "consumers": consumers}),
                );
            }
            print(json, &rows)?;
            anyhow::ensure!(
                busy.is_empty(),
                "not drained: {}; stop the relays, let the consumers empty the partitions, stop the consumers, then ask again",
                busy.join(", ")
            );
            eprintln!("drained: {partitions} partitions empty, no consumer attached; K may change");
            Ok(())
        }
        QueueCommand::Delete { queues, confirm } => {
            let mut names = Vec::new();
            let mut messages = 0;
            for q in &queues {
                for name in [q.clone(), broker::dead_letter_queue(q)] {
                    if names.contains(&name) {
                        continue;
                    }
                    if let Some(n) = depth(conn, &name).await? {
                        messages += n;
                        names.push(name);
                    }
                }
            }
            let action = format!(
                "delete {} queue(s) holding {messages} message(s): {}",
                names.len(),
                names.join(" ")
            );
            let mut changed = 0;
            if confirm.proceed(&action)? {
                let channel = conn.create_channel().await?;
                for name in &names {
                    channel
                        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                        .await?;
                    changed += 1;
                }
            }
            done(json, action, names.len() as u64, changed, confirm)
        }
    }
}
