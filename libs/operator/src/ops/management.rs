//! What `status` reads from RabbitMQ's management API, which AMQP does not
//! tell: unacked counts, and the bindings each subscriber needs held to
//! the broker's (issue 43): a queue that exists but is not bound to a
//! routing key of its subscription receives none of those events, and no
//! passive declare of the queue says so. An ordered subscription is bound
//! twice: the events exchange to its partitions' exchange, and that
//! exchange to each partition queue.

use reliability::broker::QueueSpec;
use serde::Deserialize;

use super::Estate;

#[derive(Debug, Deserialize)]
struct Binding {
    source: String,
    destination: String,
    #[serde(default)]
    routing_key: String,
}

/// GET `path` (its segments, escaped) of the management API, with the
/// URL's credentials as basic auth and a 3 s bound; None when it does not
/// answer, or answers with an error.
async fn get<T: serde::de::DeserializeOwned>(management_url: &str, path: &[&str]) -> Option<T> {
    let base = reqwest::Url::parse(management_url).ok()?;
    let mut url = base.clone();
    url.set_username("").ok()?;
    url.set_password(None).ok()?;
    url.path_segments_mut().ok()?.pop_if_empty().extend(path);
    let reply = reqwest::Client::new()
        .get(url)
        .basic_auth(base.username(), base.password())
        .timeout(std::time::Duration::from_secs(3))
        .send()
        .await
        .ok()?;
    reply.error_for_status().ok()?.json().await.ok()
}

/// Every binding the broker holds on the default virtual host.
async fn bindings(management_url: &str) -> Option<Vec<Binding>> {
    get(management_url, &["api", "bindings", "/"]).await
}

/// What the estate's subscriptions need bound and the broker does not
/// hold, one line each; None when the management API does not answer.
pub(super) async fn missing(estate: &Estate) -> Option<Vec<String>> {
    let held = bindings(estate.management_url.as_deref()?).await?;
    let has = |source: &str, destination: &str, key: Option<&str>| {
        held.iter().any(|b| {
            b.source == source
                && b.destination == destination
                && key.is_none_or(|k| b.routing_key == k)
        })
    };
    let mut missing = Vec::new();
    for sub in estate.subscriptions {
        let mut spec = QueueSpec::for_subscription(sub, &estate.exchange, &estate.queue_prefix);
        if let Ok(Some(k)) =
            reliability::broker::partitions_override(&estate.ordered_partitions, sub)
        {
            spec.partitions = k;
        }
        let target = if spec.is_ordered() {
            spec.partition_exchange()
        } else {
            spec.queue.clone()
        };
        for key in &spec.bindings {
            if !has(&estate.exchange, &target, Some(key)) {
                missing.push(format!(
                    "{}: {target} is not bound to `{key}` on {}: those events never reach it (reliability setup binds it again)",
                    sub.consumer, estate.exchange
                ));
            }
        }
        if spec.is_ordered() {
            for partition in spec.queues() {
                if !has(&target, &partition, None) {
                    missing.push(format!(
                        "{}: partition {partition} is not bound to {target}: the aggregates it hashes to never reach it (reliability setup binds it again)",
                        sub.consumer
                    ));
                }
            }
        }
    }
    Some(missing)
}

/// `messages_unacknowledged` from the management API, if it answers.
pub(super) async fn unacked(management_url: &str, queue: &str) -> Option<u64> {
    let body: serde_json::Value = get(management_url, &["api", "queues", "/", queue]).await?;
    body["messages_unacknowledged"].as_u64()
}
