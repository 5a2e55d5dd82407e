//! The topology (docs/adr/0002, 0012): the events exchange, each
//! consumer's quorum queue with its delivery limit and dead-letter queue,
//! declared by code before anything is published.

use futures_util::future::join_all;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use crate::{Error, Result};

use super::queue_depth;

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

pub use contracts::topology::{Subscription, topic_matches};

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
