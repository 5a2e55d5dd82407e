//! Passive looks at a queue (its depth, its consumers) and at a
//! delivery's returns: what the consumers' metrics, the topology's checks
//! and the operator's tools read.

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use crate::Result;

use super::bounded;

/// The times the broker says this message was handed back
/// (`x-delivery-count`; absent before the first return).
pub fn returns(props: &lapin::BasicProperties) -> i64 {
    let count = props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").cloned());
    match count {
        Some(AMQPValue::LongLongInt(n)) => n,
        Some(AMQPValue::LongInt(n)) => n.into(),
        Some(AMQPValue::LongUInt(n)) => n.into(),
        Some(AMQPValue::ShortInt(n)) => n.into(),
        Some(AMQPValue::ShortUInt(n)) => n.into(),
        _ => 0,
    }
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
