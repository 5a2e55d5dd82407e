//! Settling one delivery after its apply: acked, retried in place, parked
//! (ordered) or dead-lettered.

use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicRejectOptions};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::broker;
use crate::failpoint;
use crate::outbox::Envelope;
use crate::{Error, Result};

use super::apply::apply_span;
use super::{Apply, ApplyError, Consumer, HandlerError, Lane};

impl<A: Apply> Consumer<A> {
    /// [`Self::settle`] inside the delivery's consume span and trace step.
    pub(super) async fn settle_traced(
        &self,
        delivery: Delivery,
        event: Envelope,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        let step = apply_span(&self.config, &delivery, &event);
        let span = tracing::info_span!("consume", consumer = %self.config.name, message_id = %event.message_id(),
                                       event_type = %event.event_type, tenant_id = event.tenant_id, trace_id = %step.context().trace_id());
        step.run(self.settle(delivery, event, shutdown, lane))
            .instrument(span)
            .await
    }

    /// Applies, retries and finally acks or dead-letters one parsed delivery.
    pub(super) async fn settle(
        &self,
        delivery: Delivery,
        event: Envelope,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        let mut tries = 0;
        let mut outage_delay = Duration::from_millis(100);
        let alone = self.try_alone(&delivery).await;
        let mut worn = match self.worn(&delivery) {
            Some(worn) => Some(worn),
            None => self.crashed_on(&delivery, &event).await,
        };
        // Set aside without a retry: parked or dead-lettered now.
        let set_aside = worn.is_some();
        // A try ends when its outcome is decided and committed, before the
        // ack: a channel lost after the commit, or a shutdown, hands the
        // delivery back without the consumer having died on it (tries.rs).
        let settled = async || {
            if self.handed_back(&delivery) {
                A::forget_tries(self, &event).await;
            }
        };
        loop {
            let applied = match worn.take() {
                // Parked before it is tried again, not applied: it is not
                // given the chance to take its consumer down once more.
                Some(failure) => Err(ApplyError::Handler(failure)),
                None => {
                    let _others = match alone {
                        Some(_) => None,
                        None => Some(self.beside_others().await),
                    };
                    self.bounded(A::one(self, &event, lane)).await
                }
            };
            let failure = match applied {
                Ok(outcome) => {
                    settled().await;
                    self.config
                        .fail_points
                        .check(failpoint::CONSUMER_AFTER_COMMIT)?;
                    broker::bounded(delivery.ack(BasicAckOptions { multiple: false })).await?;
                    self.count(&event, outcome);
                    return Ok(true);
                }
                Err(ApplyError::FailPoint(name)) => return Err(Error::FailPoint(name)),
                Err(ApplyError::Handler(e)) => e,
            };
            let wait = match &failure {
                e if e.is_permanent() => None,
                _ if set_aside => None,
                HandlerError::Unavailable(_) => {
                    outage_delay = (outage_delay * 2).min(Duration::from_secs(5));
                    Some(outage_delay)
                }
                HandlerError::Database(e) if crate::db::is_retryable_at_no_cost(e) => {
                    outage_delay = (outage_delay * 2).min(Duration::from_secs(5));
                    Some(outage_delay)
                }
                HandlerError::Reliability(e) if e.is_retryable_at_no_cost() => {
                    outage_delay = (outage_delay * 2).min(Duration::from_secs(5));
                    Some(outage_delay)
                }
                _ => {
                    tries += 1;
                    (tries < self.config.max_attempts).then(|| self.config.retry_delay * tries)
                }
            };
            let Some(wait) = wait else {
                if self.is_ordered() {
                    // Its aggregate waits; the partition's others go on.
                    let outcome = match self.bounded(A::park(self, &event, &failure, lane)).await {
                        Ok(outcome) => outcome,
                        Err(ApplyError::FailPoint(name)) => return Err(Error::FailPoint(name)),
                        // Not parked, not acked: the lane reconnects and
                        // the broker hands the event back.
                        Err(ApplyError::Handler(HandlerError::Database(e))) => {
                            return Err(Error::Database(e));
                        }
                        Err(ApplyError::Handler(e)) => {
                            return Err(Error::Upstream(format!("cannot park: {e}")));
                        }
                    };
                    settled().await;
                    broker::bounded(delivery.ack(BasicAckOptions { multiple: false })).await?;
                    self.count(&event, outcome);
                    return Ok(true);
                }
                tracing::error!(consumer = %self.config.name, message_id = %event.message_id(), error = %failure, tries, "handler failed for good; dead-lettering");
                let reason = if set_aside {
                    "crashed_its_consumer"
                } else {
                    "handler_failed"
                };
                A::record_cause(self, &event, reason, &failure).await;
                settled().await;
                self.dead_letter(&delivery, reason).await?;
                return Ok(true);
            };
            tracing::warn!(consumer = %self.config.name, message_id = %event.message_id(), error = %failure, retry_in = ?wait, "handler failed; retrying");
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::metrics::CONSUMER_RETRIES, "consumer" => self.config.name.clone())
                .increment(1);
            tokio::select! {
                () = shutdown.cancelled() => {
                    settled().await;
                    return Ok(false);
                }
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// For a delivery of an ordered subscription handed back by the broker
    /// [`worn_after`] times or more (its consumer crashed, froze past the
    /// broker's timeout or lost its channel each time it held it): the
    /// failure it parks with. Parked on the count, before the queue's
    /// delivery limit would dead-letter it, because a dead letter on an
    /// ordered partition is a gap that the aggregate's later events would
    /// be applied over (docs/adr/0028, amended in session 27).
    pub(super) fn worn(&self, delivery: &Delivery) -> Option<HandlerError> {
        let spec = &self.config.queue;
        let returns = broker::returns(&delivery.properties);
        (spec.is_ordered() && returns >= worn_after(spec.delivery_limit)).then(|| {
            HandlerError::Transient(
                format!(
                    "handed back {returns} times unsettled (its consumer crashed, froze or lost its \
                     channel each time): parked before the queue's delivery limit ({}) would \
                     dead-letter it",
                    spec.delivery_limit
                )
                .into(),
            )
        })
    }

    /// `apply`, given up after the consumer's `apply_bound`: dropped, it
    /// rolls back, and its connection, unless it answers within the pool's
    /// release bound, is closed (`db::pool_options`). The try it cost is
    /// counted like any other failure's: a handler slower than the bound
    /// every time is parked or dead-lettered, not retried forever.
    pub(super) async fn bounded<T>(
        &self,
        apply: impl Future<Output = Result<T, ApplyError>>,
    ) -> Result<T, ApplyError> {
        let bound = self.config.apply_bound;
        tokio::time::timeout(bound, apply)
            .await
            .unwrap_or_else(|_| {
                Err(ApplyError::Handler(HandlerError::Transient(
                    format!(
                        "no answer from the database within {bound:?}; its connection is dropped"
                    )
                    .into(),
                )))
            })
    }

    pub(super) async fn dead_letter(
        &self,
        delivery: &Delivery,
        reason: &'static str,
    ) -> Result<()> {
        broker::bounded(delivery.reject(BasicRejectOptions { requeue: false })).await?;
        self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metrics::CONSUMER_DEAD_LETTERED, "consumer" => self.config.name.clone(), "reason" => reason)
            .increment(1);
        Ok(())
    }
}

/// The returns after which an ordered subscription's delivery is parked
/// rather than tried: half the queue's delivery limit. The other half is
/// the margin for a park that cannot commit (the database away too while
/// the lane dies again); a park that fails waits in place at no cost, so
/// only a lane that dies again returns it.
pub(super) fn worn_after(delivery_limit: u32) -> i64 {
    i64::from(delivery_limit / 2).max(1)
}
