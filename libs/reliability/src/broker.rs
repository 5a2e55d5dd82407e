//! RabbitMQ: connection, topology, the confirmed publisher, dead letters.
//!
//! Topology (docs/adr/0002): one durable topic exchange for events; per
//! consumer a durable quorum queue with an explicit delivery limit whose
//! dead letters go, through `<exchange>.dlx`, to its own `<queue>.dlq`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use lapin::options::{
    BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    PublisherConfirm,
};

use crate::failpoint::{self, FailPoints};
use crate::{Error, Result};

/// Connects with a name that shows in the management UI.
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name(LongString::from(name));
    bounded(Connection::connect(url, props)).await
}

/// How long any single broker call may take before the connection is
/// treated as dead. Over a connection reset mid-call, lapin can leave a
/// call's promise pending forever (seen in e2e after `rabbitmqctl stop_app`),
/// so every call on a long-lived connection goes through [`bounded`].
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Awaits a broker call for at most [`CALL_TIMEOUT`].
pub async fn bounded<T, E: Into<Error>>(
    call: impl Future<Output = std::result::Result<T, E>>,
) -> Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(Error::BrokerTimeout(CALL_TIMEOUT)),
    }
}

pub fn dead_letter_exchange(exchange: &str) -> String {
    format!("{exchange}.dlx")
}

pub fn dead_letter_queue(queue: &str) -> String {
    format!("{queue}.dlq")
}

/// Declares the events exchange: a durable topic exchange.
pub async fn declare_exchange(channel: &Channel, exchange: &str) -> Result<()> {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: false,
                durable: true, // survives a broker restart (I1)
                auto_delete: false,
                internal: false,
                nowait: false,
            },
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

pub use contracts::topology::Subscription;

/// Declares every queue of `queues` (with its bindings, DLX and DLQ), as
/// setup and a relay do before anything is published: idempotent.
pub async fn declare_topology(channel: &Channel, queues: &[QueueSpec]) -> Result<()> {
    for spec in queues {
        declare_queue(channel, spec).await?;
    }
    Ok(())
}

/// Checks that every queue of `queues` exists (passive declares, side by
/// side on one channel). A missing one closes `channel`: the caller
/// reconnects and declares the topology again before it publishes.
pub async fn require_queues(channel: &Channel, queues: &[QueueSpec]) -> Result<()> {
    let checks = join_all(queues.iter().map(|q| queue_depth(channel, &q.queue))).await;
    for (spec, check) in queues.iter().zip(checks) {
        if let Err(e) = check {
            return Err(Error::Topology(format!(
                "queue {} is missing: {e}",
                spec.queue
            )));
        }
    }
    Ok(())
}

/// A consumer's queue and where its poison messages end.
#[derive(Debug, Clone)]
pub struct QueueSpec {
    pub queue: String,
    pub exchange: String,
    /// Topic patterns bound to the queue, e.g. `orders.OrderPlaced` or `orders.*`.
    pub bindings: Vec<String>,
    /// Deliveries of one message before the broker dead-letters it. RabbitMQ
    /// 3.10 has no default: without it a message that crashes its consumer
    /// would be redelivered forever (I8).
    pub delivery_limit: u32,
}

impl QueueSpec {
    /// The queue of `sub` on `exchange`, its name prefixed with
    /// `queue_prefix` (tests and side-by-side stacks keep theirs apart).
    pub fn for_subscription(sub: &Subscription, exchange: &str, queue_prefix: &str) -> Self {
        Self {
            queue: format!("{queue_prefix}{}", sub.consumer),
            exchange: exchange.to_owned(),
            bindings: sub.bindings.iter().map(|b| (*b).to_owned()).collect(),
            delivery_limit: 10,
        }
    }
}

/// Whether a topic exchange routes `routing_key` through `binding`
/// (`*`: exactly one word, `#`: zero or more).
pub fn topic_matches(binding: &str, routing_key: &str) -> bool {
    fn go(pattern: &[&str], key: &[&str]) -> bool {
        match (pattern.first(), key.first()) {
            (None, None) => true,
            (Some(&"#"), _) => {
                go(&pattern[1..], key) || (!key.is_empty() && go(pattern, &key[1..]))
            }
            (Some(&"*"), Some(_)) => go(&pattern[1..], &key[1..]),
            (Some(p), Some(k)) => p == k && go(&pattern[1..], &key[1..]),
            _ => false,
        }
    }
    let pattern: Vec<&str> = binding.split('.').collect();
    let key: Vec<&str> = routing_key.split('.').collect();
    go(&pattern, &key)
}

/// Declares the exchange, the dead-letter exchange, the queue, its DLQ and
/// bindings. Idempotent; every consumer runs it on start.
pub async fn declare_queue(channel: &Channel, spec: &QueueSpec) -> Result<()> {
    declare_exchange(channel, &spec.exchange).await?;
    let dlx = dead_letter_exchange(&spec.exchange);
    channel
        .exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: false,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
            },
            FieldTable::default(),
        )
        .await?;

    let durable = QueueDeclareOptions {
        passive: false,
        durable: true,      // survives a broker restart
        exclusive: false,   // several consumers may compete on it
        auto_delete: false, // keeps messages while no consumer is connected
        nowait: false,
    };
    let dlq = dead_letter_queue(&spec.queue);
    let mut dlq_args = FieldTable::default();
    dlq_args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(dlq.as_str().into(), durable, dlq_args)
        .await?;
    channel
        .queue_bind(
            dlq.as_str().into(),
            dlx.as_str().into(),
            spec.queue.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let mut args = FieldTable::default();
    // Quorum: replicated by Raft on a cluster, counts deliveries (x-delivery-limit).
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongLongInt(spec.delivery_limit.into()),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.as_str().into()),
    );
    // Route dead letters to this queue's DLQ only, not to every subscriber.
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(spec.queue.as_str().into()),
    );
    // At-least-once dead-lettering: a poison message is not lost on its way to the DLQ.
    args.insert(
        "x-dead-letter-strategy".into(),
        AMQPValue::LongString("at-least-once".into()),
    );
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    channel
        .queue_declare(spec.queue.as_str().into(), durable, args)
        .await?;
    for key in &spec.bindings {
        channel
            .queue_bind(
                spec.queue.as_str().into(),
                spec.exchange.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub routing_key: String,
    pub message_id: String,
    pub kind: String,
    pub headers: FieldTable,
    pub body: Vec<u8>,
}

/// Why the broker did not take a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishFailure {
    /// Mandatory publish found no queue: the broker returns AND acks it, so a
    /// bare confirm would have dropped it silently.
    #[error("unroutable: no queue bound for routing key {0}")]
    Unroutable(String),
    #[error("broker nacked the message")]
    Nacked,
    #[error("no confirm within {0:?}")]
    Timeout(Duration),
    #[error("broker error: {0}")]
    Broker(String),
}

impl PublishFailure {
    /// The broker refused this message (returned it, or nacked it): retrying
    /// it may never help, so it counts toward the DLQ. A timeout or a lost
    /// connection says nothing about the message (a blocked or unreachable
    /// broker): it costs no attempt (docs/adr/0013).
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::Unroutable(_) | Self::Nacked)
    }
}

/// A channel in confirm mode publishing to one exchange.
pub struct Publisher {
    channel: Channel,
    exchange: String,
    confirm_timeout: Duration,
    fail_points: FailPoints,
    /// Message ids the broker returned, noted by whichever batch's confirm
    /// carried the return (see [`Sent::settle`]).
    returned: Arc<Mutex<HashSet<String>>>,
}

impl Publisher {
    pub async fn new(
        connection: &Connection,
        exchange: &str,
        confirm_timeout: Duration,
    ) -> Result<Self> {
        let channel = bounded(connection.create_channel()).await?;
        bounded(channel.confirm_select(ConfirmSelectOptions { nowait: false })).await?;
        bounded(declare_exchange(&channel, exchange)).await?;
        Ok(Self {
            channel,
            exchange: exchange.to_owned(),
            confirm_timeout,
            fail_points: FailPoints::none(),
            returned: Arc::default(),
        })
    }

    /// Arms `relay.before_confirm` (between the publishes and their confirms).
    #[must_use]
    pub fn with_fail_points(mut self, fail_points: FailPoints) -> Self {
        self.fail_points = fail_points;
        self
    }

    /// False once the channel or its connection has closed (e.g. after
    /// publishing to a missing exchange, or a broker restart).
    pub fn is_usable(&self) -> bool {
        self.channel.status().connected()
    }

    /// Declares `queues` on this publisher's channel (idempotent).
    pub async fn declare_topology(&self, queues: &[QueueSpec]) -> Result<()> {
        bounded(declare_topology(&self.channel, queues)).await
    }

    /// Fails, and leaves this publisher unusable, if any of `queues` is
    /// missing (see [`require_queues`]).
    pub async fn require_queues(&self, queues: &[QueueSpec]) -> Result<()> {
        bounded(require_queues(&self.channel, queues)).await
    }

    /// Publishes every message, then awaits all confirms together: one round
    /// trip per batch instead of one per message. The result for message `i`
    /// is at index `i`. See [`Publisher::send`] and [`Sent::settle`].
    pub async fn publish_batch(&self, messages: &[Outgoing]) -> Vec<Result<(), PublishFailure>> {
        self.send(messages).await.settle().await
    }

    /// Publishes every message and returns without waiting for the broker:
    /// its confirms arrive while the caller does other work (claims the next
    /// batch), and [`Sent::settle`] collects them. The batch, publishes
    /// included, is bounded by the confirm timeout from now (a dead or
    /// blocked connection must not hold a claim forever), message by
    /// message.
    pub async fn send(&self, messages: &[Outgoing]) -> Sent {
        let deadline = tokio::time::Instant::now() + self.confirm_timeout;
        let mut pending = Vec::with_capacity(messages.len());
        for m in messages {
            let props = BasicProperties::default()
                .with_delivery_mode(2) // persistent
                .with_content_type("application/json".into())
                .with_message_id(m.message_id.as_str().into())
                .with_type(m.kind.as_str().into())
                .with_headers(m.headers.clone());
            let sent = self.channel.basic_publish(
                self.exchange.as_str().into(),
                m.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &m.body,
                props,
            );
            // A broker that blocks publishers (memory or disk alarm) stops
            // reading: what is not sent by the deadline is not published.
            match tokio::time::timeout_at(deadline, sent).await {
                Ok(Ok(confirm)) => pending.push(Ok(confirm)),
                Ok(Err(e)) => pending.push(Err(PublishFailure::Broker(e.to_string()))),
                Err(_) => pending.push(Err(PublishFailure::Timeout(self.confirm_timeout))),
            }
        }
        let fired = self
            .fail_points
            .check(failpoint::RELAY_BEFORE_CONFIRM)
            .is_err();
        Sent {
            pending,
            ids: messages.iter().map(|m| m.message_id.clone()).collect(),
            routing_keys: messages.iter().map(|m| m.routing_key.clone()).collect(),
            deadline,
            timeout: self.confirm_timeout,
            fired,
            returned: self.returned.clone(),
        }
    }
}

/// A batch handed to the broker, its confirms on their way.
pub struct Sent {
    pending: Vec<Result<PublisherConfirm, PublishFailure>>,
    ids: Vec<String>,
    routing_keys: Vec<String>,
    deadline: tokio::time::Instant,
    timeout: Duration,
    /// `relay.before_confirm` fired between the publishes and the confirms.
    fired: bool,
    returned: Arc<Mutex<HashSet<String>>>,
}

impl Sent {
    /// Awaits the batch's confirms (until its deadline): the result of
    /// message `i` at index `i`.
    ///
    /// A `basic.return` is handed to whichever confirm resolves next, not to
    /// the confirm of the message it returns (and a multiple ack resolves
    /// confirms in no fixed order, across batches too), so every return is
    /// noted by `message_id` (set on every message we publish) in a set the
    /// publisher's batches share, and each batch looks its messages up
    /// there. Batches must be settled in the order they were sent: then the
    /// return of any message of this batch has been noted by the time its
    /// confirms resolved (the broker sends a return before the ack).
    pub async fn settle(self) -> Vec<Result<(), PublishFailure>> {
        if self.fired {
            return vec![
                Err(PublishFailure::Broker("fail point before confirm".into()));
                self.ids.len()
            ];
        }
        let (deadline, timeout) = (self.deadline, self.timeout);
        let confirms = join_all(self.pending.into_iter().map(|sent| async move {
            let confirm = sent?;
            match tokio::time::timeout_at(deadline, confirm).await {
                Ok(confirmed) => confirmed.map_err(|e| PublishFailure::Broker(e.to_string())),
                Err(_) => Err(PublishFailure::Timeout(timeout)),
            }
        }))
        .await;
        let mut returned = self.returned.lock().expect("returned set poisoned");
        for c in &confirms {
            if let Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret))) = c
                && let Some(id) = ret.delivery.properties.message_id()
            {
                returned.insert(id.as_str().to_owned());
            }
        }
        confirms
            .into_iter()
            .zip(self.ids.iter().zip(&self.routing_keys))
            .map(|(confirm, (id, routing_key))| {
                if returned.remove(id) {
                    return Err(PublishFailure::Unroutable(routing_key.clone()));
                }
                match confirm? {
                    Confirmation::Ack(_) => Ok(()),
                    Confirmation::Nack(_) => Err(PublishFailure::Nacked),
                    Confirmation::NotRequested => {
                        Err(PublishFailure::Broker("confirms not enabled".into()))
                    }
                }
            })
            .collect()
    }
}

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
            return Err(Error::Config(format!(
                "re-drive to queue {queue} was not accepted: {confirm:?}"
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
    let q = bounded(channel.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    ))
    .await?;
    let _ = channel.close(200, "looked".into()).await;
    Ok((q.message_count(), q.consumer_count()))
}

/// Messages waiting in `queue` (passive declare: fails if it does not exist).
pub async fn queue_depth(channel: &Channel, queue: &str) -> Result<u32> {
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(q.message_count())
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

/// String headers as an AMQP table.
pub fn headers_from_json(map: &serde_json::Map<String, serde_json::Value>) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in map {
        let s = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        table.insert(k.as_str().into(), AMQPValue::LongString(s.into()));
    }
    table
}

/// A string header of a delivery, if present.
pub fn header_str(props: &BasicProperties, name: &str) -> Option<String> {
    match props.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
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

#[cfg(test)]
mod tests {
    use super::topic_matches;

    #[test]
    fn topic_bindings_match_as_rabbitmq_routes() {
        assert!(topic_matches("orders.*", "orders.OrderPlaced"));
        assert!(!topic_matches("orders.*", "inventory.OrderPlaced"));
        assert!(!topic_matches("orders.*", "orders.a.b"));
        assert!(topic_matches("orders.#", "orders"));
        assert!(topic_matches("orders.#", "orders.a.b"));
        assert!(topic_matches("#", "anything.at.all"));
        assert!(topic_matches("orders.OrderPlaced", "orders.OrderPlaced"));
        assert!(!topic_matches(
            "orders.OrderPlaced",
            "orders.OrderConfirmed"
        ));
    }
}
