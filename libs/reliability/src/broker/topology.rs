//! The topology (docs/adr/0002, 0012): the events exchange, each
//! consumer's quorum queue with its delivery limit and dead-letter queue,
//! declared by code before anything is published.

use futures_util::future::join_all;
use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
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
    durable_exchange(
        channel,
        exchange,
        ExchangeKind::Topic,
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Declares a durable exchange (it survives a broker restart, I1).
async fn durable_exchange(
    channel: &Channel,
    name: &str,
    kind: ExchangeKind,
    args: FieldTable,
) -> lapin::Result<()> {
    channel
        .exchange_declare(
            name.into(),
            kind,
            ExchangeDeclareOptions {
                passive: false,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
            },
            args,
        )
        .await
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
/// side on one channel): an ordered subscription's every partition. A
/// missing one closes `channel`: the caller reconnects and declares the
/// topology again before it publishes.
pub async fn require_queues(channel: &Channel, queues: &[QueueSpec]) -> Result<()> {
    let names: Vec<String> = queues.iter().flat_map(QueueSpec::queues).collect();
    let checks = join_all(names.iter().map(|q| queue_depth(channel, q))).await;
    for (name, check) in names.iter().zip(checks) {
        if let Err(e) = check {
            return Err(Error::Topology(format!("queue {name} is missing: {e}")));
        }
    }
    Ok(())
}

/// The message header an ordered subscription's partitions are chosen by:
/// `<tenant>/<aggregate_type>:<aggregate_id>`, set by the relay on every
/// message.
pub const PARTITION_HEADER: &str = "x-aggregate";

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
    /// 0: one queue, order-free. K > 0: K partition queues
    /// (`<queue>.p0`...), each with a single active consumer, behind a
    /// consistent-hash exchange on [`PARTITION_HEADER`] (docs/adr/0028).
    pub partitions: u16,
    /// Ordered, and bound to every event its sources number in each of
    /// its aggregates: the gate waits for a number skipped
    /// ([`Subscription::whole`], docs/adr/0040).
    pub whole: bool,
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
            partitions: sub.partitions,
            whole: sub.whole && sub.partitions > 0,
        }
    }

    /// An order-free queue bound to `bindings` on `exchange`.
    pub fn new(queue: &str, exchange: &str, bindings: &[&str]) -> Self {
        Self {
            queue: queue.to_owned(),
            exchange: exchange.to_owned(),
            bindings: bindings.iter().map(|b| (*b).to_owned()).collect(),
            delivery_limit: 10,
            partitions: 0,
            whole: false,
        }
    }

    pub fn is_ordered(&self) -> bool {
        self.partitions > 0
    }

    /// The consistent-hash exchange in front of the partitions.
    pub fn partition_exchange(&self) -> String {
        format!("{}.partitions", self.queue)
    }

    /// Partition `p`'s queue.
    pub fn partition_queue(&self, p: u16) -> String {
        format!("{}.p{p}", self.queue)
    }

    /// The queues messages wait in: the queue, or every partition's.
    pub fn queues(&self) -> Vec<String> {
        if self.is_ordered() {
            (0..self.partitions)
                .map(|p| self.partition_queue(p))
                .collect()
        } else {
            vec![self.queue.clone()]
        }
    }
}

/// The partitions `setting` (`consumer=K,...`, as `ORDERED_PARTITIONS`
/// reads) gives `sub` in place of the code's K, if it names it. A malformed
/// item, a K outside 1..=1024, or an order-free subscription named: an error.
pub fn partitions_override(setting: &str, sub: &Subscription) -> Result<Option<u16>> {
    let mut found = None;
    for item in setting.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = || {
            Error::Config(format!(
                "ORDERED_PARTITIONS: `{item}` is not consumer=K with K from 1 to 1024"
            ))
        };
        let (consumer, k) = item.split_once('=').ok_or_else(bad)?;
        let k: u16 = k.trim().parse().map_err(|_| bad())?;
        if !(1..=1024).contains(&k) {
            return Err(bad());
        }
        if consumer.trim() == sub.consumer {
            if !sub.is_ordered() {
                return Err(Error::Config(format!(
                    "ORDERED_PARTITIONS: {} is an order-free subscription",
                    sub.consumer
                )));
            }
            found = Some(k);
        }
    }
    Ok(found)
}

/// Declares the exchange, the dead-letter exchange, the queue, its DLQ and
/// bindings. Idempotent; every consumer runs it on start.
pub async fn declare_queue(channel: &Channel, spec: &QueueSpec) -> Result<()> {
    declare_exchange(channel, &spec.exchange).await?;
    let dlx = dead_letter_exchange(&spec.exchange);
    durable_exchange(channel, &dlx, ExchangeKind::Direct, FieldTable::default()).await?;

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

    let args = queue_args(spec);
    if !spec.is_ordered() {
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
        return Ok(());
    }
    // Ordered: the subscription's bindings lead to a consistent-hash
    // exchange that sends each aggregate to one partition, always the same
    // while the partitions stay as they are.
    let hash = spec.partition_exchange();
    let mut hash_args = FieldTable::default();
    hash_args.insert(
        "hash-header".into(),
        AMQPValue::LongString(PARTITION_HEADER.into()),
    );
    durable_exchange(
        channel,
        &hash,
        ExchangeKind::Custom("x-consistent-hash".into()),
        hash_args,
    )
    .await
    .map_err(|e| {
        Error::Topology(format!(
            "cannot declare {hash}, an x-consistent-hash exchange (is the \
                 rabbitmq_consistent_hash_exchange plugin enabled?): {e}"
        ))
    })?;
    for key in &spec.bindings {
        channel
            .exchange_bind(
                hash.as_str().into(),
                spec.exchange.as_str().into(),
                key.as_str().into(),
                ExchangeBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    let mut args = args;
    // One consumer at a time takes a partition, in order; the others wait
    // as its standbys.
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    for p in 0..spec.partitions {
        let queue = spec.partition_queue(p);
        channel
            .queue_declare(queue.as_str().into(), durable, args.clone())
            .await?;
        // The binding key is the partition's weight on the hash ring.
        channel
            .queue_bind(
                queue.as_str().into(),
                hash.as_str().into(),
                "1".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// A consumer queue's arguments: quorum, its delivery limit, dead letters
/// to its own DLQ.
fn queue_args(spec: &QueueSpec) -> FieldTable {
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
        AMQPValue::LongString(dead_letter_exchange(&spec.exchange).as_str().into()),
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
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partitions_setting_names_ordered_subscriptions_only() {
        let ordered = Subscription::new("a.ordered", &["x.*"]).ordered(4);
        let free = Subscription::new("a.free", &["x.*"]);
        let k = |setting: &str, sub: &Subscription| partitions_override(setting, sub);
        assert_eq!(k("", &ordered).unwrap(), None);
        assert_eq!(k("a.ordered=8", &ordered).unwrap(), Some(8));
        assert_eq!(k(" other=2 , a.ordered = 16 ", &ordered).unwrap(), Some(16));
        assert_eq!(k("other=2", &ordered).unwrap(), None);
        assert!(k("a.free=8", &free).is_err());
        for bad in ["a.ordered", "a.ordered=0", "a.ordered=x", "a.ordered=5000"] {
            assert!(k(bad, &ordered).is_err(), "{bad}");
        }
    }
}
