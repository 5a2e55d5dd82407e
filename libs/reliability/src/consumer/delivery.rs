//! The broker side: consuming in lanes, reconnecting, grouping waiting
//! deliveries, and handing each to its apply and settlement (`settle.rs`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use crate::broker;
use crate::failpoint;
use crate::outbox::Envelope;
use crate::supervise::supervise;
use crate::{Error, Result};

use super::gather::Joined;
use super::{Apply, Consumer, Lane, Outcome};

impl<A: Apply> Consumer<A> {
    /// Consumes until `shutdown`, reconnecting after broker or database
    /// outages. Stops between messages, never inside one. Returns an error
    /// only when a fail point fired (the simulated crash).
    ///
    /// Each lane has a connection of its own (docs/adr/0024): a channel's
    /// unacked deliveries go back to the queue, each counted toward its
    /// delivery limit, when that channel or its connection closes, so one
    /// lane's failure must close nothing the other lanes hold. (A channel
    /// per lane on one connection is not enough: lapin 4 turns a delivery
    /// that arrives on a channel the broker just closed into an error of
    /// the whole connection.)
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let lanes = self.config.lanes.max(1);
        let stop = shutdown.child_token();
        let release = async {
            if self.is_ordered() {
                A::release(self, &stop).await;
            }
        };
        // Every lane runs to its own end, closing its channel: a lane
        // future dropped half way (as a short-circuiting join would drop
        // the others when one fails) would drop its lapin consumers, and
        // so cancel them, before its connection closed (see `consume`).
        let lanes = futures_util::future::join_all((0..lanes).map(|index| {
            let stop = stop.clone();
            async move {
                let part = self.health_part(index);
                let what = format!("consumer {} lane {index} lost its broker", self.config.name);
                let r = supervise(&part, &what, &self.health, &stop, || async {
                    let r = self.run_lane(&stop, index).await;
                    if matches!(&r, Err(e) if !matches!(e, Error::FailPoint(_))) {
                        self.stats.lane_restarts.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!(crate::metrics::CONSUMER_LANE_RESTARTS, "consumer" => self.config.name.clone())
                            .increment(1);
                    }
                    r
                })
                .await;
                if r.is_err() {
                    // A simulated crash stops the process's every lane.
                    stop.cancel();
                }
                r
            }
        }));
        let (lanes, ()) = tokio::join!(
            async {
                let r = lanes.await;
                stop.cancel();
                r
            },
            release
        );
        lanes.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
    }

    /// One lane on a connection of its own until `stop` or a failure.
    async fn run_lane(&self, stop: &CancellationToken, index: usize) -> Result<()> {
        let name = format!("{}-consumer-{index}", self.config.name);
        let conn = broker::connect(&self.amqp_url, &name).await?;
        let result = self.consume(&conn, stop, Lane::new(index)).await;
        // Closing hands unacked deliveries back to the broker now rather than
        // at the heartbeat timeout; after a simulated crash too.
        let _ = broker::bounded(conn.close(200, "consumer lane stopped".into())).await;
        result
    }

    async fn consume(
        &self,
        conn: &lapin::Connection,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<()> {
        let channel = broker::bounded(conn.create_channel()).await?;
        broker::bounded(broker::declare_queue(&channel, &self.config.queue)).await?;
        broker::bounded(channel.basic_qos(self.config.prefetch, BasicQosOptions { global: false }))
            .await?;
        let mut streams = Vec::new();
        for queue in self.lane_queues(lane.index) {
            let tag = format!("{}-{}", self.config.name, uuid::Uuid::new_v4());
            streams.push(
                broker::bounded(channel.basic_consume(
                    queue.as_str().into(),
                    tag.as_str().into(),
                    BasicConsumeOptions {
                        no_local: false,
                        no_ack: false,    // ack only after the commit
                        exclusive: false, // lanes and replicas compete on the queue
                        nowait: false,
                    },
                    FieldTable::default(),
                ))
                .await?,
            );
        }
        // One stream for the lane: each queue's deliveries keep their order
        // in it, and one channel numbers them all, so a multiple ack still
        // settles only what this lane finished.
        let mut deliveries = futures_util::stream::select_all(streams);
        // Ready once consuming: on an ordered subscription, standing by.
        self.health.ready(&self.health_part(lane.index));
        tracing::info!(consumer = %self.config.name, queue = %self.config.queue.queue, lane = lane.index, "consumer connected");
        let result = self
            .deliver(conn, &channel, &mut deliveries, shutdown, lane)
            .await;
        // The channel closes while its consumers still exist, and only then
        // are they dropped. Dropping a lapin consumer first would cancel it
        // (basic.cancel), and a quorum queue keeps a cancelled consumer's
        // unacked deliveries checked out to it while it makes the next
        // single active consumer active at once: that one would take a
        // partition's later events before the earlier ones came back, out
        // of order (docs/adr/0028). A closed channel hands every unacked
        // delivery back in one step, ahead of anything the next consumer
        // is given. On an error the channel may be gone already.
        let _ = broker::bounded(channel.close(200, "consumer lane stopped".into())).await;
        drop(deliveries);
        result
    }

    /// The lane's loop: groups what is waiting, applies and settles it,
    /// until `shutdown` or a failure.
    async fn deliver(
        &self,
        conn: &lapin::Connection,
        channel: &lapin::Channel,
        deliveries: &mut futures_util::stream::SelectAll<lapin::Consumer>,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<()> {
        let mut gauges = tokio::time::interval(Duration::from_secs(2));
        let mut probe = None;
        loop {
            let delivery = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                _ = gauges.tick() => {
                    // A connection can die without the delivery stream ending:
                    // never sit on a dead channel.
                    if !channel.status().connected() || !conn.status().connected() {
                        return Err(Error::ChannelClosed("consumer channel"));
                    }
                    if lane.index == 0 {
                        self.refresh_depths(conn, &mut probe).await;
                    }
                    continue;
                }
                next = deliveries.next() => match next {
                    Some(d) => d?,
                    None => return Err(Error::ChannelClosed("consumer stream")),
                },
            };
            // Whatever else is already waiting joins it: one commit for all.
            let mut group = vec![delivery];
            while group.len() < self.config.batch_max {
                match deliveries.next().now_or_never() {
                    Some(Some(d)) => group.push(d?),
                    _ => break,
                }
            }
            self.count_redelivered(&group);
            if self
                .config
                .fail_points
                .check(failpoint::CONSUMER_LANE_CHANNEL)
                .is_err()
            {
                // A tag this channel never delivered: the broker closes it.
                let _ =
                    broker::bounded(channel.basic_ack(u64::MAX, BasicAckOptions::default())).await;
            }
            // A worn delivery is parked on its own, untried (settle.rs); a
            // handed-back one is tried alone, its try recorded (tries.rs).
            let alone = |d: &Delivery| self.worn(d).is_some() || self.handed_back(d);
            // A group of one goes the group's way too where lanes gather:
            // it may join another lane's transaction (gather.rs).
            let gathers = self.config.lanes > 1 && !self.config.gather_wait.is_zero();
            let carry_on = if (group.len() > 1 || gathers) && !group.iter().any(alone) {
                self.process_group(group, shutdown, lane).await?
            } else {
                self.process_each(group, shutdown, lane).await?
            };
            if !carry_on {
                return Ok(());
            }
        }
    }

    /// Handles one delivery to its end (acked or dead-lettered). Returns
    /// false if shutdown came while it waited to retry (left unacked: the
    /// broker redelivers it to the next consumer).
    async fn process(
        &self,
        delivery: Delivery,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        match self.parse(&delivery).await? {
            Some(event) => self.settle_traced(delivery, event, shutdown, lane).await,
            None => Ok(true),
        }
    }

    /// [`Self::process`] for each of `group` in turn, until one says stop.
    async fn process_each(
        &self,
        group: Vec<Delivery>,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        for delivery in group {
            if !self.process(delivery, shutdown, lane).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The envelope, or None once a malformed delivery is dead-lettered.
    async fn parse(&self, delivery: &Delivery) -> Result<Option<Envelope>> {
        match serde_json::from_slice(&delivery.data) {
            Ok(e) => Ok(Some(e)),
            Err(e) => {
                tracing::error!(consumer = %self.config.name, error = %e, "malformed message; dead-lettering");
                self.dead_letter(delivery, "malformed").await?;
                Ok(None)
            }
        }
    }

    /// Several waiting deliveries in one transaction, acked after its commit.
    /// If any fails, the group rolls back and each goes the one-at-a-time
    /// way with its own retries and dead-lettering.
    async fn process_group(
        &self,
        group: Vec<Delivery>,
        shutdown: &CancellationToken,
        lane: Lane,
    ) -> Result<bool> {
        let mut parsed = Vec::with_capacity(group.len());
        for delivery in group {
            if let Some(event) = self.parse(&delivery).await? {
                parsed.push((delivery, event));
            }
        }
        if parsed.is_empty() {
            return Ok(true);
        }
        match self.apply_gathered(parsed, lane).await? {
            Joined::Applied(parsed, outcomes) => {
                self.config
                    .fail_points
                    .check(failpoint::CONSUMER_AFTER_COMMIT)?;
                if self.lane_queues(lane.index).len() > 1 {
                    // Several partitions on one channel: their streams
                    // interleave out of delivery-tag order, so a multiple
                    // ack could settle a delivery not applied yet.
                    let acks: Vec<_> = parsed
                        .iter()
                        .map(|(delivery, _)| delivery.ack(BasicAckOptions { multiple: false }))
                        .collect();
                    let acked = broker::in_order(acks).map(Ok::<_, Error>);
                    for acked in broker::bounded(acked).await? {
                        acked?;
                    }
                } else {
                    // One ack for the group: every earlier delivery on this
                    // channel is settled already (a lane handles its
                    // deliveries in turn, and each lane has a channel of
                    // its own).
                    let (last, _) = parsed.last().expect("a group is never empty");
                    broker::bounded(last.ack(BasicAckOptions { multiple: true })).await?;
                }
                for ((_, event), outcome) in parsed.iter().zip(outcomes) {
                    self.count(event, outcome);
                    self.stats.grouped.fetch_add(1, Ordering::Relaxed);
                }
                Ok(true)
            }
            Joined::Crashed(name) => Err(Error::FailPoint(name)),
            Joined::Failed(parsed, e) => {
                tracing::debug!(consumer = %self.config.name, error = %e, size = parsed.len(), "group failed; applying one at a time");
                self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(crate::metrics::CONSUMER_GROUP_FALLBACKS, "consumer" => self.config.name.clone())
                    .increment(1);
                for (delivery, event) in parsed {
                    if !self.settle_traced(delivery, event, shutdown, lane).await? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }

    /// The queue and DLQ depth gauges, looked at on a channel of the lane's
    /// connection that consumes nothing (`probe`, opened again when a look
    /// closed it). A passive declare of a queue that is gone closes the
    /// channel it runs on: on the consuming channel, that handed the lane's
    /// prefetched deliveries back, each a step toward its dead letter.
    async fn refresh_depths(&self, conn: &lapin::Connection, probe: &mut Option<lapin::Channel>) {
        let channel = match probe.take().filter(|c| c.status().connected()) {
            Some(channel) => channel,
            None => match broker::bounded(conn.create_channel()).await {
                Ok(channel) => channel,
                Err(_) => return,
            },
        };
        let name = self.config.name.clone();
        let dlq = broker::dead_letter_queue(&self.config.queue.queue);
        if let Ok(depth) = broker::bounded(broker::queue_depth(&channel, &dlq)).await {
            metrics::gauge!(crate::metrics::CONSUMER_DLQ_DEPTH, "consumer" => name.clone())
                .set(f64::from(depth));
        }
        let mut ready = Some(0.0);
        for queue in self.config.queue.queues() {
            ready = match broker::bounded(broker::queue_depth(&channel, &queue)).await {
                Ok(depth) => ready.map(|n| n + f64::from(depth)),
                Err(_) => None,
            };
        }
        if let Some(ready) = ready {
            metrics::gauge!(crate::metrics::CONSUMER_QUEUE_DEPTH, "consumer" => name).set(ready);
        }
        *probe = Some(channel);
    }

    fn count_redelivered(&self, group: &[Delivery]) {
        let back = group.iter().filter(|d| d.redelivered).count() as u64;
        if back > 0 {
            self.stats.redelivered.fetch_add(back, Ordering::Relaxed);
            metrics::counter!(crate::metrics::CONSUMER_REDELIVERED, "consumer" => self.config.name.clone())
                .increment(back);
        }
    }

    /// Counts a finished delivery of `event`; an applied one also adds its
    /// age, from the event's `occurred_at` (the source's commit, give or
    /// take its clock) to now: how far behind its source this consumer is,
    /// in time, whatever the queue depth says.
    pub(super) fn count(&self, event: &Envelope, outcome: Outcome) {
        if outcome == Outcome::Applied {
            let age = (chrono::Utc::now() - event.occurred_at)
                .num_milliseconds()
                .max(0) as f64
                / 1000.0;
            metrics::histogram!(crate::metrics::CONSUMER_EVENT_AGE, "consumer" => self.config.name.clone())
                .record(age);
        }
        let (label, counter) = match outcome {
            Outcome::Applied => ("applied", &self.stats.applied),
            Outcome::Duplicate => ("duplicate", &self.stats.duplicates),
            Outcome::Parked => ("parked", &self.stats.parked),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metrics::CONSUMER_MESSAGES, "consumer" => self.config.name.clone(), "outcome" => label)
            .increment(1);
        metrics::gauge!(crate::metrics::CONSUMER_LAST_APPLIED, "consumer" => self.config.name.clone())
            .set(chrono::Utc::now().timestamp_millis() as f64 / 1000.0);
    }
}
