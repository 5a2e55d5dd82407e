//! The relay's loop: LISTEN/NOTIFY with a polling fallback, reconnects,
//! and the outbox gauges (per source and per tenant).

use std::time::{Duration, Instant};

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::broker::Publisher;
use crate::supervise::supervise;
use crate::{Error, Result};

/// How soon a relay that held rows back (docs/adr/0028) looks again.
const HELD_RETRY: Duration = Duration::from_millis(20);

use super::publish::Claims;
use super::{HEALTH_PART, NOTIFY_CHANNEL, Relay, TENANT_LAG, TENANT_PENDING, TOP_TENANTS};

impl Relay {
    /// Runs until `shutdown`: wakes on every outbox commit (LISTEN/NOTIFY),
    /// polls as a fallback, reconnects to the broker and the database after
    /// either goes away. Returns an error only when a fail point fired.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let what = "relay lost its broker or database";
        supervise(HEALTH_PART, what, &self.health, &shutdown, || {
            self.run_connected(&shutdown)
        })
        .await
    }

    async fn run_connected(&self, shutdown: &CancellationToken) -> Result<()> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        let publisher = self.publisher().await?;
        self.health.ready(HEALTH_PART);
        tracing::info!(source = %self.config.source, exchange = %self.config.exchange, "relay connected");
        let result = self.serve(&publisher, &mut listener, shutdown).await;
        if result.is_err() && publisher.is_blocked() {
            // Whatever failed, a blocked connection is not left behind with
            // publishes queued in it: the next one would queue them again.
            self.wait_unblocked(&publisher, shutdown).await?;
        }
        result
    }

    async fn serve(
        &self,
        publisher: &Publisher,
        listener: &mut PgListener,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let mut gauges_at = Instant::now() - Duration::from_secs(60);
        let mut tenants_at = gauges_at;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            if publisher.is_blocked() && !self.wait_unblocked(publisher, shutdown).await? {
                return Ok(());
            }
            // Bounded, so that gauges and shutdown get their turn under load.
            let (report, more_due) = self.window_pass(publisher, 64, Claims::Due).await?;
            if !publisher.is_usable() {
                return Err(Error::ChannelClosed("publisher channel"));
            }
            if report.unconfirmed > 0 && !publisher.is_blocked() {
                // Confirms that never came on a connection not blocked: it
                // may be half dead. Back off and try a fresh one; the rows
                // wait, costing no attempt. (Blocked: the loop waits above.)
                return Err(Error::BrokerTimeout(self.config.confirm_timeout));
            }
            if gauges_at.elapsed() >= Duration::from_secs(1) {
                self.update_gauges().await?;
                gauges_at = Instant::now();
            }
            // Counting every pending row is a scan of the backlog: less often.
            if tenants_at.elapsed() >= Duration::from_secs(10) {
                self.update_tenant_view().await?;
                tenants_at = Instant::now();
            }
            if more_due {
                continue;
            }
            // Rows held back behind another batch go as soon as it is
            // marked, which notifies no one: look again shortly.
            let wait = if report.held > 0 {
                self.config.poll_interval.min(HELD_RETRY)
            } else {
                self.config.poll_interval
            };
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                n = listener.recv(), if self.config.listens => { n?; }
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Waits on the blocked connection until the broker unblocks it
    /// (docs/adr/0025), claiming nothing. What lapin queued in it goes out
    /// then, once; a new connection would queue a second copy of the window
    /// beside it, and the blocked one cannot even send its close. The wait
    /// is the alarm's own length: nothing can be published meanwhile on
    /// any connection. It ends early if the connection is lost (an error:
    /// reconnect) or at shutdown (false). Logs every 30 s.
    async fn wait_unblocked(
        &self,
        publisher: &Publisher,
        shutdown: &CancellationToken,
    ) -> Result<bool> {
        let started = Instant::now();
        let blocked = metrics::gauge!(crate::metrics::OUTBOX_BROKER_BLOCKED, "source" => self.config.source.clone());
        blocked.set(1.0);
        self.health.not_ready(
            HEALTH_PART,
            "the broker blocked publishing (a memory or disk alarm)",
        );
        tracing::warn!(source = %self.config.source, "the broker blocked the relay's connection (a memory or disk alarm); waiting on it, claiming nothing");
        let mut said = Instant::now();
        let outcome = loop {
            if !publisher.is_blocked() {
                break Ok(true);
            }
            if !publisher.is_connected() {
                break Err(Error::ChannelClosed("blocked broker connection"));
            }
            if said.elapsed() >= Duration::from_secs(30) {
                tracing::warn!(source = %self.config.source, blocked_for = ?started.elapsed(), "the broker still blocks publishing");
                said = Instant::now();
            }
            tokio::select! {
                () = shutdown.cancelled() => break Ok(false),
                () = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
        };
        blocked.set(0.0);
        if matches!(outcome, Ok(true)) {
            tracing::info!(source = %self.config.source, blocked_for = ?started.elapsed(), "the broker unblocked the relay's connection");
            self.health.ready(HEALTH_PART);
        }
        outcome
    }

    /// `outbox_lag_seconds` (age of the oldest pending row), `outbox_dlq_depth`
    /// and `outbox_max_attempts` (most failures of a row still pending).
    pub async fn update_gauges(&self) -> Result<()> {
        let (lag, dlq, attempts): (f64, i64, i32) = sqlx::query_as(
            "SELECT COALESCE((SELECT EXTRACT(EPOCH FROM now() - occurred_at)::float8
                              FROM outbox_messages WHERE processed_at IS NULL
                              ORDER BY id LIMIT 1), 0),
                    (SELECT count(*) FROM outbox_messages_dlq),
                    COALESCE((SELECT max(attempts) FROM outbox_messages WHERE processed_at IS NULL AND attempts > 0), 0)",
        )
        .fetch_one(&self.pool)
        .await?;
        metrics::gauge!("outbox_max_attempts", "source" => self.config.source.clone())
            .set(f64::from(attempts));
        metrics::gauge!("outbox_lag_seconds", "source" => self.config.source.clone()).set(lag);
        metrics::gauge!("outbox_dlq_depth", "source" => self.config.source.clone()).set(dlq as f64);
        Ok(())
    }

    /// `outbox_pending` and, for the [`TOP_TENANTS`] tenants with the most
    /// pending rows, `outbox_tenant_pending` and `outbox_tenant_lag_seconds`;
    /// the others summed as `tenant="other"`, so the series stay bounded
    /// whatever the number of tenants.
    pub async fn update_tenant_view(&self) -> Result<()> {
        let rows: Vec<(i64, i64, f64)> = sqlx::query_as(
            "SELECT tenant_id, count(*), EXTRACT(EPOCH FROM now() - min(occurred_at))::float8
             FROM outbox_messages WHERE processed_at IS NULL
             GROUP BY tenant_id ORDER BY count(*) DESC, tenant_id",
        )
        .fetch_all(&self.pool)
        .await?;
        let source = &self.config.source;
        let total: i64 = rows.iter().map(|r| r.1).sum();
        metrics::gauge!(crate::metrics::OUTBOX_PENDING, "source" => source.clone())
            .set(total as f64);
        let (top, rest) = rows.split_at(rows.len().min(TOP_TENANTS));
        let mut pending: Vec<(Vec<String>, f64)> = Vec::with_capacity(top.len() + 1);
        let mut lag = pending.clone();
        for (tenant, n, age) in top {
            pending.push((vec![source.clone(), tenant.to_string()], *n as f64));
            lag.push((vec![source.clone(), tenant.to_string()], *age));
        }
        if !rest.is_empty() {
            let n: i64 = rest.iter().map(|r| r.1).sum();
            let age = rest.iter().map(|r| r.2).fold(0.0, f64::max);
            pending.push((vec![source.clone(), "other".into()], n as f64));
            lag.push((vec![source.clone(), "other".into()], age));
        }
        TENANT_PENDING.set(source, pending);
        TENANT_LAG.set(source, lag);
        Ok(())
    }
}
