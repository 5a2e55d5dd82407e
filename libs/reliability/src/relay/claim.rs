//! What a batch claims: the due rows (the polling relay), or the rows a
//! caller names, the ones a log of the outbox's commits has just shown it
//! (`libs/log-relay`, docs/adr/0038). Either way a row is claimed only
//! while unpublished and due, under `FOR UPDATE SKIP LOCKED`: a row
//! already published, or held by another relay, is not claimed again, so
//! naming it twice publishes it once.

use crate::Result;

use super::{Claimed, Relay, order};

/// The plain claim: the first due rows by id.
const DUE: &str = "
    SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
           payload, headers, occurred_at, aggregate_seq
    FROM outbox_messages
    WHERE processed_at IS NULL AND available_at <= now()
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED";

/// The named rows, by their primary key.
const NAMED: &str = "
    SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
           payload, headers, occurred_at, aggregate_seq
    FROM outbox_messages
    WHERE id = ANY($1) AND processed_at IS NULL AND available_at <= now()
    ORDER BY id
    FOR UPDATE SKIP LOCKED";

/// The named rows of a relay that keeps order: less those behind an
/// earlier pending row of their aggregate that is not due, as
/// [`order::CLAIM_IN_ORDER`].
const NAMED_IN_ORDER: &str = "
    SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
           payload, headers, occurred_at, aggregate_seq
    FROM outbox_messages o
    WHERE id = ANY($1) AND processed_at IS NULL AND available_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM outbox_messages e
          WHERE e.tenant_id = o.tenant_id AND e.aggregate_type = o.aggregate_type
            AND e.aggregate_id = o.aggregate_id AND e.id < o.id
            AND e.processed_at IS NULL AND e.available_at > now())
    ORDER BY id
    FOR UPDATE SKIP LOCKED";

impl Relay {
    /// Claims in `tx` the due rows, or `named` ones.
    pub(super) async fn claim(
        &self,
        tx: &mut sqlx::PgConnection,
        named: Option<&[i64]>,
    ) -> Result<Vec<Claimed>> {
        let in_order = self.keeps_order();
        let query = match (named, in_order) {
            (None, false) => sqlx::query_as(DUE).bind(self.config.batch_size),
            (None, true) => sqlx::query_as(order::CLAIM_IN_ORDER).bind(self.config.batch_size),
            (Some(ids), false) => sqlx::query_as(NAMED).bind(ids),
            (Some(ids), true) => sqlx::query_as(NAMED_IN_ORDER).bind(ids),
        };
        Ok(query.fetch_all(tx).await?)
    }
}
