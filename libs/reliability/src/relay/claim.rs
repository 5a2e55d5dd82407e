//! What a batch claims: the due rows (the polling relay), or the rows a
//! caller names, the ones a log of the outbox's commits has just shown it
//! (`libs/log-relay`, docs/adr/0038). Either way a row is claimed only
//! while unpublished and due, under `FOR UPDATE SKIP LOCKED`: a row
//! already published, or held by another relay, is not claimed again, so
//! naming it twice publishes it once.

use crate::Result;

use super::{Claimed, Relay};

// The four claims, from their parts: one text for each condition.
macro_rules! rows {
    () => {
        "SELECT id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                payload, headers, occurred_at, aggregate_seq
         FROM outbox_messages o
         WHERE processed_at IS NULL AND available_at <= now()"
    };
}
// A relay that keeps order (docs/adr/0028) leaves a row behind an earlier
// pending row of its aggregate that is not due (backed off).
macro_rules! in_order {
    () => {
        " AND NOT EXISTS (
              SELECT 1 FROM outbox_messages e
              WHERE e.tenant_id = o.tenant_id AND e.aggregate_type = o.aggregate_type
                AND e.aggregate_id = o.aggregate_id AND e.id < o.id
                AND e.processed_at IS NULL AND e.available_at > now())"
    };
}
macro_rules! first_due {
    () => {
        " ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
    };
}
macro_rules! named {
    () => {
        " AND id = ANY($1) ORDER BY id FOR UPDATE SKIP LOCKED"
    };
}

const DUE: &str = concat!(rows!(), first_due!());
const DUE_IN_ORDER: &str = concat!(rows!(), in_order!(), first_due!());
const NAMED: &str = concat!(rows!(), named!());
const NAMED_IN_ORDER: &str = concat!(rows!(), in_order!(), named!());

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
            (None, true) => sqlx::query_as(DUE_IN_ORDER).bind(self.config.batch_size),
            (Some(ids), false) => sqlx::query_as(NAMED).bind(ids),
            (Some(ids), true) => sqlx::query_as(NAMED_IN_ORDER).bind(ids),
        };
        Ok(query.fetch_all(tx).await?)
    }
}
