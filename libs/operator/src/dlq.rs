//! Dead-lettered messages as operators handle them (`reliability queue
//! dlq …`, the console's dead letters): peeked, re-driven in order,
//! dropped or purged, over RabbitMQ.

use lapin::options::{
    BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Confirmation, Connection, ExchangeKind};

use reliability::{Error, Result};

use reliability::broker::{
    PARTITION_HEADER, bounded, dead_letter_queue, inspect_queue, queue_depth, returns,
};

mod filter;
pub use filter::DeadLetterFilter;

/// A dead-lettered message as an operator sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetter {
    pub message_id: Option<String>,
    pub event_type: Option<String>,
    pub routing_key: String,
    pub reason: Option<String>,
    pub body: String,
}

impl DeadLetter {
    fn of(delivery: &lapin::message::Delivery) -> Self {
        let props = &delivery.properties;
        Self {
            message_id: props.message_id().as_ref().map(|s| s.as_str().to_owned()),
            event_type: props.kind().as_ref().map(|s| s.as_str().to_owned()),
            routing_key: delivery.routing_key.as_str().to_owned(),
            reason: death_reason(props.headers().as_ref()),
            body: String::from_utf8_lossy(&delivery.data).into_owned(),
        }
    }
}

/// Lists up to `limit` messages of `queue`'s DLQ without removing them.
pub async fn peek_dead_letters(
    connection: &Connection,
    queue: &str,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    let channel = connection.create_channel().await?;
    let dlq = dead_letter_queue(queue);
    let present = queue_depth(&channel, &dlq).await?;
    let mut out = Vec::new();
    let (mut last_tag, mut worn) = (None, 0);
    while out.len() < limit {
        let Some(msg) = channel
            .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        worn = worn.max(returns(&msg.delivery.properties));
        out.push(DeadLetter::of(&msg.delivery));
        last_tag = Some(msg.delivery.delivery_tag);
    }
    if let Some(tag) = last_tag {
        // Everything we took goes back, in order.
        channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await?;
    }
    channel.close(200, "peek done".into()).await?;
    until_back(connection, &dlq, present).await?;
    if worn >= WORN {
        refresh(connection, &dlq, present).await?;
    }
    Ok(out)
}

/// How often a dead letter may be handed back before a look refreshes the
/// DLQ. RabbitMQ counts each return as a delivery, and since 4.0 every
/// quorum queue has a delivery limit (20 by default) past which a message
/// is dead-lettered; a DLQ has nowhere to send it, so the 21st look would
/// drop it. (Declaring DLQs with a limit of their own is refused for those
/// that exist: the limit is an argument a queue keeps.)
const WORN: i64 = 10;

/// Moves the `count` messages at the head of `dlq` to its tail as fresh
/// copies: the order is kept and each one's delivery count starts again.
/// Each copy is confirmed before its original is acked, so a crash here
/// leaves one letter twice (the consumer's dedup absorbs a double
/// re-drive), never none. Letters that arrive meanwhile fall in between.
async fn refresh(connection: &Connection, dlq: &str, count: u32) -> Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions { nowait: false })
        .await?;
    let mut moved = 0;
    for _ in 0..count {
        let Some(msg) = channel
            .basic_get(dlq.into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        // The broker's counters are its own; the x-death history stays.
        let props = without_headers(msg.delivery.properties.clone(), |k| {
            matches!(k, "x-delivery-count" | "x-acquired-count")
        });
        publish_confirmed(&channel, "", dlq, &msg.delivery.data, props).await?;
        msg.delivery
            .ack(lapin::options::BasicAckOptions { multiple: false })
            .await?;
        moved += 1;
    }
    channel.close(200, "refresh done".into()).await?;
    tracing::info!(
        dlq,
        moved,
        "dead letters refreshed: their delivery counts start again"
    );
    Ok(())
}

/// `props` without the headers `drop` names.
fn without_headers(
    props: lapin::BasicProperties,
    drop: impl Fn(&str) -> bool,
) -> lapin::BasicProperties {
    let Some(headers) = props.headers().clone() else {
        return props;
    };
    let mut kept = FieldTable::default();
    for (k, v) in headers.inner() {
        if !drop(k.as_str()) {
            kept.insert(k.clone(), v.clone());
        }
    }
    props.with_headers(kept)
}

/// Publishes to `exchange` with `routing_key` (the default exchange, `""`:
/// to the queue of that name) and waits for the broker's confirm
/// (mandatory: an unroutable copy is an error).
async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: lapin::BasicProperties,
) -> Result<()> {
    let confirm = channel
        .basic_publish(
            ShortString::from(exchange),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            body,
            props,
        )
        .await?
        .await?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        other => Err(Error::Refused(format!(
            "publish to exchange '{exchange}' with key '{routing_key}': {other:?}"
        ))),
    }
}

/// How long a look at a DLQ waits for what it handed back to be ready
/// again.
const RETURN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits, up to [`RETURN_WAIT`], until `dlq` holds `ready` messages ready
/// again. The broker takes back what a look handed back on its own time:
/// a count, a listing or a re-drive right after would otherwise miss
/// them (a re-drive by type once moved none of two).
async fn until_back(connection: &Connection, dlq: &str, ready: u32) -> Result<()> {
    let deadline = tokio::time::Instant::now() + RETURN_WAIT;
    loop {
        let (depth, _) = inspect_queue(connection, dlq).await?;
        if depth >= ready || tokio::time::Instant::now() >= deadline {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Moves up to `limit` messages that `filter` matches from `queue`'s DLQ
/// back onto `queue` (only that consumer sees them again); for an ordered
/// subscription, onto its partitions, each to its aggregate's by the
/// `x-aggregate` it kept (its late arrival then parks the aggregate if a
/// later event of it was applied: ADR 0028). Each is acked off
/// the DLQ only after the broker confirmed the re-publish, so a crash here
/// duplicates, never loses; the consumer's dedup absorbs the duplicate. The
/// others are put back, in order.
///
/// Only the messages present when it starts are looked at: one that fails
/// again lands back in the DLQ while this runs and must not be sent round
/// twice.
pub async fn redrive_dead_letters(
    connection: &Connection,
    queue: &str,
    limit: usize,
    filter: &DeadLetterFilter,
) -> Result<usize> {
    take_dead_letters(connection, queue, limit, filter, true).await
}

/// Deletes the messages `filter` matches from `queue`'s DLQ for good (an
/// operator's skip of a letter shown to them); the others stay, in order.
pub async fn drop_dead_letters(
    connection: &Connection,
    queue: &str,
    filter: &DeadLetterFilter,
) -> Result<usize> {
    take_dead_letters(connection, queue, usize::MAX, filter, false).await
}

/// Takes what `filter` matches off the DLQ: re-published first when
/// `redrive`, else dropped.
async fn take_dead_letters(
    connection: &Connection,
    queue: &str,
    limit: usize,
    filter: &DeadLetterFilter,
    redrive: bool,
) -> Result<usize> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions { nowait: false })
        .await?;
    let dlq = dead_letter_queue(queue);
    let present = queue_depth(&channel, &dlq).await? as usize;
    let partitions = partition_exchange(connection, queue).await?;
    let (mut moved, mut kept, mut worn) = (0, Vec::new(), 0);
    for _ in 0..present {
        if moved == limit {
            break;
        }
        let Some(msg) = channel
            .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        if !filter.matches(&DeadLetter::of(&msg.delivery)) {
            worn = worn.max(returns(&msg.delivery.properties));
            kept.push(msg.delivery.delivery_tag);
            continue;
        }
        // A fresh start: the old x-death history would count against the new
        // delivery limit and confuse the next operator reading it. The
        // aggregate stays: it picks an ordered subscription's partition.
        let props = without_headers(msg.delivery.properties.clone(), |k| {
            k.starts_with("x-") && k != PARTITION_HEADER
        });
        match &partitions {
            _ if !redrive => {}
            Some(exchange) => {
                publish_confirmed(&channel, exchange, "", &msg.delivery.data, props).await?;
            }
            None => publish_confirmed(&channel, "", queue, &msg.delivery.data, props).await?,
        }
        msg.delivery
            .ack(lapin::options::BasicAckOptions { multiple: false })
            .await?;
        moved += 1;
    }
    // The others go back, each on its own (acks above sit between them).
    for tag in kept {
        let requeue = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        channel.basic_nack(tag, requeue).await?;
    }
    channel.close(200, "redrive done".into()).await?;
    let left = (present - moved) as u32;
    until_back(connection, &dlq, left).await?;
    if worn >= WORN {
        refresh(connection, &dlq, left).await?;
    }
    Ok(moved)
}

/// `<queue>.partitions`, if `queue` is an ordered subscription's (the
/// exchange exists: passive declare, on a channel of its own, since a
/// failed one closes its channel).
async fn partition_exchange(connection: &Connection, queue: &str) -> Result<Option<String>> {
    let exchange = format!("{queue}.partitions");
    let channel = connection.create_channel().await?;
    let options = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    let kind = ExchangeKind::Custom("x-consistent-hash".into());
    let found = bounded(channel.exchange_declare(
        exchange.as_str().into(),
        kind,
        options,
        FieldTable::default(),
    ))
    .await;
    match found {
        Ok(()) => {
            channel.close(200, "looked".into()).await?;
            Ok(Some(exchange))
        }
        // No such exchange (the broker closed the channel).
        Err(Error::Broker(e)) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(p)
        if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)))
}

fn death_reason(headers: Option<&FieldTable>) -> Option<String> {
    let deaths = headers?.inner().get("x-death")?;
    let AMQPValue::FieldArray(deaths) = deaths else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    match first.inner().get("reason")? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Deletes every message of `queue`'s DLQ for good; returns how many.
pub async fn purge_dead_letters(connection: &Connection, queue: &str) -> Result<u32> {
    let channel = connection.create_channel().await?;
    let purged = channel
        .queue_purge(
            dead_letter_queue(queue).as_str().into(),
            lapin::options::QueuePurgeOptions { nowait: false },
        )
        .await?;
    channel.close(200, "purge done".into()).await?;
    Ok(purged)
}
