//! Applying events exactly once: the aggregate lock, the dedup record and
//! offset, the handler and the commit, one event or a group at a time.

use std::collections::HashSet;

use lapin::message::Delivery;

use crate::broker;
use crate::failpoint;
use crate::outbox::Envelope;
use crate::trace::{Kind, Span, TraceContext};
use crate::{Error, Result, TenantTx};

use super::ordered::Gate;
use super::{
    Apply, ApplyError, Consumer, ConsumerConfig, Handler, HandlerError, Lane, Outcome, Pg, lock_id,
    tenant_of,
};

/// The statement parts that advance the lane's progress stripe, per source,
/// from `seen` (the run's events) and `fresh` (those recorded now): `$1`
/// tenant, `$2` consumer, `$5` stripe. Shared by the order-free record and
/// the ordered one (`ordered.rs`).
macro_rules! offsets_ctes {
    () => {
        "progress AS (
             SELECT source, max(message_id) AS last_seen, count(*) AS seen,
                    (SELECT count(*) FROM fresh f WHERE f.source = s.source) AS applied
             FROM seen s GROUP BY source
         ), bumped AS (
             INSERT INTO consumer_offsets (tenant_id, consumer, source, stripe, last_seen_id, applied_count, duplicate_count)
             SELECT $1, $2, source, $5, last_seen, applied, seen - applied FROM progress ORDER BY source
             ON CONFLICT (tenant_id, consumer, source, stripe) DO UPDATE
             SET last_seen_id = GREATEST(consumer_offsets.last_seen_id, EXCLUDED.last_seen_id),
                 applied_count = consumer_offsets.applied_count + EXCLUDED.applied_count,
                 duplicate_count = consumer_offsets.duplicate_count + EXCLUDED.duplicate_count,
                 updated_at = now()
         )"
    };
}
pub(super) use offsets_ctes;

impl<A: Apply> Consumer<A> {
    /// Applies `event` once (in PostgreSQL: aggregate lock, dedup record
    /// and offset, handler, commit). Safe beside running consumers of the
    /// same name (a replay, a rebuild).
    pub async fn apply(&self, event: &Envelope) -> Result<Outcome, ApplyError> {
        A::one(self, event, Lane::new(0)).await
    }
}

impl<H: Handler> Consumer<Pg<H>> {
    pub(super) async fn apply_one(
        &self,
        event: &Envelope,
        lane: Lane,
    ) -> Result<Outcome, ApplyError> {
        let mut locks = self.lock_keys(&[event]);
        let mut tx = self.begin(tenant_of(event)?, &mut locks).await?;
        let gate = self
            .record_run(&mut tx, &[event], lane, &locks)
            .await?
            .pop()
            .flatten();
        let outcome = match gate {
            None => Outcome::Duplicate,
            Some(Gate::Park(reason)) => {
                self.park(&mut tx, event, reason.as_deref()).await?;
                Outcome::Parked
            }
            Some(Gate::Hold(why)) => {
                self.hold(&mut tx, event, &why).await?;
                Outcome::Parked
            }
            Some(Gate::Apply) => {
                self.state.handler.prepare(&mut tx, &[event]).await?;
                self.handle(&mut tx, event).await?;
                self.before_commit()?;
                Outcome::Applied
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Parks `event`'s aggregate: `event` failed for good (`error`). The
    /// park commits with the event's dedup record, before the ack.
    pub(super) async fn park_failed(
        &self,
        event: &Envelope,
        error: &HandlerError,
        lane: Lane,
    ) -> Result<Outcome, ApplyError> {
        let mut tx = TenantTx::begin(&self.state.pool, tenant_of(event)?).await?;
        let locks = self.lock_keys(&[event]);
        let fresh = self.record(&mut tx, &[event], lane, &locks).await?;
        let outcome = if fresh.is_empty() {
            Outcome::Duplicate
        } else {
            self.park(&mut tx, event, Some(&error.to_string())).await?;
            Outcome::Parked
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Applies a group of events in one transaction; all commit or none.
    /// The group is taken tenant by tenant (a stable sort: each tenant's
    /// events keep their delivery order; different tenants share nothing),
    /// so each tenant costs one `set_config` and one statement that records
    /// all its events and advances its offsets; then the handler prepares
    /// and runs for each fresh event. A message seen twice in the group is
    /// applied the first time, a duplicate after.
    ///
    /// Lock order, the same in every applier: every aggregate of the group
    /// (sorted), then per tenant (ascending) its progress rows and what the
    /// handler's `prepare` locks. No two appliers can wait on each other in
    /// a circle.
    pub(super) async fn apply_group(
        &self,
        group: &[(Delivery, Envelope)],
        lane: Lane,
    ) -> Result<Vec<Outcome>, ApplyError> {
        let mut order: Vec<usize> = (0..group.len()).collect();
        order.sort_by_key(|&i| group[i].1.tenant_id);
        let all: Vec<&Envelope> = group.iter().map(|(_, e)| e).collect();
        // Every aggregate of the group, locked before any record of any
        // tenant: as the transaction opens (ordered), or by the first
        // tenant's record statement.
        let mut locks = self.lock_keys(&all);
        let mut tx = self
            .begin(tenant_of(&group[order[0]].1)?, &mut locks)
            .await?;
        let mut outcomes = vec![Outcome::Duplicate; group.len()];
        for run in order.chunk_by(|&a, &b| group[a].1.tenant_id == group[b].1.tenant_id) {
            tx.rescope(tenant_of(&group[run[0]].1)?).await?;
            let events: Vec<&Envelope> = run.iter().map(|&i| &group[i].1).collect();
            let gates = self
                .record_run(&mut tx, &events, lane, &std::mem::take(&mut locks))
                .await?;
            let mut to_apply = Vec::with_capacity(run.len());
            for (&i, gate) in run.iter().zip(gates) {
                match gate {
                    None => {}
                    Some(Gate::Apply) => to_apply.push(i),
                    Some(Gate::Park(reason)) => {
                        self.park(&mut tx, &group[i].1, reason.as_deref()).await?;
                        outcomes[i] = Outcome::Parked;
                    }
                    Some(Gate::Hold(why)) => {
                        self.hold(&mut tx, &group[i].1, &why).await?;
                        outcomes[i] = Outcome::Parked;
                    }
                }
            }
            if to_apply.is_empty() {
                continue;
            }
            let fresh_events: Vec<&Envelope> = to_apply.iter().map(|&i| &group[i].1).collect();
            self.state.handler.prepare(&mut tx, &fresh_events).await?;
            for &i in &to_apply {
                let (delivery, event) = &group[i];
                let step = apply_span(&self.config, delivery, event);
                step.run(self.handle(&mut tx, event)).await?;
                outcomes[i] = Outcome::Applied;
            }
        }
        if outcomes.contains(&Outcome::Applied) {
            self.before_commit()?;
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// Opens the transaction for `tenant`'s events. An ordered subscription
    /// takes all `locks` at once, as it opens: its record reads what they
    /// guard. Otherwise they are left for [`Self::record`] to take.
    async fn begin(&self, tenant: crate::TenantId, locks: &mut Vec<i64>) -> sqlx::Result<TenantTx> {
        if self.is_ordered() {
            TenantTx::begin_locked(&self.state.pool, tenant, &std::mem::take(locks)).await
        } else {
            TenantTx::begin(&self.state.pool, tenant).await
        }
    }

    /// Records one tenant's `events` (taking `locks` first, if any are
    /// left) and, for an ordered subscription, gates the fresh ones: for
    /// each event, `None` if it is a duplicate, else its gate.
    async fn record_run(
        &self,
        tx: &mut TenantTx,
        events: &[&Envelope],
        lane: Lane,
        locks: &[i64],
    ) -> Result<Vec<Option<Gate>>, ApplyError> {
        if self.is_ordered() {
            return self.record_gated(tx, events, lane).await;
        }
        let mut fresh = self.record(tx, events, lane, locks).await?;
        Ok(events
            .iter()
            .map(|e| {
                fresh
                    .remove(&(e.source.clone(), e.id))
                    .then_some(Gate::Apply)
            })
            .collect())
    }

    /// The advisory lock key of every aggregate the events change, sorted
    /// and unique: the consumer, the tenant and the handler's lock key,
    /// hashed, the same in every process. [`Self::record`] takes them.
    fn lock_keys(&self, events: &[&Envelope]) -> Vec<i64> {
        let mut keys: Vec<i64> = events
            .iter()
            .filter_map(|e| {
                self.state
                    .handler
                    .lock_key(e)
                    .map(|k| lock_id(&self.config.name, e.tenant_id, &k))
            })
            .collect();
        if self.is_ordered() {
            // The unit of order, whatever the handler's own key: its
            // position and parked store change one applier at a time.
            keys.extend(
                events
                    .iter()
                    .map(|e| lock_id(&self.config.name, e.tenant_id, &e.aggregate_key())),
            );
        }
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// One statement for any number of one tenant's events: first the
    /// transaction-scoped advisory locks `locks` (ascending: the lock
    /// order of every applier), then the dedup records (the ones that
    /// already exist are duplicates) and, per source, the lane's progress
    /// stripe (highest id seen, events applied, duplicates absorbed; shown
    /// by `reliability offsets` and the e2e table). Returns the
    /// `(source, id)` pairs recorded now: the events to apply.
    ///
    /// The locks are an InitPlan of the insert's source: PostgreSQL runs it
    /// once, before the first row is inserted, and evaluates volatile
    /// output expressions after ORDER BY, so they are taken in key order
    /// before any record, as a statement of their own would (one round trip
    /// fewer per apply).
    async fn record(
        &self,
        tx: &mut TenantTx,
        events: &[&Envelope],
        lane: Lane,
        locks: &[i64],
    ) -> Result<HashSet<(String, i64)>, ApplyError> {
        let sources: Vec<&str> = events.iter().map(|e| e.source.as_str()).collect();
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        let fresh: Vec<(String, i64)> = sqlx::query_as(concat!(
            "WITH seen AS (
                 SELECT * FROM unnest($3::text[], $4::bigint[]) AS s (source, message_id)
             ), fresh AS (
                 INSERT INTO processed_messages (tenant_id, consumer, source, message_id)
                 SELECT DISTINCT $1::bigint, $2::text, source, message_id FROM seen
                 WHERE (SELECT count(*) FROM (
                          SELECT pg_advisory_xact_lock(k) FROM unnest($6::bigint[]) AS u(k) ORDER BY k
                        ) AS locked) >= 0
                 ORDER BY source, message_id -- one lock order for concurrent appliers
                 ON CONFLICT DO NOTHING
                 RETURNING source, message_id
             ), ",
            offsets_ctes!(),
            "
             SELECT source, message_id FROM fresh"
        ),
        )
        .bind(tx.tenant().get())
        .bind(&self.config.name)
        .bind(&sources)
        .bind(&ids)
        .bind(lane.stripe)
        .bind(locks)
        .fetch_all(&mut **tx)
        .await?;
        Ok(fresh.into_iter().collect())
    }

    fn before_commit(&self) -> Result<(), ApplyError> {
        match self
            .config
            .fail_points
            .check(failpoint::CONSUMER_BEFORE_COMMIT)
        {
            Err(Error::FailPoint(name)) => Err(ApplyError::FailPoint(name)),
            _ => Ok(()),
        }
    }

    /// The handler for a freshly recorded event, in `tx` (not committed).
    #[tracing::instrument(skip_all, fields(consumer = %self.config.name, message_id = %event.message_id(), event_type = %event.event_type))]
    async fn handle(&self, tx: &mut TenantTx, event: &Envelope) -> Result<(), ApplyError> {
        let points = &self.config.fail_points;
        if points.any_armed() {
            // The point as a whole, narrowed to this consumer, or to this
            // consumer's events of one aggregate (a poison aggregate).
            let consumer = format!("{}@{}", failpoint::CONSUMER_HANDLER, self.config.name);
            let aggregate = format!("{consumer}/{}/{}", event.tenant_id, event.aggregate_key());
            for name in [failpoint::CONSUMER_HANDLER, &consumer, &aggregate] {
                let why = || format!("fail point {name} fired").into();
                match points.fire(name) {
                    Some(failpoint::Action::Permanent) => {
                        return Err(HandlerError::Permanent(why()).into());
                    }
                    Some(failpoint::Action::Crash) => {
                        return Err(ApplyError::FailPoint(failpoint::CONSUMER_HANDLER));
                    }
                    Some(_) => return Err(HandlerError::Transient(why()).into()),
                    None => {}
                }
            }
        }
        self.state.handler.handle(tx, event).await?;
        Ok(())
    }
}

/// The step that applies `event` for `consumer`: a child of the trace the
/// message carries, or a new root. The consumer's service is its name's
/// first part (`inventory.stock`: inventory).
pub(super) fn apply_span(consumer: &ConsumerConfig, delivery: &Delivery, event: &Envelope) -> Span {
    let header = |name| broker::header_str(&delivery.properties, name);
    let service = consumer.name.split('.').next().unwrap_or(&consumer.name);
    let state = header(crate::trace::STATE_HEADER);
    let parent = header(crate::trace::HEADER)
        .and_then(|parent| TraceContext::parse_with_state(&parent, state.as_deref()));
    let mut span = Span::start(
        service,
        format!("apply {}", event.event_type),
        Kind::Consumer,
        parent,
    );
    span.set("messaging.system", "rabbitmq");
    span.set("messaging.destination.name", consumer.queue.queue.clone());
    span.set("messaging.message.id", event.message_id());
    span.set("tenant.id", event.tenant_id);
    span
}
