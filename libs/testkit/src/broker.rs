//! A broker connection with a fresh exchange for one test, and the looks a
//! test takes at its queues.

use std::collections::HashMap;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use reliability::broker;
use reliability::outbox::Envelope;

use super::{amqp_url, unique};

/// A broker connection and a fresh exchange name for one test.
pub struct Broker {
    pub conn: Connection,
    pub channel: Channel,
    pub exchange: String,
}

impl Broker {
    pub async fn new() -> Self {
        let conn = broker::connect(&amqp_url(), "reliability-tests")
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        let exchange = unique("reltest.events.");
        broker::declare_exchange(&channel, &exchange).await.unwrap();
        Self {
            conn,
            channel,
            exchange,
        }
    }

    /// A queue bound to every routing key of the exchange, as a consumer would declare it.
    pub async fn queue(&self, bindings: &[&str]) -> String {
        let name = unique("reltest.q.");
        let spec = broker::QueueSpec::new(&name, &self.exchange, bindings);
        broker::declare_queue(&self.channel, &spec).await.unwrap();
        name
    }

    /// Takes (and acks) every ready message of `queue`.
    pub async fn take_all(&self, queue: &str) -> Vec<Envelope> {
        let mut out = Vec::new();
        while let Some(msg) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            out.push(serde_json::from_slice(&msg.delivery.data).unwrap());
            msg.delivery
                .ack(BasicAckOptions { multiple: false })
                .await
                .unwrap();
        }
        out
    }

    /// The string headers of the next message on `queue` (acked).
    pub async fn take_headers(&self, queue: &str) -> HashMap<String, String> {
        let msg = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("a message");
        msg.delivery
            .ack(BasicAckOptions { multiple: false })
            .await
            .unwrap();
        let table = msg
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        table
            .inner()
            .keys()
            .filter_map(|k| {
                let v = broker::header_str(&msg.delivery.properties, k.as_str())?;
                Some((k.as_str().to_owned(), v))
            })
            .collect()
    }

    pub async fn depth(&self, queue: &str) -> u32 {
        broker::queue_depth(&self.channel, queue).await.unwrap()
    }

    /// Publishes raw bytes straight onto `queue` (default exchange), confirmed.
    pub async fn publish_to_queue(&self, queue: &str, body: &[u8]) {
        self.publish_with(queue, body, BasicProperties::default())
            .await;
    }

    /// [`Broker::publish_to_queue`] with the message's properties.
    pub async fn publish_with(&self, queue: &str, body: &[u8], properties: BasicProperties) {
        let ch = self.conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions { nowait: false })
            .await
            .unwrap();
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
        let _ = ch.close(200, "published".into()).await;
    }

    /// Puts `letters` (message id, event type), in that order, in the
    /// dead-letter queue of `queue`, each with its id as its body; returns
    /// that queue's name.
    pub async fn dead_letters(&self, queue: &str, letters: &[(&str, &str)]) -> String {
        let dlq = broker::dead_letter_queue(queue);
        for (id, kind) in letters {
            let properties = BasicProperties::default()
                .with_message_id((*id).into())
                .with_type((*kind).into());
            self.publish_with(&dlq, id.as_bytes(), properties).await;
        }
        dlq
    }

    /// Deletes an ordered subscription's partition queues, DLQ and hash
    /// exchange, then the rest as [`Broker::cleanup`].
    pub async fn cleanup_ordered(self, spec: &broker::QueueSpec) {
        self.delete_ordered(spec).await;
        self.cleanup(&[&spec.queue]).await;
    }

    /// Deletes an ordered subscription's partition queues, DLQ and hash
    /// exchange, leaving the test's exchange.
    pub async fn delete_ordered(&self, spec: &broker::QueueSpec) {
        use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        let dlq = broker::dead_letter_queue(&spec.queue);
        for q in spec.queues().into_iter().chain([dlq]) {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .exchange_delete(
                spec.partition_exchange().as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }

    /// Deletes the test's queues (and their DLQs) and exchange.
    pub async fn cleanup(self, queues: &[&str]) {
        use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        for q in queues {
            for name in [q.to_string(), broker::dead_letter_queue(q)] {
                let _ = self
                    .channel
                    .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let dlx = broker::dead_letter_exchange(&self.exchange);
        let _ = self
            .channel
            .exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
}
