//! A source's floor for a re-projection (docs/adr/0035): an outbox id at
//! or below which every event has committed, or never will, before any
//! snapshot read after the floor is taken. So a snapshot's rows reflect
//! every event at or below it, and only the events past it need their ids
//! read (a range of the outbox's primary key) and their tail replayed.
//!
//! Decided by PostgreSQL, not by a coordinator of ours, as `CREATE INDEX
//! CONCURRENTLY` waits for older transactions: the outbox's sequence is
//! read first, then every transaction of the database open at that moment
//! is waited out (each holds the lock of its own virtual transaction id
//! from its start, so one that took an id at or below the floor is among
//! them, whether it has written yet or not).

use std::time::{Duration, Instant};

use reliability::Result;
use sqlx::PgPool;

use crate::Sources;
use crate::snapshot::Floors;

/// How long the floor waits for the transactions open when it was read:
/// past the runtime role's `statement_timeout` (30 s) and `lock_timeout`
/// (5 s), so only a transaction of someone else's (an operator's `psql`,
/// left open) is waited on to the end of it.
pub const FLOOR_WAIT: Duration = Duration::from_secs(60);

/// How often the open transactions are looked at again.
const POLL: Duration = Duration::from_millis(100);

/// Each source's floor, waiting at most `bound` for each.
pub async fn floors(sources: &Sources, bound: Duration) -> Result<Floors> {
    Ok(Floors {
        orders: floor(&sources.orders, bound).await?,
        inventory: floor(&sources.inventory, bound).await?,
        payments: floor(&sources.payments, bound).await?,
    })
}

/// One source's floor: its outbox's last id taken, once every transaction
/// open when it was read has ended.
pub async fn floor(pool: &PgPool, bound: Duration) -> Result<i64> {
    let last: Option<i64> = sqlx::query_scalar(
        "SELECT pg_sequence_last_value(pg_get_serial_sequence('outbox_messages', 'id')::regclass)",
    )
    .fetch_one(pool)
    .await?;
    // Read after the sequence: a transaction that took an id by then is open now.
    let open: Vec<String> = sqlx::query_scalar(
        "SELECT l.virtualxid FROM pg_locks l JOIN pg_stat_activity a USING (pid)
         WHERE l.locktype = 'virtualxid' AND l.granted AND a.datname = current_database()
           AND l.pid <> pg_backend_pid()",
    )
    .fetch_all(pool)
    .await?;
    let started = Instant::now();
    loop {
        let waiting: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_locks WHERE locktype = 'virtualxid' AND granted
               AND virtualxid = ANY($1)",
        )
        .bind(&open)
        .fetch_all(pool)
        .await?;
        if waiting.is_empty() {
            return Ok(last.unwrap_or(0));
        }
        if started.elapsed() >= bound {
            return Err(reliability::Error::Config(format!(
                "a re-projection waits for the transactions open when it began, and \
                 these sessions' are still open after {bound:?}: {waiting:?} \
                 (pg_stat_activity names them)"
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}
