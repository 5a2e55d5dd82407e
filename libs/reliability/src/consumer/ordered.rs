//! An ordered subscription's gate (docs/adr/0028): inside the apply's
//! transaction, under the aggregate's lock, each fresh event is applied,
//! or parked behind its aggregate's parked events, or parks its aggregate
//! because it came out of order; the positions advance with the commit.

use std::collections::{HashMap, HashSet};

use crate::TenantTx;
use crate::outbox::Envelope;

use super::hold::AggregateState;
use super::{Apply, ApplyError, Consumer, Handler, Lane, Pg};

/// What the gate decided for one fresh event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Gate {
    Apply,
    /// Into the parked store: behind its parked aggregate (None), or as
    /// the first event of a newly parked one (the reason).
    Park(Option<String>),
    /// Into the parked store as the first event of a newly held
    /// aggregate: a whole subscription's number skipped (`hold.rs`).
    Hold(String),
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
/// aggregate types, `$7` aggregate ids, `$8` sequence numbers, `$9`
/// whether the event's aggregate may take the quick way (its events here
/// are numbered and ascending; on a whole subscription, consecutive), `$10`
/// whether the subscription is whole (its aggregate advances only from the
/// number before its first event here: a new one from 1). Returns each
/// fresh event with whether its aggregate advanced.
///
/// Only the common case is decided here: an aggregate not parked whose
/// fresh events all come after its position moves to the last of them, in
/// the position's own upsert (its arbiter reads the position; a row it
/// does not update is one not in order). Everything else is decided by
/// [`Consumer::record_gated`] from [`STATE_SQL`]: a window and a grouping
/// here to decide every case cost PostgreSQL a fifth more per event
/// (docs/adr/0033).
pub(super) const GATE_SQL: &str = concat!(
    "WITH seen AS (
             SELECT * FROM unnest($3::text[], $4::bigint[], $6::text[], $7::text[], $8::bigint[], $9::bool[])
                 AS s (source, message_id, aggregate_type, aggregate_id, seq, quick)
         ), fresh AS (
             INSERT INTO processed_messages (tenant_id, consumer, source, message_id)
             SELECT DISTINCT $1::bigint, $2::text, source, message_id FROM seen
             ORDER BY source, message_id
             ON CONFLICT DO NOTHING
             RETURNING source, message_id
         ), ",
    super::apply::offsets_ctes!(),
    ", ev AS (
             SELECT s.* FROM seen s JOIN fresh f USING (source, message_id)
         ), span AS (
             SELECT source, aggregate_type, aggregate_id, min(seq) AS lo, max(seq) AS hi
             FROM ev GROUP BY 1, 2, 3 HAVING bool_and(quick)
         ), advanced AS (
             INSERT INTO aggregate_positions AS p (tenant_id, consumer, source, aggregate_type, aggregate_id, last_seq)
             SELECT $1, $2, source, aggregate_type, aggregate_id, hi FROM span g
             WHERE NOT EXISTS (SELECT FROM parked_aggregates a
                               WHERE a.tenant_id = $1 AND a.consumer = $2 AND a.source = g.source
                                 AND a.aggregate_type = g.aggregate_type AND a.aggregate_id = g.aggregate_id)
               AND (NOT $10 OR g.lo = 1
                    OR EXISTS (SELECT FROM aggregate_positions q
                               WHERE q.tenant_id = $1 AND q.consumer = $2 AND q.source = g.source
                                 AND q.aggregate_type = g.aggregate_type AND q.aggregate_id = g.aggregate_id))
             ORDER BY source, aggregate_type, aggregate_id
             ON CONFLICT (tenant_id, consumer, source, aggregate_type, aggregate_id) DO UPDATE
             SET last_seq = EXCLUDED.last_seq, updated_at = now()
             WHERE p.last_seq < (SELECT g.lo FROM span g
                                 WHERE g.source = EXCLUDED.source AND g.aggregate_type = EXCLUDED.aggregate_type
                                   AND g.aggregate_id = EXCLUDED.aggregate_id)
               AND (NOT $10 OR p.last_seq + 1 = (SELECT g.lo FROM span g
                                 WHERE g.source = EXCLUDED.source AND g.aggregate_type = EXCLUDED.aggregate_type
                                   AND g.aggregate_id = EXCLUDED.aggregate_id))
             RETURNING source, aggregate_type, aggregate_id
         )
         SELECT e.source, e.message_id, a.aggregate_id IS NOT NULL AS advanced
         FROM ev e LEFT JOIN advanced a USING (source, aggregate_type, aggregate_id)"
);

/// The position of the aggregates `$3..$5` (sources, types, ids) of tenant
/// `$1` and consumer `$2`, and whether each is held (NULL: not parked,
/// false: parked for a failure): for the events the gate's
/// quick way did not take. A look-up per aggregate on the whole key, never
/// a join: on tables not analyzed yet (a new deployment) the planner
/// joined by a scan of all the tenant's positions, a cost growing with its
/// aggregates (docs/adr/0028).
pub(super) const STATE_SQL: &str = "
    SELECT k.source, k.aggregate_type, k.aggregate_id,
           (SELECT p.last_seq FROM aggregate_positions p
            WHERE p.tenant_id = $1 AND p.consumer = $2 AND p.source = k.source
              AND p.aggregate_type = k.aggregate_type AND p.aggregate_id = k.aggregate_id) AS last_seq,
           (SELECT a.held_until IS NOT NULL FROM parked_aggregates a
            WHERE a.tenant_id = $1 AND a.consumer = $2 AND a.source = k.source
              AND a.aggregate_type = k.aggregate_type AND a.aggregate_id = k.aggregate_id) AS held
    FROM unnest($3::text[], $4::text[], $5::text[]) AS k (source, aggregate_type, aggregate_id)";

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
    ///
    /// The statement advances each aggregate that is not parked and whose
    /// fresh events here all come after its position, in order (the common
    /// case): they are applied. Only the others cost more: their state is
    /// read ([`STATE_SQL`]) and their events decided one by one, and those
    /// applied advance their aggregate in a statement of their own.
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
        let quick = quick(events, self.config.queue.whole);
        let rows: Vec<(String, i64, bool)> = sqlx::query_as(GATE_SQL)
            .bind(tx.tenant().get())
            .bind(&self.config.name)
            .bind(&sources)
            .bind(&ids)
            .bind(lane.stripe)
            .bind(&types)
            .bind(&aggregates)
            .bind(&seqs)
            .bind(&quick)
            .bind(self.config.queue.whole)
            .fetch_all(&mut **tx)
            .await?;
        let mut fresh: HashMap<(String, i64), bool> = rows
            .into_iter()
            .map(|(source, id, advanced)| ((source, id), advanced))
            .collect();
        // The events to decide one by one: fresh, and their aggregate did
        // not advance.
        let mut gates: Vec<Option<Gate>> = Vec::with_capacity(events.len());
        let mut slow: Vec<usize> = Vec::new();
        for (i, e) in events.iter().enumerate() {
            gates.push(match fresh.remove(&(e.source.clone(), e.id)) {
                None => None,
                Some(true) => Some(Gate::Apply),
                Some(false) => {
                    slow.push(i);
                    None
                }
            });
        }
        if slow.is_empty() {
            return Ok(gates);
        }
        let whole = self.config.queue.whole;
        let mut state = self.state(tx, events, &slow).await?;
        let mut late_applied = Vec::new();
        let mut filled = Vec::new();
        for i in slow {
            let e = events[i];
            let at = state.entry(key(e)).or_default();
            let gate = at.gate(e, whole);
            if gate == Gate::Apply {
                late_applied.push(e);
                if at.held {
                    filled.push(e);
                }
            }
            gates[i] = Some(gate);
        }
        self.request_release(tx, &filled).await?;
        self.advance(tx, &late_applied).await?;
        Ok(gates)
    }

    /// [`STATE_SQL`] for the aggregates of `events[i]`, `i` in `which`:
    /// each one's position, and whether it is parked or held.
    async fn state(
        &self,
        tx: &mut TenantTx,
        events: &[&Envelope],
        which: &[usize],
    ) -> Result<HashMap<Key, AggregateState>, ApplyError> {
        let mut keys: Vec<Key> = which.iter().map(|&i| key(events[i])).collect();
        keys.sort();
        keys.dedup();
        let (sources, types, ids) = split(&keys);
        type Row = (String, String, String, Option<i64>, Option<bool>);
        let rows: Vec<Row> = sqlx::query_as(STATE_SQL)
            .bind(tx.tenant().get())
            .bind(&self.config.name)
            .bind(&sources)
            .bind(&types)
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(source, t, id, last, held)| {
                let (parked, held) = (held.is_some(), held == Some(true));
                ((source, t, id), AggregateState { last, parked, held })
            })
            .collect())
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
        self.park_as(tx, event, reason, None).await
    }

    /// [`Self::park`]; with `held_for`, a new head is held for a number
    /// skipped that long, not parked for a failure (`hold.rs`).
    pub(super) async fn park_as(
        &self,
        tx: &mut TenantTx,
        event: &Envelope,
        reason: Option<&str>,
        held_for: Option<std::time::Duration>,
    ) -> Result<(), ApplyError> {
        let envelope =
            serde_json::to_value(event).map_err(|e| super::HandlerError::Permanent(Box::new(e)))?;
        let held_ms = held_for.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        sqlx::query(
            "WITH head AS (
                 INSERT INTO parked_aggregates (tenant_id, consumer, source, aggregate_type, aggregate_id, error,
                                                held_until)
                 VALUES ($1, $2, $3, $4, $5, COALESCE($6, 'parked'),
                         now() + $11::bigint * interval '1 millisecond')
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
        .bind(held_ms)
        .execute(&mut **tx)
        .await?;
        let name = self.config.name.clone();
        match (reason, held_for) {
            (Some(reason), Some(_)) => {
                metrics::counter!(crate::metrics::CONSUMER_HELD, "consumer" => name).increment(1);
                tracing::warn!(consumer = %self.config.name, tenant_id = event.tenant_id, aggregate = %event.aggregate_key(),
                               message_id = %event.message_id(), why = %reason, wait = ?held_for, "aggregate held for a number skipped");
            }
            (reason, _) => {
                metrics::counter!(crate::metrics::CONSUMER_PARKED, "consumer" => name).increment(1);
                if let Some(reason) = reason {
                    tracing::error!(consumer = %self.config.name, tenant_id = event.tenant_id, aggregate = %event.aggregate_key(),
                                    message_id = %event.message_id(), error = %reason, "aggregate parked; its later events wait behind it");
                }
            }
        }
        Ok(())
    }
}

/// For each event, whether its aggregate may take the gate's quick way:
/// every event of that aggregate here is numbered, each above the one
/// before (on a `whole` subscription, the one after it; a message
/// repeated here counts once). Then its fresh events are in order if the
/// first of them comes after the position (on a whole one, right after).
fn quick(events: &[&Envelope], whole: bool) -> Vec<bool> {
    let mut top: HashMap<Key, Option<i64>> = HashMap::new();
    let mut seen: HashSet<(&str, i64)> = HashSet::with_capacity(events.len());
    for e in events {
        if !seen.insert((e.source.as_str(), e.id)) {
            continue;
        }
        let at = top.entry(key(e)).or_insert(Some(0));
        *at = match (*at, e.aggregate_seq) {
            (Some(before), Some(seq))
                if seq > before && (!whole || before == 0 || seq == before + 1) =>
            {
                Some(seq)
            }
            _ => None,
        };
    }
    events.iter().map(|e| top[&key(e)].is_some()).collect()
}

fn split(keys: &[Key]) -> (Vec<&str>, Vec<&str>, Vec<&str>) {
    let sources = keys.iter().map(|k| k.0.as_str()).collect();
    let types = keys.iter().map(|k| k.1.as_str()).collect();
    let ids = keys.iter().map(|k| k.2.as_str()).collect();
    (sources, types, ids)
}
