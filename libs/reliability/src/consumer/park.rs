//! Parked aggregates (docs/adr/0028): what operators see and do
//! (`reliability park list|unpark|skip`, as the owner role), and the
//! consumer's side of an unpark: it replays the aggregate's parked events
//! in order through the handler, then lets the aggregate flow again.
//!
//! The operator only asks (`release_requested_at`): the replay needs the
//! handler, so the consumer does it, under the aggregate's lock, one event
//! per transaction, beside its lanes and its other replicas.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::outbox::Envelope;
use crate::{Result, TenantId, TenantTx};

use super::{Consumer, Handler, HandlerError, Pg, lock_id};

/// How often a consumer with an ordered subscription looks for released
/// aggregates and refreshes its parked gauges.
const PARK_POLL: Duration = Duration::from_secs(1);

/// A parked aggregate as an operator sees it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct ParkedAggregate {
    pub consumer: String,
    pub tenant_id: i64,
    pub source: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// Why its first event was parked.
    pub error: String,
    pub parked_at: DateTime<Utc>,
    /// An unpark was asked for and the consumer has not finished it.
    pub release_requested: bool,
    /// Events waiting, the first included.
    pub waiting: i64,
    pub first_message_id: Option<i64>,
    pub first_event_type: Option<String>,
    pub first_seq: Option<i64>,
}

/// One parked event (what `skip` removed or would remove).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct ParkedEvent {
    pub message_id: i64,
    pub event_type: String,
    pub aggregate_seq: Option<i64>,
    pub envelope: serde_json::Value,
}

/// Every parked aggregate, or one consumer's, oldest first.
pub async fn parked(owner: &PgPool, consumer: Option<&str>) -> Result<Vec<ParkedAggregate>> {
    Ok(sqlx::query_as(
        "SELECT a.consumer, a.tenant_id, a.source, a.aggregate_type, a.aggregate_id, a.error, a.parked_at,
                a.release_requested_at IS NOT NULL AS release_requested,
                (SELECT count(*) FROM parked_events e
                 WHERE (e.tenant_id, e.consumer, e.source, e.aggregate_type, e.aggregate_id)
                     = (a.tenant_id, a.consumer, a.source, a.aggregate_type, a.aggregate_id)) AS waiting,
                f.message_id AS first_message_id, f.event_type AS first_event_type, f.aggregate_seq AS first_seq
         FROM parked_aggregates a
         LEFT JOIN LATERAL (
             SELECT message_id, event_type, aggregate_seq FROM parked_events e
             WHERE (e.tenant_id, e.consumer, e.source, e.aggregate_type, e.aggregate_id)
                 = (a.tenant_id, a.consumer, a.source, a.aggregate_type, a.aggregate_id)
             ORDER BY position LIMIT 1) f ON true
         WHERE $1::text IS NULL OR a.consumer = $1
         ORDER BY a.parked_at, a.tenant_id, a.aggregate_type, a.aggregate_id",
    )
    .bind(consumer)
    .fetch_all(owner)
    .await?)
}

/// Asks `consumer` to replay the aggregate's parked events in order and
/// resume it (after the handler was fixed, or the cause outside it); a
/// held one is replayed now, over its gap. Returns whether such a parked
/// aggregate exists.
pub async fn unpark(
    owner: &PgPool,
    consumer: &str,
    tenant: i64,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<bool> {
    let n = sqlx::query(
        "UPDATE parked_aggregates SET release_requested_at = now(), held_until = CASE WHEN held_until IS NULL THEN NULL ELSE now() END
         WHERE consumer = $1 AND tenant_id = $2 AND aggregate_type = $3 AND aggregate_id = $4",
    )
    .bind(consumer)
    .bind(tenant)
    .bind(aggregate_type)
    .bind(aggregate_id)
    .execute(owner)
    .await?
    .rows_affected();
    Ok(n > 0)
}

/// The aggregate's first parked event: the one [`skip`] would remove.
pub async fn first_parked(
    owner: &PgPool,
    consumer: &str,
    tenant: i64,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<Option<ParkedEvent>> {
    let first = first_in(owner, consumer, tenant, aggregate_type, aggregate_id).await?;
    Ok(first.map(|f| f.event))
}

/// The first parked event of an aggregate, with its place in the store.
#[derive(sqlx::FromRow)]
struct First {
    position: i64,
    #[sqlx(flatten)]
    event: ParkedEvent,
}

async fn first_in(
    conn: impl sqlx::PgExecutor<'_>,
    consumer: &str,
    tenant: i64,
    aggregate_type: &str,
    aggregate_id: &str,
) -> sqlx::Result<Option<First>> {
    sqlx::query_as(
        "SELECT position, message_id, event_type, aggregate_seq, envelope FROM parked_events
         WHERE consumer = $1 AND tenant_id = $2 AND aggregate_type = $3 AND aggregate_id = $4
         ORDER BY position LIMIT 1",
    )
    .bind(consumer)
    .bind(tenant)
    .bind(aggregate_type)
    .bind(aggregate_id)
    .fetch_optional(conn)
    .await
}

/// Removes parked event `message_id` of the aggregate, never to be
/// applied, if it is still the first ([`first_parked`] showed it to the
/// operator); else changes nothing and returns `None` (an unpark replayed
/// it, or another operator skipped it, meanwhile). The others stay parked
/// until an unpark; if it was the only one, the aggregate flows again.
///
/// Under the aggregate's lock, the one every lane and replay takes
/// (docs/adr/0028): without it, the emptied park's removal could race a
/// lane parking the aggregate's next event, and the cascade would delete
/// an event the lane had just parked and acked: never applied (I10).
pub async fn skip(
    owner: &PgPool,
    consumer: &str,
    tenant: i64,
    aggregate_type: &str,
    aggregate_id: &str,
    message_id: i64,
) -> Result<Option<ParkedEvent>> {
    let mut tx = owner.begin().await?;
    let aggregate = format!("{aggregate_type}:{aggregate_id}");
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(lock_id(consumer, tenant, &aggregate))
        .execute(&mut *tx)
        .await?;
    let first = first_in(&mut *tx, consumer, tenant, aggregate_type, aggregate_id).await?;
    let Some(First { position, event }) = first.filter(|f| f.event.message_id == message_id) else {
        return Ok(None);
    };
    sqlx::query(
        "DELETE FROM parked_events WHERE consumer = $1 AND tenant_id = $2 AND position = $3",
    )
    .bind(consumer)
    .bind(tenant)
    .bind(position)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM parked_aggregates a
         WHERE consumer = $1 AND tenant_id = $2 AND aggregate_type = $3 AND aggregate_id = $4
           AND NOT EXISTS (SELECT 1 FROM parked_events e
                           WHERE (e.tenant_id, e.consumer, e.source, e.aggregate_type, e.aggregate_id)
                               = (a.tenant_id, a.consumer, a.source, a.aggregate_type, a.aggregate_id))",
    )
    .bind(consumer)
    .bind(tenant)
    .bind(aggregate_type)
    .bind(aggregate_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(event))
}

/// One row of `parked_overview`: what a consumer sees across tenants.
#[derive(sqlx::FromRow)]
pub(super) struct Overview {
    pub(super) tenant_id: i64,
    pub(super) source: String,
    pub(super) aggregate_type: String,
    pub(super) aggregate_id: String,
    parked_at: DateTime<Utc>,
    release_requested: bool,
    /// Held for a number skipped until then (`hold.rs`); None: parked.
    held_until: Option<DateTime<Utc>>,
}

/// How a replay step ended.
enum Step {
    Replayed,
    Resumed,
    Failed(String),
    /// A held aggregate's next number has not come: it stays held.
    Waiting,
}

impl<H: Handler> Consumer<Pg<H>> {
    /// Until `stop`: refreshes the parked gauges and replays the aggregates
    /// an operator released. A failed look is logged and tried again.
    pub(super) async fn release_loop(&self, stop: &CancellationToken) {
        loop {
            if let Err(e) = self.release_pass().await {
                tracing::warn!(consumer = %self.config.name, error = %e, "cannot look at parked aggregates; trying again");
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(PARK_POLL) => {}
            }
        }
    }

    async fn release_pass(&self) -> Result<()> {
        let rows: Vec<Overview> = sqlx::query_as("SELECT * FROM parked_overview($1)")
            .bind(&self.config.name)
            .fetch_all(&self.state.pool)
            .await?;
        let name = self.config.name.clone();
        // Held aggregates wait for no operator: not in the parked gauges.
        let (now, parked) = (Utc::now(), rows.iter().filter(|r| r.held_until.is_none()));
        let oldest = parked
            .clone()
            .map(|r| (now - r.parked_at).num_milliseconds() as f64 / 1000.0)
            .fold(0.0, f64::max);
        metrics::gauge!(crate::metrics::CONSUMER_PARKED_AGGREGATES, "consumer" => name.clone())
            .set(parked.count() as f64);
        metrics::gauge!(crate::metrics::CONSUMER_PARKED_OLDEST, "consumer" => name).set(oldest);
        let due = |r: &&Overview| r.release_requested || r.held_until.is_some_and(|t| t <= now);
        for r in rows.iter().filter(due) {
            self.release(r).await?;
        }
        Ok(())
    }

    /// Replays one released aggregate's parked events in order, one per
    /// transaction, until none is left (the aggregate resumes) or one fails
    /// again (it stays parked with the new error, the request cleared).
    async fn release(&self, r: &Overview) -> Result<()> {
        let tenant = TenantId::new(r.tenant_id)?;
        let aggregate = format!("{}:{}", r.aggregate_type, r.aggregate_id);
        let mut replayed = 0;
        loop {
            match self.replay_first(tenant, r).await? {
                Step::Replayed => replayed += 1,
                Step::Resumed => {
                    tracing::info!(consumer = %self.config.name, tenant_id = r.tenant_id, %aggregate, replayed, "parked aggregate replayed in order; it flows again");
                    return Ok(());
                }
                Step::Waiting => return Ok(()),
                Step::Failed(error) => {
                    tracing::error!(consumer = %self.config.name, tenant_id = r.tenant_id, %aggregate, replayed, %error, "replaying a parked aggregate failed; it stays parked");
                    // A held aggregate whose replay fails is parked for an
                    // operator: past its hold, it would be released again
                    // every pass.
                    let mut tx = TenantTx::begin(&self.state.pool, tenant).await?;
                    sqlx::query(
                        "UPDATE parked_aggregates SET error = $5, release_requested_at = NULL, held_until = NULL
                         WHERE tenant_id = $1 AND consumer = $2 AND source = $3
                           AND aggregate_type = $4 AND aggregate_id = $6",
                    )
                    .bind(r.tenant_id)
                    .bind(&self.config.name)
                    .bind(&r.source)
                    .bind(&r.aggregate_type)
                    .bind(&error)
                    .bind(&r.aggregate_id)
                    .execute(&mut *tx)
                    .await?;
                    tx.commit().await?;
                    return Ok(());
                }
            }
        }
    }

    /// Applies the aggregate's first parked event (or, none left, removes
    /// the park), under the same locks a lane takes for it.
    async fn replay_first(&self, tenant: TenantId, r: &Overview) -> Result<Step> {
        // The aggregate's lock, and the handler's for the event seen first;
        // then look again under them. Another replica may have replayed
        // that event meanwhile: if the first now needs a lock not held,
        // start over holding it, so no event is applied without its
        // handler's lock.
        let mut seen: Option<Envelope> = None;
        let (mut tx, first) = loop {
            let mut tx = TenantTx::begin(&self.state.pool, tenant).await?;
            let locks = self.replay_locks(r, seen.as_ref());
            sqlx::query(
                "SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) AS u(k) ORDER BY k",
            )
            .bind(&locks)
            .execute(&mut *tx)
            .await?;
            let first: Option<Envelope> = self
                .replay_head(&mut tx, r)
                .await?
                .map(serde_json::from_value)
                .transpose()?;
            if self
                .replay_locks(r, first.as_ref())
                .iter()
                .all(|k| locks.contains(k))
            {
                break (tx, first);
            }
            tx.rollback().await?;
            seen = first;
        };
        if self.held_waits(&mut tx, r, first.as_ref()).await? {
            tx.commit().await?;
            return Ok(Step::Waiting);
        }
        let Some(event) = first else {
            sqlx::query(
                "DELETE FROM parked_aggregates
                 WHERE tenant_id = $1 AND consumer = $2 AND source = $3 AND aggregate_type = $4 AND aggregate_id = $5",
            )
            .bind(r.tenant_id)
            .bind(&self.config.name)
            .bind(&r.source)
            .bind(&r.aggregate_type)
            .bind(&r.aggregate_id)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Step::Resumed);
        };
        let applied: std::result::Result<(), HandlerError> = async {
            self.state.handler.prepare(&mut tx, &[&event]).await?;
            self.state.handler.handle(&mut tx, &event).await
        }
        .await;
        match applied {
            Ok(()) => {}
            // An outage: the next pass tries again, the request kept.
            Err(HandlerError::Database(e)) => return Err(e.into()),
            // Rolled back: the event stays first.
            Err(e) => return Ok(Step::Failed(e.to_string())),
        }
        sqlx::query(
            "DELETE FROM parked_events WHERE tenant_id = $1 AND consumer = $2 AND source = $3 AND message_id = $4",
        )
        .bind(r.tenant_id)
        .bind(&self.config.name)
        .bind(&r.source)
        .bind(event.id)
        .execute(&mut *tx)
        .await?;
        self.advance(&mut tx, &[&event])
            .await
            .map_err(|e| crate::Error::Upstream(e.to_string()))?;
        tx.commit().await?;
        Ok(Step::Replayed)
    }

    /// The locks a lane takes for `event` of the aggregate, sorted: the
    /// aggregate's, and the handler's own key's.
    fn replay_locks(&self, r: &Overview, event: Option<&Envelope>) -> Vec<i64> {
        let aggregate = format!("{}:{}", r.aggregate_type, r.aggregate_id);
        let mut locks = vec![lock_id(&self.config.name, r.tenant_id, &aggregate)];
        if let Some(k) = event.and_then(|e| self.state.handler.lock_key(e)) {
            locks.push(lock_id(&self.config.name, r.tenant_id, &k));
        }
        locks.sort_unstable();
        locks.dedup();
        locks
    }
}
