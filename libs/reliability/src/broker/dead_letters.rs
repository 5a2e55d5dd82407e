//! Dead-lettered messages as operators handle them (`reliability queue
//! dlq …`), and passive looks at a queue's depth.

use lapin::options::{
    BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Confirmation, Connection};

use crate::{Error, Result};

use super::{bounded, dead_letter_queue};

/// A dead-lettered message as an operator sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetter {
    pub message_id: Option<String>,
    pub event_type: Option<String>,
    pub routing_key: String,
    pub reason: Option<String>,
    pub body: String,
}

/// Lists up to `limit` messages of `queue`'s DLQ without removing them.
pub async fn peek_dead_letters(
    connection: &Connection,
    queue: &str,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    let channel = connection.create_channel().await?;
    let dlq = dead_letter_queue(queue);
    let mut out = Vec::new();
    let mut last_tag = None;
    while out.len() < limit {
        let Some(msg) = channel
            .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        let props = &msg.delivery.properties;
        out.push(DeadLetter {
            message_id: props.message_id().as_ref().map(|s| s.as_str().to_owned()),
            event_type: props.kind().as_ref().map(|s| s.as_str().to_owned()),
            routing_key: msg.delivery.routing_key.as_str().to_owned(),
            reason: death_reason(props.headers().as_ref()),
            body: String::from_utf8_lossy(&msg.delivery.data).into_owned(),
        });
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
    Ok(out)
}

/// Moves up to `limit` messages from `queue`'s DLQ back onto `queue` (only
/// that consumer sees them again). Each is acked off the DLQ only after the
/// broker confirmed the re-publish, so a crash here duplicates, never loses;
/// the consumer's dedup absorbs the duplicate.
///
/// Only the messages present when it starts are moved: one that fails again
/// lands back in the DLQ while this runs and must not be sent round twice.
pub async fn redrive_dead_letters(
    connection: &Connection,
    queue: &str,
    limit: usize,
) -> Result<usize> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions { nowait: false })
        .await?;
    let dlq = dead_letter_queue(queue);
    let limit = limit.min(queue_depth(&channel, &dlq).await? as usize);
    let mut moved = 0;
    while moved < limit {
        let Some(msg) = channel
            .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        let mut props = msg.delivery.properties.clone();
        // A fresh start: the old x-death history would count against the new
        // delivery limit and confuse the next operator reading it.
        if let Some(headers) = props.headers().clone() {
            let mut kept = FieldTable::default();
            for (k, v) in headers.inner() {
                if !k.as_str().starts_with("x-") {
                    kept.insert(k.clone(), v.clone());
                }
            }
            props = props.with_headers(kept);
        }
        let confirm = channel
            .basic_publish(
                ShortString::from(""),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &msg.delivery.data,
                props,
            )
            .await?
            .await?;
        if !matches!(confirm, Confirmation::Ack(None)) {
            return Err(Error::Refused(format!(
                "re-drive to queue {queue}: {confirm:?}"
            )));
        }
        msg.delivery
            .ack(lapin::options::BasicAckOptions { multiple: false })
            .await?;
        moved += 1;
    }
    channel.close(200, "redrive done".into()).await?;
    Ok(moved)
}

/// A queue's ready messages and attached consumers, looked at on a channel
/// of its own, since a failed passive declare (no such queue) closes its
/// channel. Bounded like every broker call.
pub async fn inspect_queue(connection: &Connection, queue: &str) -> Result<(u32, u32)> {
    let channel = bounded(connection.create_channel()).await?;
    let q = bounded(passive_declare(&channel, queue)).await?;
    let _ = bounded(channel.close(200, "looked".into())).await;
    Ok((q.message_count(), q.consumer_count()))
}

/// Messages waiting in `queue` (passive declare: fails if it does not exist).
pub async fn queue_depth(channel: &Channel, queue: &str) -> Result<u32> {
    Ok(passive_declare(channel, queue).await?.message_count())
}

async fn passive_declare(channel: &Channel, queue: &str) -> lapin::Result<lapin::Queue> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
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
