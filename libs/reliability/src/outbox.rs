//! The transactional outbox (invariant I1): an event is a row written in the
//! same transaction as the state change it announces, and [`Envelope`] is what
//! the relay puts on the wire for it.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::trace::{Kind, Span};
use crate::{Result, TenantTx};

/// An event to publish once the caller's transaction commits.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub payload: Value,
    /// Sent as AMQP headers: the W3C `traceparent`, for one.
    pub headers: serde_json::Map<String, Value>,
}

impl NewEvent {
    /// `event` about `aggregate_type` `aggregate_id`, under its contract's
    /// type and version (so the two cannot disagree with the payload).
    pub fn of<T: contracts::Event>(
        aggregate_type: impl Into<String>,
        aggregate_id: impl ToString,
        event: &T,
    ) -> Result<Self> {
        Ok(Self::new(aggregate_type, aggregate_id, T::TYPE, event)?.version(T::VERSION))
    }

    /// An event by type name, version 1: for a payload outside the
    /// contracts; prefer [`NewEvent::of`].
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl ToString,
        event_type: impl Into<String>,
        payload: &impl Serialize,
    ) -> Result<Self> {
        Ok(Self {
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.to_string(),
            event_type: event_type.into(),
            event_version: 1,
            payload: serde_json::to_value(payload)?,
            headers: serde_json::Map::new(),
        })
    }

    pub fn version(mut self, version: i32) -> Self {
        self.event_version = version;
        self
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers
            .insert(name.to_owned(), Value::String(value.into()));
        self
    }
}

/// Writes `event` inside the caller's transaction; returns its outbox id.
/// The tenant is the transaction's own, so it cannot be mislabelled.
///
/// Inside a trace scope (an HTTP request, a consumed event) the event gets
/// the `traceparent` of an enqueue step of that trace, unless it already
/// has one.
pub async fn enqueue(tx: &mut TenantTx, event: &NewEvent) -> Result<i64> {
    let tenant = tx.tenant().get();
    let mut headers = event.headers.clone();
    if !headers.contains_key(crate::trace::HEADER)
        && let Some(mut span) = Span::child(format!("enqueue {}", event.event_type), Kind::Producer)
    {
        span.set("tenant.id", tenant);
        span.set(
            "event.aggregate",
            format!("{}/{}", event.aggregate_type, event.aggregate_id),
        );
        let ctx = span.context();
        headers.insert(
            crate::trace::HEADER.to_owned(),
            Value::String(ctx.to_header()),
        );
        if let Some(state) = ctx.state() {
            headers.insert(
                crate::trace::STATE_HEADER.to_owned(),
                Value::String(state.to_owned()),
            );
        }
    }
    let id = sqlx::query_scalar(
        "INSERT INTO outbox_messages
             (tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         RETURNING id",
    )
    .bind(tenant)
    .bind(&event.aggregate_type)
    .bind(&event.aggregate_id)
    .bind(&event.event_type)
    .bind(event.event_version)
    .bind(&event.payload)
    .bind(Value::Object(headers))
    .fetch_one(&mut **tx)
    .await?;
    Ok(id)
}

/// The message body on the wire. `(source, id)` identifies a message across
/// the system: consumers deduplicate on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Envelope {
    pub id: i64,
    pub source: String,
    pub tenant_id: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub occurred_at: DateTime<Utc>,
    pub payload: Value,
    /// The event's number in its aggregate (1, 2, ...), given by a relay
    /// with an ordered subscriber as it publishes: what an ordered consumer
    /// checks (docs/adr/0028). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[sqlx(default)]
    pub aggregate_seq: Option<i64>,
}

impl Envelope {
    /// `<aggregate_type>:<aggregate_id>`: the unit of order and of parking.
    pub fn aggregate_key(&self) -> String {
        format!("{}:{}", self.aggregate_type, self.aggregate_id)
    }

    /// `<source>.<EventType>`, the topic routing key.
    pub fn routing_key(&self) -> String {
        routing_key(&self.source, &self.event_type)
    }

    /// The AMQP `message_id`: unique across sources.
    pub fn message_id(&self) -> String {
        format!("{}:{}", self.source, self.id)
    }

    /// Decodes the payload into an event type of the caller's, unchecked
    /// (a type outside the contracts, as a generated service's own event).
    pub fn payload_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.payload)
    }

    /// The payload as event `T`. A message of another type, of a version
    /// this build does not read, or whose payload does not fit, is a
    /// permanent failure (a handler's `?` makes it
    /// `consumer::HandlerError::Decode`): dead-lettered, never retried.
    pub fn decode<T: contracts::Event>(&self) -> Result<T, contracts::DecodeError> {
        contracts::decode(&self.event_type, self.event_version, &self.payload)
    }

    /// The message as whichever contract event it is, for a handler to
    /// match on; refused like [`Envelope::decode`], and so is a type no
    /// contract names.
    pub fn event(&self) -> Result<contracts::AnyEvent, contracts::DecodeError> {
        contracts::AnyEvent::decode(&self.event_type, self.event_version, &self.payload)
    }
}

pub fn routing_key(source: &str, event_type: &str) -> String {
    format!("{source}.{event_type}")
}

/// The sources a rebuild replays (`--rebuild-from`): each `name=owner-url`
/// as a small pool on that service's database as its owner role, the only
/// one that reads the archive.
pub async fn history_sources(items: &[String]) -> Result<Vec<(String, sqlx::PgPool)>> {
    let mut sources = Vec::with_capacity(items.len());
    for item in items {
        let (name, url) = item
            .split_once('=')
            .ok_or_else(|| crate::Error::Config(format!("expected name=url, got `{item}`")))?;
        let options: sqlx::postgres::PgConnectOptions = url
            .parse()
            .map_err(|e| crate::Error::Config(format!("{name}'s URL: {e}")))?;
        sources.push((name.to_owned(), crate::db::pool(options, 2).await?));
    }
    Ok(sources)
}

/// A page of `source`'s event history (the outbox and its archive) after
/// outbox id `after`, as the relay publishes it: the source a projection is
/// rebuilt from. Read as the owner role; rows still unpublished are
/// included (consumers deduplicate), rows past the archive's retention are gone.
pub async fn history(
    owner: &sqlx::PgPool,
    source: &str,
    after: i64,
    limit: i64,
) -> Result<Vec<Envelope>> {
    Ok(sqlx::query_as(
        "SELECT id, $3::text AS source, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                occurred_at, payload, aggregate_seq
         FROM (SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, occurred_at, payload,
                      aggregate_seq
               FROM outbox_messages WHERE id > $1
               UNION ALL
               SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, occurred_at, payload,
                      aggregate_seq
               FROM outbox_messages_archive WHERE id > $1) h
         ORDER BY id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .bind(source)
    .fetch_all(owner)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::HandlerError;

    fn envelope(event_type: &str, version: i32, payload: Value) -> Envelope {
        Envelope {
            id: 1,
            source: "orders".into(),
            tenant_id: 1,
            aggregate_type: "order".into(),
            aggregate_id: "7".into(),
            event_type: event_type.into(),
            event_version: version,
            occurred_at: Utc::now(),
            payload,
            aggregate_seq: None,
        }
    }

    #[test]
    fn decoding_refuses_another_type_another_version_or_a_payload_that_does_not_fit() {
        let payload = serde_json::json!({"order_id": 7});
        let ok: contracts::OrderConfirmed = envelope("OrderConfirmed", 1, payload.clone())
            .decode()
            .unwrap();
        assert_eq!(ok.order_id, 7);
        let refused = [
            envelope("OrderConfirmed", 2, payload.clone()).decode::<contracts::OrderConfirmed>(),
            envelope("OrderPlaced", 1, payload.clone()).decode::<contracts::OrderConfirmed>(),
            envelope("OrderConfirmed", 1, serde_json::json!({}))
                .decode::<contracts::OrderConfirmed>(),
        ];
        for r in refused {
            // What a handler's `?` makes of it.
            let r = r.map_err(HandlerError::from);
            assert!(matches!(r, Err(HandlerError::Decode(_))), "{r:?}");
            assert!(r.unwrap_err().is_permanent());
        }
        assert_eq!(
            envelope("OrderConfirmed", 1, payload.clone())
                .event()
                .unwrap(),
            contracts::AnyEvent::OrderConfirmed(contracts::OrderConfirmed { order_id: 7 })
        );
        for r in [
            envelope("OrderConfirmed", 2, payload.clone()).event(),
            envelope("NoSuchEvent", 1, payload).event(),
        ] {
            let r = r.map_err(HandlerError::from);
            assert!(matches!(r, Err(HandlerError::Decode(_))), "{r:?}");
        }
    }
}
