//! The confirmed publisher: mandatory publishes in a sliding window,
//! returns matched by message id, each message's confirm as its own result.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionStatus, PublisherConfirm,
};

use crate::Result;
use crate::failpoint::{self, FailPoints};

use super::{QueueSpec, bounded, declare_exchange, declare_topology, require_queues};

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
    /// The broker refused this message for what it is: no queue is bound
    /// for its routing key. Retrying it may never help, so it counts toward
    /// the DLQ. A nack says the queue could not take it (a quorum queue that
    /// lost its majority, a full queue), a timeout or a lost connection says
    /// nothing (a blocked or unreachable broker): none is the message's
    /// fault, so none costs an attempt (docs/adr/0013, 0023).
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::Unroutable(_))
    }
}

/// A channel in confirm mode publishing to one exchange.
pub struct Publisher {
    channel: Channel,
    connection: ConnectionStatus,
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
            connection: connection.status().clone(),
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

    /// The broker blocked this connection (a memory or disk alarm). lapin
    /// then writes nothing on it, not even a close, until the broker
    /// unblocks it; what was queued in it goes out at that moment. So a
    /// blocked connection is waited on, never dropped for a new one
    /// (docs/adr/0025).
    pub fn is_blocked(&self) -> bool {
        self.connection.blocked()
    }

    /// The connection is still up (blocked or not).
    pub fn is_connected(&self) -> bool {
        self.connection.connected()
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
        // Collected before they are awaited: a lazy iterator of them held
        // across an await is not `Send` to the compiler.
        let publishes: Vec<_> = messages
            .iter()
            .map(|m| async move {
                // Blocked, or out of time: queue nothing more in lapin, where it
                // would go out when the broker unblocks, long after its row was
                // released and claimed again.
                if self.is_blocked() || tokio::time::Instant::now() >= deadline {
                    return Err(PublishFailure::Timeout(self.confirm_timeout));
                }
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
                    Ok(Ok(confirm)) => Ok(confirm),
                    Ok(Err(e)) => Err(PublishFailure::Broker(e.to_string())),
                    Err(_) => Err(PublishFailure::Timeout(self.confirm_timeout)),
                }
            })
            .collect();
        let pending = super::in_order(publishes).await;
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
