//! Claiming due rows, publishing them with confirms (one batch, or a
//! window of batches in flight), and recording what the confirms say.

use std::collections::VecDeque;

use crate::Result;
use crate::broker::{Outgoing, PublishFailure, Publisher};
use crate::failpoint;
use crate::trace::Span;

use super::record::{defer, mark_processed, move_to_dlq, schedule_retry};
use super::{BatchReport, InFlight, Relay, order};

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
        Ok(self
            .window_pass(publisher, usize::MAX, Claims::Due)
            .await?
            .0)
    }

    /// Claims, publishes and marks the rows of `ids` still unpublished and
    /// due (the log relay's: the ids a log of the outbox's commits showed
    /// it), `batch_size` a batch, with the window of batches in flight.
    /// Rows published already, or held by another relay, are left alone:
    /// naming a row twice publishes it once. Rows it leaves (held back,
    /// unconfirmed, or not claimed once the broker blocked or failed to
    /// confirm) stay pending, for the polling sweep.
    #[tracing::instrument(skip_all, fields(source = %self.config.source, named = ids.len()))]
    pub async fn relay_ids(&self, publisher: &Publisher, ids: &[i64]) -> Result<BatchReport> {
        let batch = usize::try_from(self.config.batch_size).unwrap_or(1).max(1);
        let claims = Claims::Named(ids.chunks(batch).peekable());
        Ok(self.window_pass(publisher, usize::MAX, claims).await?.0)
    }

    /// [`Relay::relay_window`] over `claims`, claiming at most
    /// `max_batches`; and whether more may be due (it stopped at the
    /// limit, not for lack of rows).
    pub(super) async fn window_pass(
        &self,
        publisher: &Publisher,
        max_batches: usize,
        mut claims: Claims<'_>,
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
                if claims.exhausted() {
                    more = false;
                    break;
                }
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
                let named = claims.next();
                let batch = self.claim_and_send(tx, publisher, named).await?;
                more = claims.more(batch.as_ref().map(|b| b.claimed), self.config.batch_size);
                if let Some(batch) = batch {
                    claimed += 1;
                    window.push_back(batch);
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
}

/// What a window claims: the due rows, or the named ones a batch at a time.
pub(super) enum Claims<'a> {
    Due,
    Named(std::iter::Peekable<std::slice::Chunks<'a, i64>>),
}

impl<'a> Claims<'a> {
    /// No named batch is left (the due rows are never exhausted up front).
    fn exhausted(&mut self) -> bool {
        match self {
            Self::Due => false,
            Self::Named(chunks) => chunks.peek().is_none(),
        }
    }

    /// The next batch's ids; `None` for the due rows.
    fn next(&mut self) -> Option<&'a [i64]> {
        match self {
            Self::Due => None,
            Self::Named(chunks) => chunks.next(),
        }
    }

    /// Whether to claim again after a batch that claimed `claimed` rows:
    /// the due rows while a batch comes back full, named ones while any
    /// batch of them is left (a batch of rows all published already
    /// claims none).
    fn more(&mut self, claimed: Option<usize>, batch_size: i64) -> bool {
        match self {
            Self::Due => claimed.is_some_and(|n| n as i64 == batch_size),
            Self::Named(chunks) => chunks.peek().is_some(),
        }
    }
}
