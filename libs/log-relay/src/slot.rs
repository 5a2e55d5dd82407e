//! The slot as PostgreSQL sees it. A slot that nobody reads keeps every
//! WAL segment from its position on: the disk fills unless
//! `max_slot_wal_keep_size` bounds it (docs/adr/0038).

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

/// WAL the slot keeps (from its restart position to the server's end).
pub const RETAINED_WAL: &str = "log_relay_slot_retained_wal_bytes";
/// WAL written since the slot's confirmed position: the log relay's lag.
pub const LAG: &str = "log_relay_slot_lag_bytes";
/// 1 while a relay reads the slot, 0 while nobody does.
pub const ACTIVE: &str = "log_relay_slot_active";

use reliability::metrics::{Kind, Metric};

/// The slot's metrics, for the catalogue (docs/metrics.md).
pub const METRICS: &[Metric] = &[
    Metric::new(
        RETAINED_WAL,
        Kind::Gauge,
        &["slot"],
        "WAL the outbox's replication slot keeps, in bytes (from its restart position to the server's end; bounded by max_slot_wal_keep_size).",
    ),
    Metric::new(
        LAG,
        Kind::Gauge,
        &["slot"],
        "WAL written since the slot's confirmed position, in bytes: what the log relay has not confirmed yet.",
    ),
    Metric::new(
        ACTIVE,
        Kind::Gauge,
        &["slot"],
        "1 while a log relay reads the slot, 0 while nobody does (its WAL then accumulates).",
    ),
];

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SlotStatus {
    /// A relay reads it now: a walsender holds it. Not a backend that is
    /// creating it, which holds it too while it waits for the running
    /// transactions, before any commit can be read from it.
    pub active: bool,
    pub retained_wal_bytes: Option<i64>,
    pub lag_bytes: Option<i64>,
}

/// The slot's status, `None` when it does not exist; sets the gauges.
pub async fn slot_status(pool: &PgPool, slot: &str) -> sqlx::Result<Option<SlotStatus>> {
    let status: Option<SlotStatus> = sqlx::query_as(
        "SELECT active AND EXISTS (SELECT 1 FROM pg_stat_replication r WHERE r.pid = s.active_pid)
                    AS active,
                pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS retained_wal_bytes,
                pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint AS lag_bytes
         FROM pg_replication_slots s WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?;
    if let Some(s) = &status {
        let slot = slot.to_owned();
        metrics::gauge!(RETAINED_WAL, "slot" => slot.clone())
            .set(s.retained_wal_bytes.unwrap_or(0) as f64);
        metrics::gauge!(LAG, "slot" => slot.clone()).set(s.lag_bytes.unwrap_or(0) as f64);
        metrics::gauge!(ACTIVE, "slot" => slot).set(if s.active { 1.0 } else { 0.0 });
    }
    Ok(status)
}

/// Creates the logical slot `slot` (`pgoutput`) unless it exists, on a
/// connection of its own to `url`, awaited.
///
/// Not the stream's own creation: `pg_walstream` creates it with a
/// blocking call, and PostgreSQL makes a new logical slot wait for every
/// transaction running on the server. On a current-thread runtime the
/// call blocks the one thread that may be running one of those
/// transactions: a deadlock that only `idle_in_transaction_session_timeout`
/// broke (an e2e run's order answered 500 after 15 s). Two relays racing
/// to create it: the loser finds it made (42710).
pub async fn ensure_slot(url: &str, slot: &str) -> sqlx::Result<()> {
    let mut conn = PgConnection::connect(url).await?;
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(slot)
    .fetch_one(&mut conn)
    .await?;
    if !exists {
        let created = sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(slot)
            .execute(&mut conn)
            .await;
        match created {
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => {}
            other => {
                other?;
            }
        }
    }
    conn.close().await
}

/// How often [`watch_slot`] reads the slot.
const WATCH_EVERY: Duration = Duration::from_secs(5);

/// Keeps the slot's gauges current until `shutdown`, whichever relay
/// reads it: a slot nobody reads is the one to see.
pub async fn watch_slot(pool: &PgPool, slot: &str, shutdown: CancellationToken) {
    loop {
        if let Err(e) = slot_status(pool, slot).await {
            tracing::debug!(slot, error = %e, "slot not read");
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(WATCH_EVERY) => {}
        }
    }
}
