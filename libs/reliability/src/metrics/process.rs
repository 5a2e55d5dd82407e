//! The process's own gauges and its connection pools', refreshed every few
//! seconds: what a Prometheus client library gives every process
//! elsewhere (`process_*`), read from `/proc` (Linux; elsewhere only the
//! pools are exported), and how full each pool is, which a pool timeout
//! otherwise tells first.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{
    DB_POOL_CONNECTIONS, DB_POOL_MAX, PROCESS_CPU, PROCESS_OPEN_FDS, PROCESS_RESIDENT_MEMORY,
    PROCESS_START_TIME,
};

/// How often the gauges are read: under a scrape interval, cheap (a few
/// small files).
const EVERY: Duration = Duration::from_secs(5);

/// `/proc`'s clock ticks per second (`USER_HZ`, 100 on every Linux ABI).
const TICKS: f64 = 100.0;

/// Samples until `shutdown`; `pools` are named by role (`app`, `relay`,
/// `owner`).
pub async fn sample(
    pools: Vec<(&'static str, PgPool)>,
    shutdown: CancellationToken,
) -> crate::Result<()> {
    let start = start_time();
    let mut tick = tokio::time::interval(EVERY);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        if let Some(start) = start {
            metrics::gauge!(PROCESS_START_TIME).set(start);
        }
        process();
        for (role, pool) in &pools {
            let (size, idle) = (f64::from(pool.size()), pool.num_idle() as f64);
            metrics::gauge!(DB_POOL_CONNECTIONS, "pool" => *role, "state" => "idle").set(idle);
            metrics::gauge!(DB_POOL_CONNECTIONS, "pool" => *role, "state" => "in_use")
                .set((size - idle).max(0.0));
            metrics::gauge!(DB_POOL_MAX, "pool" => *role)
                .set(f64::from(pool.options().get_max_connections()));
        }
    }
}

/// CPU seconds, resident memory and open descriptors, now.
fn process() {
    if let Some(fields) = stat() {
        // utime and stime: fields 14 and 15 of the line.
        let ticks: f64 = [11, 12]
            .iter()
            .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
            .sum();
        metrics::gauge!(PROCESS_CPU).set(ticks / TICKS);
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if let Some(kib) = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
    {
        metrics::gauge!(PROCESS_RESIDENT_MEMORY).set(kib * 1024.0);
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        metrics::gauge!(PROCESS_OPEN_FDS).set(fds.count() as f64);
    }
}

/// When the process started (Unix seconds): its start in ticks after boot
/// (field 22 of its stat line), plus the boot time.
fn start_time() -> Option<f64> {
    let after_boot: f64 = stat()?.get(19)?.parse().ok()?;
    let boot: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(boot + after_boot / TICKS)
}

/// `/proc/self/stat`'s fields after the command name (which may hold
/// spaces and parentheses): index 0 is field 3, the state.
fn stat() -> Option<Vec<String>> {
    let line = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (_, rest) = line.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_process_reads_itself() {
        let fields = super::stat().expect("/proc on Linux");
        assert!(["R", "S", "D"].contains(&fields[0].as_str()), "{fields:?}");
        let start = super::start_time().expect("a start time");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            start <= now + 1.0 && start > now - 3600.0,
            "{start} vs {now}"
        );
    }
}
