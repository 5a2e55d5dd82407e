//! Which handed-back delivery takes its consumer down.
//!
//! A consumer that dies holding deliveries (a crash, a freeze past the
//! broker's timeout) has all of them handed back, and the broker counts a
//! return for each: the event it died on, and every event prefetched
//! behind it, never tried. Counted by returns, a few crashes on one event
//! park (ordered) or dead-letter (order-free) its healthy neighbours too.
//! So a handed-back delivery is tried alone, after one more try of it is
//! recorded and committed (`consumer_tries`): the event the consumer keeps
//! dying on is the one whose tries grow, and it is parked or dead-lettered
//! at [`CRASH_TRIES`], while its neighbours' returns are still below the
//! returns' bound (`settle::worn_after`), which stays for the deaths no try
//! explains (a channel lost, again and again).
//!
//! A copy of the event (a relay publishes again what it cannot prove
//! confirmed) carries the same id and its own returns: tries of copies
//! handed back together add up without a death, so a copy is set aside
//! only when its own returns say it came back as often (in `make e2e`, two
//! copies of an order's event, handed back when a quorum came back, were
//! dead-lettered beside the copy that was applied; session 30).
//!
//! A handed-back delivery's try, from its record to its end, runs beside
//! no other handler run of its consumer (`Consumer::tries_alone`): lanes
//! restart together after a death, and a neighbour tried in another lane
//! while the culprit took the process down again was counted a death too,
//! three restarts running, and parked beside it (`make e2e`'s "worn"
//! scenario, session 43's rehearsal). Deaths are rare; a crash's
//! handed-back deliveries are then tried one at a time across the lanes.
//! Another consumer of the same process can still be wronged so (the
//! views beside the history): one lock for the whole process stalled the
//! ordered scenarios of session 44's rehearsal, and is not the way.
//!
//! A try ends, and its record is forgotten, once its outcome is committed
//! (applied, a duplicate, parked) or decided (a dead letter, a shutdown),
//! before the ack: a try counts only when its consumer died between the
//! record and the commit. An ack lost with its channel after the commit
//! (a broker node going, again and again) is not a death on the event;
//! counted as one, it dead-lettered an applied event (e2e, session 30).

use lapin::message::Delivery;

use crate::broker;
use crate::outbox::Envelope;
use crate::{TenantId, TenantTx};

use super::{Apply, Consumer, Handler, HandlerError, Pg};

/// Tries of a handed-back event recorded (after its first, in a group or
/// alone, which nothing records), each ended by its consumer's death,
/// after which it is parked or dead-lettered untried: it is then handed
/// back for the third time, below half the queues' delivery limit (10),
/// so the events handed back with it each time are not worn.
pub const CRASH_TRIES: i32 = 2;

impl<A: Apply> Consumer<A> {
    /// Whether `delivery` was handed back by the broker: it is applied
    /// alone, after its try is recorded (not in a group).
    pub(super) fn handed_back(&self, delivery: &Delivery) -> bool {
        broker::returns(&delivery.properties) > 0 && A::COUNTS_TRIES
    }

    /// The guard a handler's run holds: beside other lanes' runs, never
    /// beside a handed-back delivery's try. (A guard, not a wrapper of the
    /// run's future: wrapped, the lanes' futures grew past a debug build's
    /// test thread stack.)
    pub(super) async fn beside_others(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.tries_alone.read().await
    }

    /// For a handed-back delivery, the guard its try holds from its record
    /// to its end: every other handler run of this consumer waits meanwhile.
    pub(super) async fn try_alone(
        &self,
        delivery: &Delivery,
    ) -> Option<tokio::sync::RwLockWriteGuard<'_, ()>> {
        match self.handed_back(delivery) {
            true => Some(self.tries_alone.write().await),
            false => None,
        }
    }

    /// For a handed-back delivery: records one more try, and returns the
    /// failure it is set aside with when its earlier tries each ended in
    /// its consumer's death. A try that cannot be recorded (the database
    /// away) is tried anyway: the returns' bound still holds.
    pub(super) async fn crashed_on(
        &self,
        delivery: &Delivery,
        event: &Envelope,
    ) -> Option<HandlerError> {
        if !self.handed_back(delivery) {
            return None;
        }
        // The tries are the event's, counted over every copy of it (a
        // relay's re-publish is another message with the same id): copies
        // handed back at once are tried side by side, each adding one. Only
        // a copy handed back as often itself is one its consumer died on.
        let returns = broker::returns(&delivery.properties);
        let died_each_time = |tries| tries > CRASH_TRIES && returns > i64::from(CRASH_TRIES);
        match A::record_try(self, event).await {
            Ok(tries) if died_each_time(tries) => Some(HandlerError::Transient(
                format!(
                    "its consumer died each of the {tries} times it was tried (a crash, or a freeze \
                     past the broker's timeout): set aside untried"
                )
                .into(),
            )),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(consumer = %self.config.name, message_id = %event.message_id(), error = %e, "could not record a try; trying anyway");
                None
            }
        }
    }
}

impl<H: Handler> Consumer<Pg<H>> {
    /// One more try of `event`, committed on its own: the tries so far,
    /// this one included.
    pub(super) async fn record_try_pg(&self, event: &Envelope) -> crate::Result<i32> {
        let tenant = TenantId::new(event.tenant_id)?;
        let mut tx = TenantTx::begin(&self.state.pool, tenant).await?;
        let tries = sqlx::query_scalar(
            "INSERT INTO consumer_tries (tenant_id, consumer, source, message_id)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (tenant_id, consumer, source, message_id)
             DO UPDATE SET tries = consumer_tries.tries + 1, tried_at = now()
             RETURNING tries",
        )
        .bind(tenant.get())
        .bind(&self.config.name)
        .bind(&event.source)
        .bind(event.id)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(tries)
    }

    /// Forgets `event`'s tries once it is settled (applied, parked or
    /// dead-lettered). Best effort: a row left behind is forgotten by the
    /// next settle of that event, or never read again.
    pub(super) async fn forget_tries_pg(&self, event: &Envelope) {
        let Ok(tenant) = TenantId::new(event.tenant_id) else {
            return;
        };
        let forget = async {
            let mut tx = TenantTx::begin(&self.state.pool, tenant).await?;
            sqlx::query(
                "DELETE FROM consumer_tries
                 WHERE tenant_id = $1 AND consumer = $2 AND source = $3 AND message_id = $4",
            )
            .bind(tenant.get())
            .bind(&self.config.name)
            .bind(&event.source)
            .bind(event.id)
            .execute(&mut *tx)
            .await?;
            tx.commit().await
        };
        if let Err(e) = forget.await {
            tracing::debug!(consumer = %self.config.name, error = %e, "could not forget a settled event's tries");
        }
    }
}
