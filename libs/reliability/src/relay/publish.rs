//! Claiming due rows, publishing them with confirms (one batch, or a
//! window of batches in flight), and recording what the confirms say.

use std::collections::VecDeque;

use serde_json::Value;

use crate::Result;
use crate::broker::{self, Outgoing, PublishFailure, Publisher};
use crate::failpoint;
use crate::outbox::Envelope;
use crate::trace::{Kind, Span, TraceContext};

use super::record::{defer, mark_processed, move_to_dlq, schedule_retry};
use super::{BatchReport, Claimed, InFlight, Relay, order};

/// How long the window waits to open a connection for its next batch.
/// PostgreSQL opens one in milliseconds; longer means the pool's last slot
/// was taken meanwhile (another relay), and settling comes first.
const OPEN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Relay {
    /// Claims, publishes and marks one batch of due rows.
    #[tracing::instrument(skip_all, fields(source = %self.config.source))]
    pub async fn relay_batch(&self, publisher: &Publisher) -> Result<BatchReport> {
        // A queue deleted since the publisher opened would silently miss
        // these events (the others' queues still take them, so nothing is
        // returned): check first; the reconnect declares it again.
        publisher.require_queues(&self.config.topology).await?;
        let tx = self.pool.begin().await?;
        match self.claim_and_send(tx, publisher, None).await? {
            Some(batch) => self.settle(batch).await,
            None => Ok(BatchReport::default()),
        }
    }

    /// Claims, publishes and marks the rows of `ids` still unpublished and
    /// due, as one batch (the log relay's: the ids a log of the outbox's
    /// commits showed it). Rows published already, or held by another
    /// relay, are left alone: naming a row twice publishes it once.
    #[tracing::instrument(skip_all, fields(source = %self.config.source, named = ids.len()))]
    pub async fn relay_ids(&self, publisher: &Publisher, ids: &[i64]) -> Result<BatchReport> {
        publisher.require_queues(&self.config.topology).await?;
        let tx = self.pool.begin().await?;
        match self.claim_and_send(tx, publisher, Some(ids)).await? {
            Some(batch) => self.settle(batch).await,
            None => Ok(BatchReport::default()),
        }
    }

    /// Claims a batch in `tx` (which stays open, holding the rows): the
    /// due rows, or the `named` ones; and publishes it without waiting for
    /// the confirms. None: nothing to publish.
    async fn claim_and_send(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        publisher: &Publisher,
        named: Option<&[i64]>,
    ) -> Result<Option<InFlight>> {
        let keeps_order = self.keeps_order();
        let mut rows = self.claim(&mut tx, named).await?;
        let claimed = rows.len();
        let mut held = 0;
        if keeps_order && !rows.is_empty() {
            held = order::number(&mut tx, &mut rows).await?;
        }
        if claimed == 0 {
            tx.commit().await?;
            return Ok(None);
        }
        self.config
            .fail_points
            .check(failpoint::RELAY_BEFORE_PUBLISH)?;
        let (outgoing, steps): (Vec<Outgoing>, Vec<Option<Span>>) = rows
            .iter()
            .map(|r| self.outgoing(r))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let sent = publisher.send(&outgoing).await;
        Ok(Some(InFlight {
            tx,
            rows,
            sent,
            steps,
            claimed,
            held,
        }))
    }

    /// Awaits a sent batch's confirms and records what they say: confirmed
    /// rows processed, refused ones backed off (or moved to the DLQ table),
    /// unconfirmed ones left as they were. Then commits, releasing the rows.
    async fn settle(&self, batch: InFlight) -> Result<BatchReport> {
        let InFlight {
            mut tx,
            rows,
            sent,
            mut steps,
            held,
            ..
        } = batch;
        let results = sent.settle().await;
        for (step, result) in steps.iter_mut().zip(&results) {
            if let (Some(step), Err(e)) = (step, result) {
                step.fail(e);
            }
        }
        drop(steps);

        // The broker has the messages; a crash from here to the commit means
        // they are published again (I1 says at least once; consumers dedup).
        self.config
            .fail_points
            .check(failpoint::RELAY_AFTER_CONFIRM)?;

        let mut done = Vec::new();
        let (mut failed_ids, mut failed_errors) = (Vec::new(), Vec::new());
        let mut unconfirmed = 0;
        let (mut deferred_ids, mut deferred_errors) = (Vec::new(), Vec::new());
        for (row, result) in rows.iter().zip(results) {
            match result {
                Ok(()) => done.push(row.id),
                Err(e @ PublishFailure::Nacked) => {
                    // The queue could not take it now; the connection is
                    // fine and the other queues flow: due again later, no
                    // attempt spent.
                    tracing::debug!(outbox_id = row.id, event_type = %row.event_type, "broker nacked: deferred, no attempt spent");
                    deferred_ids.push(row.id);
                    deferred_errors.push(e.to_string());
                }
                Err(e) if !e.is_refusal() => {
                    // Says nothing about the row: it stays as it was, due.
                    unconfirmed += 1;
                    tracing::debug!(outbox_id = row.id, error = %e, "not confirmed; left pending");
                }
                Err(e) => {
                    tracing::warn!(outbox_id = row.id, event_type = %row.event_type, error = %e, "publish failed");
                    metrics::counter!(crate::metrics::OUTBOX_PUBLISH_FAILURES, "source" => self.config.source.clone(), "event_type" => row.event_type.clone())
                        .increment(1);
                    failed_ids.push(row.id);
                    failed_errors.push(e.to_string());
                }
            }
        }

        mark_processed(&mut tx, &done).await?;
        if !deferred_ids.is_empty() {
            // Once per batch: a queue without its quorum nacks every row.
            tracing::warn!(
                count = deferred_ids.len(),
                "broker nacked rows (a queue could not take them): deferred, no attempt spent"
            );
            defer(
                &mut tx,
                &deferred_ids,
                &deferred_errors,
                self.config.backoff_step,
            )
            .await?;
        }
        let dead_lettered = if failed_ids.is_empty() {
            0
        } else {
            let moved = move_to_dlq(
                &mut tx,
                &failed_ids,
                &failed_errors,
                self.config.max_attempts,
            )
            .await?;
            schedule_retry(&mut tx, &failed_ids, &failed_errors, &self.config).await?;
            moved
        };
        tx.commit().await?;

        metrics::counter!(crate::metrics::OUTBOX_PUBLISHED, "source" => self.config.source.clone())
            .increment(done.len() as u64);
        if dead_lettered > 0 {
            tracing::error!(
                count = dead_lettered,
                "outbox rows moved to the DLQ table after too many attempts"
            );
        }
        if unconfirmed + deferred_ids.len() > 0 {
            metrics::counter!(crate::metrics::OUTBOX_UNCONFIRMED, "source" => self.config.source.clone())
                .increment((unconfirmed + deferred_ids.len()) as u64);
        }
        Ok(BatchReport {
            claimed: rows.len(),
            published: done.len(),
            failed: failed_ids.len(),
            dead_lettered,
            unconfirmed,
            deferred: deferred_ids.len(),
            held,
        })
    }

    /// Keeps the broker busy across batches: up to `batches_in_flight`
    /// batches are claimed and published while the oldest one's confirms are
    /// awaited, and each is marked as its confirms arrive, oldest first (so
    /// a returned message is always matched to its row, see
    /// [`crate::broker::Sent::settle`]). Returns when nothing more is due
    /// and every batch is settled.
    pub async fn relay_window(&self, publisher: &Publisher) -> Result<BatchReport> {
        Ok(self.window_pass(publisher, usize::MAX).await?.0)
    }

    /// [`Relay::relay_window`], claiming at most `max_batches`; and whether
    /// more may be due (it stopped at the limit, not for lack of rows).
    pub(super) async fn window_pass(
        &self,
        publisher: &Publisher,
        max_batches: usize,
    ) -> Result<(BatchReport, bool)> {
        let mut total = BatchReport::default();
        let mut window: VecDeque<InFlight> = VecDeque::new();
        let (mut more, mut claimed) = (true, 0);
        loop {
            if claimed >= max_batches && more {
                more = false;
                if window.is_empty() {
                    return Ok((total, true));
                }
            }
            if more && publisher.is_blocked() {
                // Its calls would wait on the alarm: settle, then the loop
                // waits for the unblock (relay::run).
                more = false;
            }
            if more {
                publisher.require_queues(&self.config.topology).await?;
            }
            while more
                && window.len() < self.config.batches_in_flight.max(1)
                && claimed < max_batches
            {
                // With batches in flight, never wait for a connection: the
                // pool may be full of our own (or other relays') claims,
                // released only as their confirms settle. Settle first.
                let tx = if window.is_empty() {
                    self.pool.begin().await?
                } else {
                    match self.pool.try_begin().await? {
                        Some(tx) => tx,
                        // No idle connection, but room for one (the idle
                        // ones were reaped, or never opened): open it rather
                        // than shrink the window to one batch. Bounded: a
                        // slot taken meanwhile must not hold our settling up.
                        None if self.pool.size() < self.pool.options().get_max_connections() => {
                            match tokio::time::timeout(OPEN_WAIT, self.pool.begin()).await {
                                Ok(tx) => tx?,
                                Err(_) => break,
                            }
                        }
                        None => break,
                    }
                };
                match self.claim_and_send(tx, publisher, None).await? {
                    Some(batch) => {
                        more = batch.claimed as i64 == self.config.batch_size;
                        claimed += 1;
                        window.push_back(batch);
                    }
                    None => more = false,
                }
            }
            let Some(oldest) = window.pop_front() else {
                let at_limit = claimed >= max_batches && total.unconfirmed == 0;
                return Ok((total, at_limit));
            };
            let report = self.settle(oldest).await?;
            total.add(report);
            if report.unconfirmed > 0 {
                // Blocked or gone: claim nothing more before what is in
                // flight has settled.
                more = false;
            }
        }
    }

    /// Relays until none is due, with the window of batches in flight. For
    /// tests and one-shot tools.
    pub async fn drain(&self, publisher: &Publisher) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        loop {
            let report = self.relay_window(publisher).await?;
            total.add(report);
            if report.claimed == 0 || report.published == 0 || report.unconfirmed > 0 {
                return Ok(total);
            }
        }
    }

    /// The message for `row`, and when the row is traced, the publish step
    /// whose `traceparent` the message carries instead of the enqueue's.
    fn outgoing(&self, row: &Claimed) -> Result<(Outgoing, Option<Span>)> {
        let envelope = Envelope {
            id: row.id,
            source: self.config.source.clone(),
            tenant_id: row.tenant_id,
            aggregate_type: row.aggregate_type.clone(),
            aggregate_id: row.aggregate_id.clone(),
            event_type: row.event_type.clone(),
            event_version: row.event_version,
            occurred_at: row.occurred_at,
            payload: row.payload.clone(),
            aggregate_seq: row.aggregate_seq,
        };
        let mut headers = match &row.headers {
            Value::Object(map) => map.clone(),
            _ => Default::default(),
        };
        headers.extend(cloud_event_attributes(&envelope));
        // What an ordered subscription's partition is chosen by.
        headers.insert(
            broker::PARTITION_HEADER.to_owned(),
            Value::String(format!(
                "{}/{}",
                envelope.tenant_id,
                envelope.aggregate_key()
            )),
        );
        // The state rides on unchanged among the headers.
        let state = headers
            .get(crate::trace::STATE_HEADER)
            .and_then(Value::as_str);
        let parent = headers
            .get(crate::trace::HEADER)
            .and_then(Value::as_str)
            .and_then(|parent| TraceContext::parse_with_state(parent, state));
        let step = parent.map(|parent| {
            let mut step = Span::start(
                &self.config.source,
                format!("publish {}", row.event_type),
                Kind::Producer,
                Some(parent),
            );
            step.set("messaging.system", "rabbitmq");
            step.set("messaging.destination.name", self.config.exchange.clone());
            step.set("messaging.message.id", envelope.message_id());
            headers.insert(
                crate::trace::HEADER.to_owned(),
                Value::String(step.context().to_header()),
            );
            step
        });
        let message = Outgoing {
            routing_key: envelope.routing_key(),
            message_id: envelope.message_id(),
            kind: envelope.event_type.clone(),
            headers: broker::headers_from_json(&headers),
            body: serde_json::to_vec(&envelope)?,
        };
        Ok((message, step))
    }
}

/// The CloudEvents 1.0 attributes of `e` as `ce-` headers: the binary
/// content mode (the body is the envelope, `content-type` the AMQP
/// property), so any CloudEvents consumer can route and read it. `id` is
/// unique per source, as the spec asks; `tenantid` is an extension.
fn cloud_event_attributes(e: &Envelope) -> serde_json::Map<String, Value> {
    [
        ("ce-specversion", "1.0".to_owned()),
        ("ce-id", e.message_id()),
        ("ce-source", format!("/commerce/{}", e.source)),
        ("ce-type", e.event_type.clone()),
        ("ce-time", e.occurred_at.to_rfc3339()),
        (
            "ce-subject",
            format!("{}/{}", e.aggregate_type, e.aggregate_id),
        ),
        ("ce-dataversion", e.event_version.to_string()),
        ("ce-tenantid", e.tenant_id.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), Value::String(v)))
    .collect()
}
