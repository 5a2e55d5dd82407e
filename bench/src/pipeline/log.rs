//! The log relay (docs/adr/0038) on the polling relay's rows, exchange and
//! batch size: the rows are committed while its slot exists, four to a
//! transaction (an order's events), and it reads them from the log and
//! publishes them through the pipeline's relay.

use std::time::{Duration, Instant};

use log_relay::{LogRelay, LogRelayConfig};
use reliability::relay::{Relay, RelayConfig};
use testkit::{TestDb, amqp_url};
use tokio_util::sync::CancellationToken;

use crate::{Table, cpu_self, pct};

/// Rows per committed transaction: an order's events.
const PER_COMMIT: i64 = 4;
/// The drain's bound: a relay that stops reading fails the bench, named.
const BOUND: Duration = Duration::from_secs(600);

/// `rows` events, as [`super::fill`] makes them, each
/// [`PER_COMMIT`] a transaction of their own (a DO block that commits).
async fn fill_in_commits(db: &TestDb, rows: i64) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE outbox_messages")
        .execute(&db.owner)
        .await?;
    let commits = rows / PER_COMMIT;
    // Numbers and our own constant text: nothing to inject.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DO $$ BEGIN FOR c IN 0..{last} LOOP {rows}
             FROM generate_series(c * {PER_COMMIT} + 1, c * {PER_COMMIT} + {PER_COMMIT}) g;
             COMMIT;
           END LOOP; END $$",
        last = commits - 1,
        rows = super::outbox_rows!(),
    )))
    .execute(&db.owner)
    .await?;
    Ok(())
}

/// One log relay draining `rows` committed after its slot was made,
/// against the sliding-window publisher's rate with lapin (`raw`) and with
/// the client by hand (`by_hand`, issue 44's limit). Leaves the queue
/// holding its messages.
pub(super) async fn log_relay_drain(
    db: &TestDb,
    config: &RelayConfig,
    rows: i64,
    (raw, by_hand): (f64, f64),
    t: &mut Table,
) -> anyhow::Result<()> {
    let what = format!("log relay drain, 1 relay, {rows} rows, {PER_COMMIT} per commit");
    if !testkit::logical_decoding(&db.admin).await {
        t.row([&what, "not measured", "wal_level is not logical", "", ""]);
        return Ok(());
    }
    let log = LogRelayConfig::new(&db.url());
    log_relay::ensure_slot(&db.url(), &log.slot).await?;
    fill_in_commits(db, rows).await?;
    let n = (rows / PER_COMMIT * PER_COMMIT) as f64;

    let cpu0 = cpu_self();
    let t0 = Instant::now();
    let relay = LogRelay::new(
        Relay::new(db.relay.clone(), &amqp_url(), config.clone()),
        log,
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    // The last row committed is the last the log shows: watched by its
    // key, which costs the server nothing, then every row checked once.
    // (A count of the pending rows every 5 ms, as this loop first did,
    // scanned the pending index's dead entries on each look and took
    // PostgreSQL's time from the relay it measured.)
    let last: i64 = sqlx::query_scalar("SELECT max(id) FROM outbox_messages")
        .fetch_one(&db.owner)
        .await?;
    for look in [
        "SELECT count(*) FROM outbox_messages WHERE id = $1 AND processed_at IS NULL",
        "SELECT count(*) FROM outbox_messages WHERE id <= $1 AND processed_at IS NULL",
    ] {
        loop {
            let pending: i64 = sqlx::query_scalar(look)
                .bind(last)
                .fetch_one(&db.owner)
                .await?;
            if pending == 0 {
                break;
            }
            anyhow::ensure!(t0.elapsed() < BOUND, "{pending} rows left after {BOUND:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = (cpu_self() - cpu0) * 1000.0 / n;
    stop.cancel();
    task.await?;
    let rate = n / secs;
    t.row([
        &what,
        &format!("{rate:.0} events/s"),
        &format!("sliding-window publish {raw:.0} msg/s"),
        &pct(rate / raw),
        "",
    ]);
    t.row([
        "log relay drain against the client by hand, same messages and window",
        &format!("{rate:.0} events/s"),
        &format!("by hand {by_hand:.0} msg/s"),
        &pct(rate / by_hand),
        ">= 70% with one relay",
    ]);
    t.row([
        "log relay CPU per 1k events (this process)",
        &format!("{:.0} ms", cpu * 1000.0),
        "",
        "",
        "",
    ]);
    Ok(())
}
