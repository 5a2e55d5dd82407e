//! RabbitMQ: connection, topology, the confirmed publisher, dead letters.
//!
//! Topology (docs/adr/0002): one durable topic exchange for events; per
//! consumer a durable quorum queue with an explicit delivery limit whose
//! dead letters go, through `<exchange>.dlx`, to its own `<queue>.dlq`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};

use crate::{Error, Result};

mod publish;
mod queues;
mod topology;

pub use publish::{Outgoing, PublishFailure, Publisher, Sent};
pub use queues::{inspect_queue, queue_depth, returns};
pub use topology::{
    PARTITION_HEADER, QueueSpec, Subscription, dead_letter_exchange, dead_letter_queue,
    declare_exchange, declare_queue, declare_topology, partitions_override, require_queues,
    topic_matches,
};

/// Connects with a name that shows in the management UI.
///
/// `url` may name every node of a cluster, comma-separated
/// (`amqp://a:5672/%2f,amqp://b:5672/%2f`): each is tried in turn until one
/// answers, starting from a different node on each call, so that replicas
/// spread over the cluster and a reconnect after a node dies finds a live
/// one within one pass (docs/adr/0023). Quorum queues are reachable from any
/// node; no node is special to us.
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    crate::db::use_one_crypto_provider();
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nodes: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    if nodes.is_empty() {
        return Err(Error::Config("AMQP_URL: empty".into()));
    }
    let first = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut last = None;
    for i in 0..nodes.len() {
        let node = nodes[(first + i) % nodes.len()];
        let props = ConnectionProperties::default().with_connection_name(LongString::from(name));
        let mut uri: lapin::uri::AMQPUri = node
            .parse()
            .map_err(|e| Error::Config(format!("AMQP_URL: {e}")))?;
        uri.query.heartbeat.get_or_insert(HEARTBEAT_SECS);
        match bounded(Connection::connect_uri(uri, props)).await {
            Ok(conn) => return Ok(conn),
            Err(e) => {
                if nodes.len() > 1 {
                    tracing::warn!(node = %redact(node), error = %e, "broker node did not answer; trying the next");
                }
                last = Some(e);
            }
        }
    }
    Err(last.expect("at least one node was tried"))
}

/// A node's URL without its password, for logs.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…{}", &url[..scheme], &url[at..]),
        _ => url.to_owned(),
    }
}

/// The AMQP heartbeat we ask for unless the URL names one (`?heartbeat=N`).
/// A peer silent for about two intervals is dead to the broker: a consumer
/// frozen (SIGSTOP, a paused VM) or cut off gives its unacked deliveries
/// back to its twins within ~30 s, instead of the broker's 60 s default
/// (docs/adr/0022).
pub const HEARTBEAT_SECS: u16 = 15;

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

/// Runs lapin calls as its connection wants them: each is polled once, in
/// order, which hands its frames to the connection's I/O thread, and only
/// then are they awaited together, their outputs in order.
///
/// Awaiting each in turn costs a round trip through that thread per call (a
/// wake of it, then one of this task): about 20 µs of CPU a message, most of
/// what lapin cost the relay (docs/benchmarks.md, session 43). lapin queues
/// a call's frames before its first await, so the order of first polls is
/// the order on the wire: delivery tags, and an aggregate's events, keep it.
pub async fn in_order<F: Future>(calls: Vec<F>) -> Vec<F::Output> {
    enum Call<F: Future> {
        Done(F::Output),
        Sent(std::pin::Pin<Box<F>>),
    }
    let mut started = Vec::with_capacity(calls.len());
    for call in calls {
        let mut call = Box::pin(call);
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(call.as_mut().poll(cx))).await;
        started.push(match first {
            std::task::Poll::Ready(output) => Call::Done(output),
            std::task::Poll::Pending => Call::Sent(call),
        });
    }
    futures_util::future::join_all(started.into_iter().map(|call| async move {
        match call {
            Call::Done(output) => output,
            Call::Sent(call) => call.await,
        }
    }))
    .await
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::{in_order, topic_matches};

    /// Every call is started, in order, before any is awaited to its end:
    /// the first call here ends only once the last has started, which
    /// awaiting each in turn would never reach.
    #[tokio::test]
    async fn in_order_starts_every_call_in_turn_before_awaiting_any() {
        let started = Arc::new(Mutex::new(Vec::new()));
        let last_started = Arc::new(tokio::sync::Notify::new());
        let calls: Vec<_> = (0..5)
            .map(|i| {
                let (started, last_started) = (started.clone(), last_started.clone());
                async move {
                    started.lock().unwrap().push(i);
                    match i {
                        0 => last_started.notified().await,
                        4 => last_started.notify_one(),
                        _ => tokio::task::yield_now().await,
                    }
                    i
                }
            })
            .collect();
        let outputs = tokio::time::timeout(std::time::Duration::from_secs(5), in_order(calls))
            .await
            .expect("a call was awaited to its end before the next one started");
        assert_eq!(outputs, [0, 1, 2, 3, 4]);
        assert_eq!(*started.lock().unwrap(), [0, 1, 2, 3, 4]);
    }

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
