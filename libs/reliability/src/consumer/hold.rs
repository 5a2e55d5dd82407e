//! A whole ordered subscription waits for a number skipped (docs/adr/0040).
//!
//! Such a subscription is bound to every event its sources number in each
//! aggregate, so a number it has not seen is an event still on its way: a
//! delivery the broker hands back late, a publish the relay retries. The
//! gate used to apply the later event over the gap, and the late one then
//! parked its aggregate as out of order. Now the later event holds its
//! aggregate: it waits in the parked store with the events behind it, in
//! number order, until the missing number arrives (the gate applies it,
//! and the release loop replays the rest) or the hold's bound passes (the
//! release loop applies them over the gap, counted and logged, as before).

use chrono::{DateTime, Utc};

use crate::TenantTx;
use crate::outbox::Envelope;

use super::ordered::Gate;
use super::park::Overview;
use super::{ApplyError, Consumer, Handler, Pg};

/// What the gate knows of an aggregate, as it decides its events one by
/// one: its position, and whether it is parked (and if so, held).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct AggregateState {
    pub last: Option<i64>,
    pub parked: bool,
    pub held: bool,
}

impl AggregateState {
    /// The gate of `e`, a fresh event of this aggregate, and the state
    /// after it. `whole`: the subscription's.
    pub(super) fn gate(&mut self, e: &Envelope, whole: bool) -> Gate {
        let next = self.last.unwrap_or(0) + 1;
        if self.parked {
            // A held aggregate takes the number it waits for, and the ones
            // right after it: they come before everything held. The held
            // ones follow through the release loop, in number order.
            return match e.aggregate_seq {
                Some(seq) if self.held && seq == next => {
                    self.last = Some(seq);
                    Gate::Apply
                }
                _ => Gate::Park(None),
            };
        }
        match (e.aggregate_seq, self.last) {
            (Some(seq), Some(at)) if seq <= at => {
                self.parked = true;
                Gate::Park(Some(format!(
                    "out of order: event {seq} of {} arrived after event {at} was applied",
                    e.aggregate_key()
                )))
            }
            // Published by a relay that does not number this
            // subscription's events (an older release in a rolling
            // upgrade, or one whose topology lacks the subscription): after
            // a numbered event it may be an earlier one, late, and its
            // order cannot be checked. Parked, never applied unchecked
            // (docs/runbooks.md, a rolling upgrade).
            (None, Some(at)) => {
                self.parked = true;
                Gate::Park(Some(format!(
                    "unnumbered: message {} of {} came without a number after event {at} was applied \
                     (a relay that does not number this subscription's events is running)",
                    e.message_id(),
                    e.aggregate_key()
                )))
            }
            (Some(seq), _) if whole && seq > next => {
                self.parked = true;
                self.held = true;
                Gate::Hold(format!(
                    "waiting for event {next} of {}: event {seq} came first",
                    e.aggregate_key()
                ))
            }
            (seq, _) => {
                if seq.is_some() {
                    self.last = seq;
                }
                Gate::Apply
            }
        }
    }
}

/// What the release loop does with a held aggregate's first event (by
/// number), `head`, at `position`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Held {
    /// Next in number, or the hold's bound passed: apply it.
    Replay,
    /// Applied over a gap: the bound passed with numbers still missing.
    ReplayOverGap,
    /// Still a gap, within the bound: the aggregate stays held.
    Wait,
    /// At or below the position: not a gap but an event out of order; the
    /// aggregate is parked for an operator, as any late event parks it.
    OutOfOrder,
}

/// The step for a held aggregate's `head` (its number) at `position`,
/// held until `until`, at `now`.
pub(super) fn held_step(
    head: Option<i64>,
    position: Option<i64>,
    until: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Held {
    let next = position.unwrap_or(0) + 1;
    match head {
        Some(seq) if seq < next => Held::OutOfOrder,
        Some(seq) if seq == next => Held::Replay,
        _ if now >= until => Held::ReplayOverGap,
        // An unnumbered event never holds an aggregate, nor parks behind a
        // hold without a number before it: waiting is all that is left.
        _ => Held::Wait,
    }
}

impl<H: Handler> Consumer<Pg<H>> {
    /// Holds `event`'s aggregate for the number skipped before it, at most
    /// [`ConsumerConfig::gap_wait`](super::ConsumerConfig::gap_wait).
    pub(super) async fn hold(
        &self,
        tx: &mut TenantTx,
        event: &Envelope,
        why: &str,
    ) -> Result<(), ApplyError> {
        self.park_as(tx, event, Some(why), Some(self.config.gap_wait))
            .await
    }

    /// Asks the release loop to go on with the held aggregates that the
    /// `filled` events (applied, each the number its aggregate waited for)
    /// belong to: their held events come next, in number order.
    pub(super) async fn request_release(
        &self,
        tx: &mut TenantTx,
        filled: &[&Envelope],
    ) -> Result<(), ApplyError> {
        if filled.is_empty() {
            return Ok(());
        }
        let sources: Vec<&str> = filled.iter().map(|e| e.source.as_str()).collect();
        let types: Vec<&str> = filled.iter().map(|e| e.aggregate_type.as_str()).collect();
        let ids: Vec<&str> = filled.iter().map(|e| e.aggregate_id.as_str()).collect();
        sqlx::query(
            "UPDATE parked_aggregates a SET release_requested_at = now()
             FROM unnest($3::text[], $4::text[], $5::text[]) AS k (source, aggregate_type, aggregate_id)
             WHERE a.tenant_id = $1 AND a.consumer = $2 AND a.source = k.source
               AND a.aggregate_type = k.aggregate_type AND a.aggregate_id = k.aggregate_id
               AND a.held_until IS NOT NULL",
        )
        .bind(tx.tenant().get())
        .bind(&self.config.name)
        .bind(&sources)
        .bind(&types)
        .bind(&ids)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl<H: Handler> Consumer<Pg<H>> {
    /// The envelope of the first event of `r` still parked: the next one
    /// its replay applies (in number order if it is held, else in the
    /// order they came).
    pub(super) async fn replay_head(
        &self,
        tx: &mut TenantTx,
        r: &Overview,
    ) -> sqlx::Result<Option<serde_json::Value>> {
        sqlx::query_scalar(
            "SELECT envelope FROM parked_events
             WHERE tenant_id = $1 AND consumer = $2 AND source = $3 AND aggregate_type = $4 AND aggregate_id = $5
             ORDER BY CASE WHEN EXISTS (SELECT FROM parked_aggregates a
                                        WHERE a.tenant_id = $1 AND a.consumer = $2 AND a.source = $3
                                          AND a.aggregate_type = $4 AND a.aggregate_id = $5
                                          AND a.held_until IS NOT NULL)
                           THEN aggregate_seq END NULLS LAST, position
             LIMIT 1",
        )
        .bind(r.tenant_id)
        .bind(&self.config.name)
        .bind(&r.source)
        .bind(&r.aggregate_type)
        .bind(&r.aggregate_id)
        .fetch_optional(&mut **tx)
        .await
    }

    /// Under the aggregate's locks, before the release loop replays `head`
    /// (the first of `r`'s parked events by number, if it is held): whether
    /// the aggregate waits instead. Waiting, its release request is
    /// cleared; an event at or below the position turns the hold into a
    /// park for an operator. Over a gap, the skip is counted and logged.
    pub(super) async fn held_waits(
        &self,
        tx: &mut TenantTx,
        r: &Overview,
        head: Option<&Envelope>,
    ) -> crate::Result<bool> {
        type Row = (Option<DateTime<Utc>>, Option<i64>, DateTime<Utc>);
        let row: Option<Row> = sqlx::query_as(
            "SELECT a.held_until,
                    (SELECT p.last_seq FROM aggregate_positions p
                     WHERE p.tenant_id = a.tenant_id AND p.consumer = a.consumer AND p.source = a.source
                       AND p.aggregate_type = a.aggregate_type AND p.aggregate_id = a.aggregate_id),
                    now()
             FROM parked_aggregates a
             WHERE a.tenant_id = $1 AND a.consumer = $2 AND a.source = $3
               AND a.aggregate_type = $4 AND a.aggregate_id = $5",
        )
        .bind(r.tenant_id)
        .bind(&self.config.name)
        .bind(&r.source)
        .bind(&r.aggregate_type)
        .bind(&r.aggregate_id)
        .fetch_optional(&mut **tx)
        .await?;
        let (Some((Some(until), position, now)), Some(head)) = (row, head) else {
            return Ok(false);
        };
        let aggregate = head.aggregate_key();
        let clear = |error: Option<String>| {
            sqlx::query(
                "UPDATE parked_aggregates
                 SET release_requested_at = NULL,
                     held_until = CASE WHEN $6::text IS NULL THEN held_until END,
                     error = coalesce($6, error)
                 WHERE tenant_id = $1 AND consumer = $2 AND source = $3
                   AND aggregate_type = $4 AND aggregate_id = $5",
            )
            .bind(r.tenant_id)
            .bind(&self.config.name)
            .bind(&r.source)
            .bind(&r.aggregate_type)
            .bind(&r.aggregate_id)
            .bind(error)
        };
        match held_step(head.aggregate_seq, position, until, now) {
            Held::Replay => Ok(false),
            Held::ReplayOverGap => {
                metrics::counter!(crate::metrics::CONSUMER_GAPS_SKIPPED, "consumer" => self.config.name.clone())
                    .increment(1);
                tracing::warn!(consumer = %self.config.name, tenant_id = r.tenant_id, %aggregate, ?position,
                               next = ?head.aggregate_seq, "a number skipped did not come within the hold's bound; applying over the gap");
                Ok(false)
            }
            Held::Wait => {
                clear(None).execute(&mut **tx).await?;
                Ok(true)
            }
            Held::OutOfOrder => {
                let error = format!(
                    "out of order: event {} of {aggregate} arrived after event {} was applied",
                    head.aggregate_seq.unwrap_or_default(),
                    position.unwrap_or_default()
                );
                tracing::error!(consumer = %self.config.name, tenant_id = r.tenant_id, %aggregate, %error, "held aggregate parked");
                clear(Some(error)).execute(&mut **tx).await?;
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: Option<i64>) -> Envelope {
        Envelope {
            id: 40 + seq.unwrap_or(0),
            source: "orders".into(),
            tenant_id: 1,
            aggregate_type: "order".into(),
            aggregate_id: "7".into(),
            event_type: "OrderPlaced".into(),
            event_version: 1,
            occurred_at: Utc::now(),
            payload: serde_json::json!({}),
            aggregate_seq: seq,
        }
    }

    #[test]
    fn a_whole_subscription_holds_on_a_skipped_number_and_takes_it_when_it_comes() {
        let mut at = AggregateState::default();
        assert!(
            matches!(at.gate(&event(Some(2)), true), Gate::Hold(why) if why.contains("waiting for event 1"))
        );
        assert_eq!(at.gate(&event(Some(3)), true), Gate::Park(None));
        // The number waited for, and the one right after it, apply.
        assert_eq!(at.gate(&event(Some(1)), true), Gate::Apply);
        assert_eq!(at.last, Some(1));
        // Not the next: behind the held ones.
        assert_eq!(at.gate(&event(Some(4)), true), Gate::Park(None));
    }

    #[test]
    fn a_subscription_not_whole_applies_over_a_gap_as_before() {
        let mut at = AggregateState::default();
        assert_eq!(at.gate(&event(Some(2)), false), Gate::Apply);
        assert!(
            matches!(at.gate(&event(Some(1)), false), Gate::Park(Some(why)) if why.contains("out of order"))
        );
    }

    #[test]
    fn the_release_replays_a_held_aggregate_in_number_order_and_waits_at_a_gap() {
        let now = Utc::now();
        let later = now + chrono::Duration::seconds(30);
        assert_eq!(held_step(Some(2), Some(1), later, now), Held::Replay);
        assert_eq!(held_step(Some(3), Some(1), later, now), Held::Wait);
        assert_eq!(held_step(Some(3), Some(1), now, now), Held::ReplayOverGap);
        assert_eq!(held_step(Some(1), Some(1), later, now), Held::OutOfOrder);
        assert_eq!(held_step(Some(1), None, later, now), Held::Replay);
    }
}
