//! The message a claimed row becomes: its envelope as the body, the
//! CloudEvents attributes and the partition key among its headers, and its
//! publish step's trace context when the row is traced.

use serde_json::Value;

use crate::Result;
use crate::broker::{self, Outgoing};
use crate::outbox::Envelope;
use crate::trace::{Kind, Span, TraceContext};

use super::{Claimed, Relay};

impl Relay {
    /// The message for `row`, and when the row is traced, the publish step
    /// whose `traceparent` the message carries instead of the enqueue's.
    pub(super) fn outgoing(&self, row: &Claimed) -> Result<(Outgoing, Option<Span>)> {
        let envelope = Envelope {
            id: row.id,
            source: self.config.source.clone(),
            tenant_id: row.tenant_id,
            aggregate_type: row.aggregate_type.clone(),
            aggregate_id: row.aggregate_id.clone(),
            event_type: row.event_type.clone(),
            event_version: row.event_version,
            occurred_at: row.occurred_at,
            payload: row.payload.clone(),
            aggregate_seq: row.aggregate_seq,
        };
        let mut headers = match &row.headers {
            Value::Object(map) => map.clone(),
            _ => Default::default(),
        };
        headers.extend(cloud_event_attributes(&envelope));
        // What an ordered subscription's partition is chosen by.
        headers.insert(
            broker::PARTITION_HEADER.to_owned(),
            Value::String(format!(
                "{}/{}",
                envelope.tenant_id,
                envelope.aggregate_key()
            )),
        );
        // The state rides on unchanged among the headers.
        let state = headers
            .get(crate::trace::STATE_HEADER)
            .and_then(Value::as_str);
        let parent = headers
            .get(crate::trace::HEADER)
            .and_then(Value::as_str)
            .and_then(|parent| TraceContext::parse_with_state(parent, state));
        let step = parent.map(|parent| {
            let mut step = Span::start(
                &self.config.source,
                format!("publish {}", row.event_type),
                Kind::Producer,
                Some(parent),
            );
            step.set("messaging.system", "rabbitmq");
            step.set("messaging.destination.name", self.config.exchange.clone());
            step.set("messaging.message.id", envelope.message_id());
            headers.insert(
                crate::trace::HEADER.to_owned(),
                Value::String(step.context().to_header()),
            );
            step
        });
        let message = Outgoing {
            routing_key: envelope.routing_key(),
            message_id: envelope.message_id(),
            kind: envelope.event_type.clone(),
            headers: broker::headers_from_json(&headers),
            body: serde_json::to_vec(&envelope)?,
        };
        Ok((message, step))
    }
}

/// The CloudEvents 1.0 attributes of `e` as `ce-` headers: the binary
/// content mode (the body is the envelope, `content-type` the AMQP
/// property), so any CloudEvents consumer can route and read it. `id` is
/// unique per source, as the spec asks; `tenantid` is an extension.
fn cloud_event_attributes(e: &Envelope) -> serde_json::Map<String, Value> {
    [
        ("ce-specversion", "1.0".to_owned()),
        ("ce-id", e.message_id()),
        ("ce-source", format!("/commerce/{}", e.source)),
        ("ce-type", e.event_type.clone()),
        ("ce-time", e.occurred_at.to_rfc3339()),
        (
            "ce-subject",
            format!("{}/{}", e.aggregate_type, e.aggregate_id),
        ),
        ("ce-dataversion", e.event_version.to_string()),
        ("ce-tenantid", e.tenant_id.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), Value::String(v)))
    .collect()
}
