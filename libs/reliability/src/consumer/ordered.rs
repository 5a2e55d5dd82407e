//! An ordered subscription's gate (docs/adr/0028): inside the apply's
//! transaction, under the aggregate's lock, each fresh event is applied,
//! or parked behind its aggregate's parked events, or parks its aggregate
//! because it came out of order; the positions advance with the commit.

use std::collections::{HashMap, HashSet};

use crate::TenantTx;
use crate::outbox::Envelope;

use super::{Apply, ApplyError, Consumer, Handler, Lane, Pg};

/// What the gate decided for one fresh event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Gate {
    Apply,
    /// Into the parked store: behind its parked aggregate (None), or as
    /// the first event of a newly parked one (the reason).
    Park(Option<String>),
}

/// `(source, aggregate_type, aggregate_id)`: the unit of order.
type Key = (String, String, String);

fn key(e: &Envelope) -> Key {
    (
        e.source.clone(),
        e.aggregate_type.clone(),
        e.aggregate_id.clone(),
    )
}

/// The record-and-gate statement of [`Consumer::record_gated`]: `$1`
/// tenant, `$2` consumer, `$3` sources, `$4` ids, `$5` stripe, `$6`
/// aggregate types, `$7` aggregate ids, `$8` sequence numbers.
pub(super) const GATE_SQL: &str = concat!(
    "WITH seen AS (
             SELECT * FROM unnest($3::text[], $4::bigint[], $6::text[], $7::text[], $8::bigint[])
                 WITH ORDINALITY AS s (source, message_id, aggregate_type, aggregate_id, seq, pos)
         ), fresh AS (
             INSERT INTO processed_messages (tenant_id, consumer, source, message_id)
             SELECT DISTINCT $1::bigint, $2::text, source, message_id FROM seen
             ORDER BY source, message_id
             ON CONFLICT DO NOTHING
             RETURNING source, message_id
         ), ",
    super::apply::offsets_ctes!(),
    ", ev AS (
             SELECT DISTINCT ON (s.source, s.message_id) s.*
             FROM seen s JOIN fresh f USING (source, message_id)
             ORDER BY s.source, s.message_id, s.pos
         ), state AS (
             -- A look-up per aggregate on the whole key, never a join:
             -- on tables not analyzed yet (a new deployment) the
             -- planner joined by a scan of all the tenant's positions,
             -- a cost growing with its aggregates (docs/adr/0028).
             SELECT k.*,
                    (SELECT p.last_seq FROM aggregate_positions p
                     WHERE p.tenant_id = $1 AND p.consumer = $2 AND p.source = k.source
                       AND p.aggregate_type = k.aggregate_type
                       AND p.aggregate_id = k.aggregate_id) AS last_seq,
                    EXISTS (SELECT FROM parked_aggregates a
                            WHERE a.tenant_id = $1 AND a.consumer = $2 AND a.source = k.source
                              AND a.aggregate_type = k.aggregate_type
                              AND a.aggregate_id = k.aggregate_id) AS parked
             FROM (SELECT DISTINCT source, aggregate_type, aggregate_id FROM ev) k
         ), checked AS (
             SELECT s.source, s.aggregate_type, s.aggregate_id, s.last_seq, s.parked,
                    bool_and(e.seq IS NULL OR e.seq > COALESCE(GREATEST(s.last_seq, e.before), 0)) AS in_order,
                    max(e.seq) AS top
             FROM state s
             JOIN (SELECT ev.*, max(seq) OVER (PARTITION BY source, aggregate_type, aggregate_id ORDER BY pos
                                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
                   FROM ev) e USING (source, aggregate_type, aggregate_id)
             GROUP BY 1, 2, 3, 4, 5
         ), advanced AS (
             INSERT INTO aggregate_positions (tenant_id, consumer, source, aggregate_type, aggregate_id, last_seq)
             SELECT $1, $2, source, aggregate_type, aggregate_id, top FROM checked
             WHERE NOT parked AND in_order AND top IS NOT NULL
             ORDER BY source, aggregate_type, aggregate_id
             ON CONFLICT (tenant_id, consumer, source, aggregate_type, aggregate_id) DO UPDATE
             SET last_seq = GREATEST(aggregate_positions.last_seq, EXCLUDED.last_seq), updated_at = now()
         )
         SELECT e.source, e.message_id, c.aggregate_type, c.aggregate_id, c.last_seq, c.parked, c.in_order
         FROM ev e JOIN checked c USING (source, aggregate_type, aggregate_id)"
);

impl<A: Apply> Consumer<A> {
    pub(super) fn is_ordered(&self) -> bool {
        self.config.queue.is_ordered()
    }

    /// The queues lane `index` consumes from: the queue, or for an ordered
    /// subscription the partitions `p` with `p % lanes == index` (every
    /// partition for some lane; a lane beyond the partitions stands by on
    /// one). Each partition has one active consumer; the same lane of the
    /// other replicas waits as its standby.
    pub(super) fn lane_queues(&self, index: usize) -> Vec<String> {
        let spec = &self.config.queue;
        if !spec.is_ordered() {
            return vec![spec.queue.clone()];
        }
        let lanes = self.config.lanes.max(1);
        let k = usize::from(spec.partitions);
        if index >= k {
            return vec![spec.partition_queue((index % k) as u16)];
        }
        (0..k)
            .filter(|p| p % lanes == index)
            .map(|p| spec.partition_queue(p as u16))
            .collect()
    }
}

impl<H: Handler> Consumer<Pg<H>> {
    /// One statement for one tenant's `events` on an ordered subscription:
    /// the dedup records and the lane's progress (as the order-free record
    /// does), and the gate for the fresh ones. The transaction has held
    /// every aggregate's lock since it began ([`TenantTx::begin_locked`]),
    /// so this statement's snapshot sees every earlier applier's commit.
    /// The gate reads each aggregate's position and whether it is parked,
    /// and advances the position of an aggregate whose fresh events here
    /// are all in order and which is not parked (the common case). Only an
    /// aggregate with an event out of order costs more: its events are
    /// decided one by one, and those applied advance it in a statement of
    /// their own.
    ///
    /// Returns, for each event in order, `None` if it is a duplicate (in
    /// the store, or earlier in `events`), else its gate; the positions are
    /// advanced for those to apply (a failed handler rolls that back with
    /// the rest).
    pub(super) async fn record_gated(
        &self,
        tx: &mut TenantTx,
        events: &[&Envelope],
        lane: Lane,
    ) -> Result<Vec<Option<Gate>>, ApplyError> {
        let sources: Vec<&str> = events.iter().map(|e| e.source.as_str()).collect();
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        let types: Vec<&str> = events.iter().map(|e| e.aggregate_type.as_str()).collect();
        let aggregates: Vec<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
        let seqs: Vec<Option<i64>> = events.iter().map(|e| e.aggregate_seq).collect();
        type Row = (String, i64, String, String, Option<i64>, bool, bool);
        let rows: Vec<Row> = sqlx::query_as(GATE_SQL)
            .bind(tx.tenant().get())
            .bind(&self.config.name)
            .bind(&sources)
            .bind(&ids)
            .bind(lane.stripe)
            .bind(&types)
            .bind(&aggregates)
            .bind(&seqs)
            .fetch_all(&mut **tx)
            .await?;
        let mut fresh: HashSet<(String, i64)> = HashSet::with_capacity(rows.len());
        let mut state: HashMap<Key, (Option<i64>, bool, bool)> = HashMap::new();
        for (source, id, t, aggregate, last, parked, in_order) in rows {
            fresh.insert((source.clone(), id));
            state.insert((source, t, aggregate), (last, parked, in_order));
        }
        let mut gates = Vec::with_capacity(events.len());
        let mut late_applied = Vec::new();
        for e in events {
            if !fresh.remove(&(e.source.clone(), e.id)) {
                gates.push(None);
                continue;
            }
            let (last, parked, in_order) = state.entry(key(e)).or_insert((None, false, true));
            let gate = if *parked {
                Gate::Park(None)
            } else if *in_order {
                Gate::Apply
            } else if let (Some(seq), Some(at)) = (e.aggregate_seq, *last)
                && seq <= at
            {
                *parked = true;
                Gate::Park(Some(format!(
                    "out of order: event {} of {} arrived after event {at} was applied",
                    seq,
                    e.aggregate_key()
                )))
            } else {
                if let Some(seq) = e.aggregate_seq {
                    *last = Some(seq);
                }
                late_applied.push(*e);
                Gate::Apply
            };
            gates.push(Some(gate));
        }
        // The rare case: the statement advanced none of these.
        self.advance(tx, &late_applied).await?;
        Ok(gates)
    }

    /// Advances the positions of the `applied` events' aggregates.
    pub(super) async fn advance(
        &self,
        tx: &mut TenantTx,
        applied: &[&Envelope],
    ) -> Result<(), ApplyError> {
        let mut top: HashMap<Key, i64> = HashMap::new();
        for e in applied {
            if let Some(seq) = e.aggregate_seq {
                let at = top.entry(key(e)).or_insert(seq);
                *at = (*at).max(seq);
            }
        }
        if top.is_empty() {
            return Ok(());
        }
        let mut rows: Vec<(Key, i64)> = top.into_iter().collect();
        rows.sort();
        let keys: Vec<Key> = rows.iter().map(|(k, _)| k.clone()).collect();
        let seqs: Vec<i64> = rows.iter().map(|(_, s)| *s).collect();
        let (sources, types, ids) = split(&keys);
        sqlx::query(
            "INSERT INTO aggregate_positions (tenant_id, consumer, source, aggregate_type, aggregate_id, last_seq)
             SELECT $1, $2, * FROM unnest($3::text[], $4::text[], $5::text[], $6::bigint[])
             ON CONFLICT (tenant_id, consumer, source, aggregate_type, aggregate_id) DO UPDATE
             SET last_seq = GREATEST(aggregate_positions.last_seq, EXCLUDED.last_seq), updated_at = now()",
        )
        .bind(tx.tenant().get())
        .bind(&self.config.name)
        .bind(&sources)
        .bind(&types)
        .bind(&ids)
        .bind(&seqs)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Puts `event` in the parked store: the first of its aggregate (with
    /// `reason`) or behind the ones there. The event is recorded as seen
    /// already, so its redeliveries are duplicates.
    pub(super) async fn park(
        &self,
        tx: &mut TenantTx,
        event: &Envelope,
        reason: Option<&str>,
    ) -> Result<(), ApplyError> {
        let envelope =
            serde_json::to_value(event).map_err(|e| super::HandlerError::Permanent(Box::new(e)))?;
        sqlx::query(
            "WITH head AS (
                 INSERT INTO parked_aggregates (tenant_id, consumer, source, aggregate_type, aggregate_id, error)
                 VALUES ($1, $2, $3, $4, $5, COALESCE($6, 'parked'))
                 ON CONFLICT DO NOTHING
             )
             INSERT INTO parked_events (tenant_id, consumer, source, aggregate_type, aggregate_id,
                                        message_id, aggregate_seq, event_type, envelope)
             VALUES ($1, $2, $3, $4, $5, $7, $8, $9, $10)
             ON CONFLICT DO NOTHING",
        )
        .bind(tx.tenant().get())
        .bind(&self.config.name)
        .bind(&event.source)
        .bind(&event.aggregate_type)
        .bind(&event.aggregate_id)
        .bind(reason)
        .bind(event.id)
        .bind(event.aggregate_seq)
        .bind(&event.event_type)
        .bind(envelope)
        .execute(&mut **tx)
        .await?;
        metrics::counter!(crate::metrics::CONSUMER_PARKED, "consumer" => self.config.name.clone())
            .increment(1);
        if let Some(reason) = reason {
            tracing::error!(consumer = %self.config.name, tenant_id = event.tenant_id, aggregate = %event.aggregate_key(),
                            message_id = %event.message_id(), error = %reason, "aggregate parked; its later events wait behind it");
        }
        Ok(())
    }
}

fn split(keys: &[Key]) -> (Vec<&str>, Vec<&str>, Vec<&str>) {
    let sources = keys.iter().map(|k| k.0.as_str()).collect();
    let types = keys.iter().map(|k| k.1.as_str()).collect();
    let ids = keys.iter().map(|k| k.2.as_str()).collect();
    (sources, types, ids)
}
