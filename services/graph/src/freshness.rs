//! How fresh an answer is: `as_of`, per source, the highest message of the
//! tenant's that the graph has applied, when it happened and when it was
//! applied; and `lag_seconds`, how far behind its source the graph was at
//! its last apply from each (the largest). Read from the watermarks the
//! applying statement keeps (`apply.rs`), in a read-only statement of the
//! answer's tenant.
//!
//! What they do not say: a message id is the source's outbox id, so a late
//! commit (a lower id applied after a higher one) leaves the watermark
//! where it was; and a consumer that stopped applying keeps its last lag.
//! The consumer's `consumer_event_age_seconds` and its alert say that.

use std::collections::BTreeMap;

use reliability::TenantId;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::Error;
use crate::store::{Cypher, Params, Store};

pub const WATERMARKS: Cypher = Cypher(
    "MATCH (w:Watermark {tenant: $tenant})
     RETURN w.source AS source, w.message AS message_id, w.occurred_at AS occurred_at,
            w.applied_at AS applied_at_ms",
);

/// An answer's freshness, beside its body.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default)]
pub struct Freshness {
    /// Per source (`orders`, `inventory`, `payments`): the newest of the
    /// tenant's events applied. Empty before the first.
    pub as_of: BTreeMap<String, Position>,
    /// How far behind its source the graph was at its last apply from
    /// each, the largest: the applied time less the event's own. Null
    /// before the first.
    pub lag_seconds: Option<f64>,
}

/// A source's newest event in the graph.
#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Position {
    /// The source's outbox id of it.
    pub message_id: i64,
    /// When it happened (its outbox row's commit, RFC 3339).
    pub occurred_at: Option<String>,
    /// When the graph applied an event of the source last (RFC 3339).
    pub applied_at: Option<String>,
}

/// The tenant's freshness, read now.
pub async fn read(store: &Store, tenant: TenantId) -> Result<Freshness, Error> {
    let rows = store.read(tenant, WATERMARKS, Params::new()).await?;
    let mut fresh = Freshness::default();
    for row in rows {
        let (Some(source), Some(message_id)) = (
            row.get("source").and_then(Value::as_str),
            row.get("message_id").and_then(Value::as_i64),
        ) else {
            continue;
        };
        let occurred = row
            .get("occurred_at")
            .and_then(Value::as_str)
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok());
        let applied = row
            .get("applied_at_ms")
            .and_then(Value::as_i64)
            .and_then(chrono::DateTime::from_timestamp_millis);
        if let (Some(occurred), Some(applied)) = (occurred, applied) {
            let lag = (applied - occurred.to_utc()).num_milliseconds().max(0) as f64 / 1000.0;
            fresh.lag_seconds = Some(fresh.lag_seconds.map_or(lag, |l: f64| l.max(lag)));
        }
        fresh.as_of.insert(
            source.to_owned(),
            Position {
                message_id,
                occurred_at: occurred.map(|t| t.to_rfc3339()),
                applied_at: applied.map(|t| t.to_rfc3339()),
            },
        );
    }
    Ok(fresh)
}
