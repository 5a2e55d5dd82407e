//! What `status` reads from RabbitMQ's management API
//! ([`service_kit::bindings`]): unacked counts, and the bindings
//! of every subscription of the estate held to the broker's (issue 43).

use reliability::broker::QueueSpec;
use service_kit::bindings as management;

use super::Estate;

pub(super) use management::unacked;

/// What the estate's subscriptions need bound and the broker does not
/// hold, one line each; None when the management API does not answer.
pub(super) async fn missing(estate: &Estate) -> Option<Vec<String>> {
    let held = management::bindings(estate.management_url.as_deref()?).await?;
    let mut missing = Vec::new();
    for sub in estate.subscriptions {
        let mut spec = QueueSpec::for_subscription(sub, &estate.exchange, &estate.queue_prefix);
        if let Ok(Some(k)) =
            reliability::broker::partitions_override(&estate.ordered_partitions, sub)
        {
            spec.partitions = k;
        }
        missing.extend(management::unbound(&spec, &held).into_iter().map(|line| {
            format!(
                "{}: {line} (reliability setup binds it again)",
                sub.consumer
            )
        }));
    }
    Some(missing)
}
