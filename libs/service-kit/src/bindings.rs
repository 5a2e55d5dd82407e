//! A consumer's bindings held to the broker's (issue 43), through
//! RabbitMQ's management API, which tells what AMQP does not: a queue that
//! exists but lost a binding (an operator's slip, a broker restored from
//! old definitions) receives none of those events, while its lanes stay
//! connected and ready and no passive declare says so. AMQP cannot ask
//! whether a binding exists (a bind makes it). An ordered subscription is
//! bound twice: the events exchange to its partitions' exchange, and that
//! exchange to each partition queue.
//!
//! Each consumer of a process reads them every [`BINDINGS_EVERY`] where
//! `RABBITMQ_MANAGEMENT_URL` is set ([`watch`], for `/readyz`);
//! `reliability status` reads them for every subscription, and the queues'
//! unacked counts ([`unacked`]). Every call is bounded ([`BOUND`]); an API
//! that does not answer gives None, never an error: nothing is checked,
//! and nothing claimed.

use std::time::Duration;

use serde::Deserialize;

use reliability::broker::QueueSpec;
use reliability::health::Health;
use tokio_util::sync::CancellationToken;

/// The local broker's API, as `make up` and CI enable it, with its
/// credentials: where `reliability status` looks unless
/// `RABBITMQ_MANAGEMENT_URL` says otherwise.
pub const MANAGEMENT_URL: &str = "http://guest:guest@127.0.0.1:15672";

/// How long one call of the API may take.
pub const BOUND: Duration = Duration::from_secs(3);

/// One binding the broker holds.
#[derive(Debug, Clone, Deserialize)]
pub struct Binding {
    pub source: String,
    pub destination: String,
    #[serde(default)]
    pub routing_key: String,
}

/// GET `path` (its segments, escaped) of the API at `url`, the URL's
/// credentials sent as basic auth; None when it does not answer in
/// [`BOUND`], or answers with an error.
async fn get<T: serde::de::DeserializeOwned>(url: &str, path: &[&str]) -> Option<T> {
    let base = reqwest::Url::parse(url).ok()?;
    let mut target = base.clone();
    target.set_username("").ok()?;
    target.set_password(None).ok()?;
    target.path_segments_mut().ok()?.pop_if_empty().extend(path);
    let reply = reqwest::Client::new()
        .get(target)
        .basic_auth(base.username(), base.password())
        .timeout(BOUND)
        .send()
        .await
        .ok()?;
    reply.error_for_status().ok()?.json().await.ok()
}

/// Every binding the broker holds on the default virtual host.
pub async fn bindings(url: &str) -> Option<Vec<Binding>> {
    get(url, &["api", "bindings", "/"]).await
}

/// `messages_unacknowledged` of `queue` on the default virtual host.
pub async fn unacked(url: &str, queue: &str) -> Option<u64> {
    let body: serde_json::Value = get(url, &["api", "queues", "/", queue]).await?;
    body["messages_unacknowledged"].as_u64()
}

/// What `spec` needs bound and `held` lacks, one line each, naming the
/// binding and what it costs.
pub fn unbound(spec: &QueueSpec, held: &[Binding]) -> Vec<String> {
    let has = |source: &str, destination: &str, key: Option<&str>| {
        held.iter().any(|b| {
            b.source == source
                && b.destination == destination
                && key.is_none_or(|k| b.routing_key == k)
        })
    };
    let target = if spec.is_ordered() {
        spec.partition_exchange()
    } else {
        spec.queue.clone()
    };
    let mut missing = Vec::new();
    for key in &spec.bindings {
        if !has(&spec.exchange, &target, Some(key)) {
            missing.push(format!(
                "{target} is not bound to `{key}` on {}: those events never reach it",
                spec.exchange
            ));
        }
    }
    if spec.is_ordered() {
        for partition in spec.queues() {
            if !has(&target, &partition, None) {
                missing.push(format!(
                    "partition {partition} is not bound to {target}: the aggregates it hashes to never reach it"
                ));
            }
        }
    }
    missing
}

/// How often a consumer reads its bindings: one GET of the broker's
/// bindings per consumer per process, and a lost binding named within it.
pub const BINDINGS_EVERY: Duration = Duration::from_secs(30);

/// Until `stop`: every `every` (the first after one period, once the lanes
/// have declared the queue and bound it), the part `consumer <name>
/// bindings` of `health` is ready while the broker holds every binding of
/// `spec`, the queue of consumer `name`, and otherwise names each one
/// missing.
pub async fn watch(
    name: String,
    spec: QueueSpec,
    url: String,
    every: Duration,
    health: Health,
    stop: CancellationToken,
) {
    let part = format!("consumer {name} bindings");
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let Some(held) = bindings(&url).await else {
            continue;
        };
        let missing = unbound(&spec, &held);
        if missing.is_empty() {
            health.ready(&part);
        } else {
            let why = format!(
                "broker topology incomplete: {} (reliability setup binds it again)",
                missing.join("; ")
            );
            tracing::error!(consumer = %name, "{why}");
            health.not_ready(&part, why);
        }
    }
}
