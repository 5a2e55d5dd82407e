//! The relay's part of order per aggregate (docs/adr/0028): an event of an
//! aggregate is never published while an earlier one of the same aggregate
//! may still be, by this relay or another, and each is numbered in the
//! order of publication.
//!
//! Only a relay with an ordered subscriber does this; the others keep the
//! plain claim. Within a batch, rows go out in id order on one channel, so
//! the broker takes them in that order. Across batches and relays:
//! - a row behind an earlier pending row of its aggregate that is not due
//!   (backed off after a failure) is not claimed;
//! - a batch numbers its rows holding their aggregates' counter rows to
//!   its commit, after the confirms: a row whose counter another batch
//!   holds (this relay's window or another relay's) is held back, left
//!   claimed and unpublished until this batch commits, for a later pass.
//!
//! A late commit (a row that becomes visible after a later-id row of its
//! aggregate was published) is numbered after it: the numbers follow the
//! commits. Writers that change an aggregate under its row lock, as every
//! handler here does, commit its events in id order anyway.

use std::collections::HashMap;

use crate::Result;

use super::{Claimed, Relay};

impl Relay {
    /// Whether an ordered subscription may take this relay's events: one
    /// with a binding on its source (`<source>.…`, `*.…` or `#…`). Every
    /// relay declares every queue; only these pay for the order.
    pub(super) fn keeps_order(&self) -> bool {
        let source = self.config.source.as_str();
        self.config
            .topology
            .iter()
            .filter(|q| q.is_ordered())
            .flat_map(|q| &q.bindings)
            .any(|b| matches!(b.split('.').next(), Some(w) if w == source || w == "*" || w == "#"))
    }
}

/// Keeps of the claimed `rows` (in id order) those this batch may publish,
/// and numbers them in their aggregates; returns how many it held back.
///
/// A row is held back while an earlier row of its aggregate is pending
/// outside the batch (another batch has it in flight, or holds it back in
/// turn), or while another batch holds its aggregate: a batch takes each
/// aggregate it publishes with a transaction-scoped advisory lock, tried,
/// never waited on (a window's next batch must not wait for the one
/// before it to settle). Holding it, the batch reads and advances the
/// aggregate's counter; a row published before keeps its number.
pub(super) async fn number(tx: &mut sqlx::PgConnection, rows: &mut Vec<Claimed>) -> Result<usize> {
    type Key = (i64, String, String);
    let claimed: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let free: Vec<i64> = sqlx::query_scalar(
        "WITH batch AS (
             SELECT id, tenant_id, aggregate_type, aggregate_id FROM outbox_messages WHERE id = ANY($1)
         ), behind AS (
             SELECT c.id FROM batch c WHERE EXISTS (
                 SELECT 1 FROM outbox_messages e
                 WHERE e.tenant_id = c.tenant_id AND e.aggregate_type = c.aggregate_type
                   AND e.aggregate_id = c.aggregate_id AND e.id < c.id
                   AND e.processed_at IS NULL AND e.id <> ALL($1))
         ), keys AS (
             SELECT DISTINCT tenant_id, aggregate_type, aggregate_id
             FROM batch WHERE id NOT IN (SELECT id FROM behind)
         ), taken AS (
             SELECT * FROM keys
             WHERE pg_try_advisory_xact_lock(
                 hashtextextended('outbox_sequences/' || tenant_id || '/' || aggregate_type || ':' || aggregate_id, 0))
         )
         SELECT b.id FROM batch b JOIN taken USING (tenant_id, aggregate_type, aggregate_id)
         WHERE b.id NOT IN (SELECT id FROM behind)",
    )
    .bind(&claimed)
    .fetch_all(&mut *tx)
    .await?;
    let before = rows.len();
    rows.retain(|r| free.contains(&r.id));
    if rows.is_empty() {
        return Ok(before);
    }
    let mut keys: Vec<Key> = rows
        .iter()
        .map(|r| {
            (
                r.tenant_id,
                r.aggregate_type.clone(),
                r.aggregate_id.clone(),
            )
        })
        .collect();
    keys.sort();
    keys.dedup();
    let (tenants, types, ids) = split(&keys);
    // Read after the locks: the last holder of each has committed.
    let counters: Vec<(i64, String, String, i64)> = sqlx::query_as(
        "SELECT s.tenant_id, s.aggregate_type, s.aggregate_id, s.last_seq
         FROM outbox_sequences s
         JOIN unnest($1::bigint[], $2::text[], $3::text[]) AS k (tenant_id, aggregate_type, aggregate_id)
           USING (tenant_id, aggregate_type, aggregate_id)",
    )
    .bind(&tenants)
    .bind(&types)
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?;
    let mut last: HashMap<Key, i64> = keys.iter().map(|k| (k.clone(), 0)).collect();
    for (t, ty, id, seq) in counters {
        last.insert((t, ty, id), seq);
    }
    let (mut numbered, mut numbers) = (Vec::new(), Vec::new());
    for r in rows.iter_mut() {
        let at = last
            .get_mut(&(
                r.tenant_id,
                r.aggregate_type.clone(),
                r.aggregate_id.clone(),
            ))
            .expect("every kept row's aggregate is a key");
        match r.aggregate_seq {
            Some(seq) => *at = (*at).max(seq),
            None => {
                *at += 1;
                r.aggregate_seq = Some(*at);
                numbered.push(r.id);
                numbers.push(*at);
            }
        }
    }
    if !numbered.is_empty() {
        let lasts: Vec<i64> = keys.iter().map(|k| last[k]).collect();
        sqlx::query(
            "WITH numbered AS (
                 UPDATE outbox_messages o SET aggregate_seq = u.seq
                 FROM unnest($1::bigint[], $2::bigint[]) AS u (id, seq) WHERE o.id = u.id
             )
             INSERT INTO outbox_sequences (tenant_id, aggregate_type, aggregate_id, last_seq)
             SELECT * FROM unnest($3::bigint[], $4::text[], $5::text[], $6::bigint[])
             ON CONFLICT (tenant_id, aggregate_type, aggregate_id) DO UPDATE SET last_seq = EXCLUDED.last_seq",
        )
        .bind(&numbered)
        .bind(&numbers)
        .bind(&tenants)
        .bind(&types)
        .bind(&ids)
        .bind(&lasts)
        .execute(&mut *tx)
        .await?;
    }
    Ok(before - rows.len())
}

fn split(keys: &[(i64, String, String)]) -> (Vec<i64>, Vec<&str>, Vec<&str>) {
    (
        keys.iter().map(|k| k.0).collect(),
        keys.iter().map(|k| k.1.as_str()).collect(),
        keys.iter().map(|k| k.2.as_str()).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::QueueSpec;
    use crate::relay::RelayConfig;

    fn relay(source: &str, bindings: &[&str], partitions: u16) -> Relay {
        let mut spec = QueueSpec::new("q", "x", bindings);
        spec.partitions = partitions;
        let mut config = RelayConfig::new(source, "x");
        config.topology = vec![QueueSpec::new("free", "x", &["#"]), spec];
        let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1/none").unwrap();
        Relay::new(pool, "amqp://127.0.0.1", config)
    }

    #[tokio::test]
    async fn only_a_relay_whose_events_an_ordered_subscription_binds_keeps_order() {
        assert!(relay("orders", &["orders.OrderPlaced"], 4).keeps_order());
        assert!(relay("orders", &["*.OrderPlaced"], 4).keeps_order());
        assert!(relay("orders", &["#"], 4).keeps_order());
        assert!(!relay("payments", &["orders.*"], 4).keeps_order());
        assert!(!relay("orders", &["orders.*"], 0).keeps_order());
    }
}
