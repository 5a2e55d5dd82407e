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
        loop {
            let failure = match self.bounded(A::one(self, &event, lane)).await {
                Ok(outcome) => {
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
                    broker::bounded(delivery.ack(BasicAckOptions { multiple: false })).await?;
                    self.count(&event, outcome);
                    return Ok(true);
                }
                tracing::error!(consumer = %self.config.name, message_id = %event.message_id(), error = %failure, tries, "handler failed for good; dead-lettering");
                self.dead_letter(&delivery, "handler_failed").await?;
                return Ok(true);
            };
            tracing::warn!(consumer = %self.config.name, message_id = %event.message_id(), error = %failure, retry_in = ?wait, "handler failed; retrying");
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::metrics::CONSUMER_RETRIES, "consumer" => self.config.name.clone())
                .increment(1);
            tokio::select! {
                () = shutdown.cancelled() => return Ok(false),
                () = tokio::time::sleep(wait) => {}
            }
        }
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
