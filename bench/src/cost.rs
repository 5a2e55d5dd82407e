//! What a decided order costs (issue 24's map): transactions per service
//! database, from PostgreSQL's own counters (`pg_stat_database`), and CPU
//! per process kind: each role of the stack, PostgreSQL's backends by the
//! role they serve (`application_name`, e.g. `orders-consume`) and in all,
//! and the broker. `pg_stat_statements` would split statements by role too;
//! it needs a restart of the server to load, which the bench never does to
//! the developer's PostgreSQL.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::procs::Cluster;
use sqlx::PgPool;

/// PostgreSQL 15 publishes a backend's counters when it goes idle, at most
/// once a second, and within 10 s (`PGSTAT_IDLE_INTERVAL`) of its last
/// transaction: read no sooner after the work ends.
pub(crate) const STATS_FLUSH: Duration = Duration::from_millis(10_500);

#[derive(Default)]
pub(crate) struct Snapshot {
    /// Transactions (committed and rolled back) per service.
    xacts: BTreeMap<String, i64>,
    /// CPU ticks per pid, and what the pid is.
    ticks: BTreeMap<u32, (String, u64)>,
}

/// utime + stime of a pid, in clock ticks; and its command name.
fn stat(pid: u32) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ...`: the comm may hold spaces; fields after it.
    let (head, tail) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = tail.split_whitespace().collect();
    let (utime, stime): (u64, u64) = (fields.get(11)?.parse().ok()?, fields.get(12)?.parse().ok()?);
    Some((comm, utime + stime))
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// The developer's RabbitMQ, not an e2e world's nodes.
fn is_broker(pid: u32, comm: &str) -> bool {
    comm == "beam.smp" && !cmdline(pid).contains("commerce-e2e")
}

/// CPU seconds the broker (RabbitMQ's `beam.smp`; not an e2e world's) has
/// used so far.
pub(crate) fn broker_cpu() -> f64 {
    let ticks: u64 = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let (comm, t) = stat(pid)?;
            is_broker(pid, &comm).then_some(t)
        })
        .sum();
    ticks as f64 / clock_ticks()
}

pub(crate) async fn snapshot(
    admin: &PgPool,
    prefix: &str,
    procs: &Cluster,
) -> anyhow::Result<Snapshot> {
    let like = format!("{prefix}\\_%");
    let xacts: Vec<(String, i64)> = sqlx::query_as(
        "SELECT datname::text, xact_commit + xact_rollback FROM pg_stat_database WHERE datname LIKE $1",
    )
    .bind(&like)
    .fetch_all(admin)
    .await?;
    let backends: Vec<(i32, String)> =
        sqlx::query_as("SELECT pid, application_name FROM pg_stat_activity WHERE datname LIKE $1")
            .bind(&like)
            .fetch_all(admin)
            .await?;
    let backends: BTreeMap<u32, String> = backends
        .into_iter()
        .map(|(pid, app)| (pid.unsigned_abs(), app))
        .collect();
    let stack: BTreeMap<u32, String> = procs.pids().into_iter().map(|(n, p)| (p, n)).collect();
    let mut ticks = BTreeMap::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Some((comm, t)) = stat(pid) else { continue };
        let kind = if let Some(name) = stack.get(&pid) {
            name.clone()
        } else if comm == "postgres" {
            match backends.get(&pid) {
                Some(app) if !app.is_empty() => format!("postgres: {app}"),
                Some(_) => "postgres: the bench's own checks".into(),
                None => "postgres: other (server processes, autovacuum)".into(),
            }
        } else if is_broker(pid, &comm) {
            "rabbitmq".into()
        } else {
            continue;
        };
        ticks.insert(pid, (kind, t));
    }
    Ok(Snapshot {
        xacts: xacts
            .into_iter()
            .map(|(db, n)| {
                let service = db.strip_prefix(&format!("{prefix}_")).unwrap_or(&db);
                (service.to_owned(), n)
            })
            .collect(),
        ticks,
    })
}

/// What happened between two snapshots.
pub(crate) struct Cost {
    pub xacts: BTreeMap<String, i64>,
    /// CPU seconds per kind.
    pub cpu: BTreeMap<String, f64>,
}

pub(crate) fn between(before: &Snapshot, after: &Snapshot) -> Cost {
    let xacts = after
        .xacts
        .iter()
        .map(|(db, n)| (db.clone(), n - before.xacts.get(db).copied().unwrap_or(0)))
        .collect();
    let hz = clock_ticks();
    let mut cpu: BTreeMap<String, f64> = BTreeMap::new();
    // A process that started in between counts whole; one that ended is lost.
    for (pid, (kind, t)) in &after.ticks {
        let was = before.ticks.get(pid).map_or(0, |(_, t)| *t);
        *cpu.entry(kind.clone()).or_default() += t.saturating_sub(was) as f64 / hz;
    }
    Cost { xacts, cpu }
}

impl Cost {
    /// Transactions per service less the idle rate over `secs`, per order.
    pub fn xacts_per_order(
        &self,
        idle: &Cost,
        idle_secs: f64,
        secs: f64,
        orders: f64,
    ) -> BTreeMap<String, f64> {
        self.xacts
            .iter()
            .map(|(db, n)| {
                let idle_rate = idle.xacts.get(db).copied().unwrap_or(0) as f64 / idle_secs;
                (
                    db.clone(),
                    ((*n as f64) - idle_rate * secs).max(0.0) / orders,
                )
            })
            .collect()
    }

    /// CPU ms per order, summed by the kinds `group` maps each kind to.
    pub fn cpu_ms_per_order(
        &self,
        orders: f64,
        group: impl Fn(&str) -> String,
    ) -> BTreeMap<String, f64> {
        let mut out: BTreeMap<String, f64> = BTreeMap::new();
        for (kind, secs) in &self.cpu {
            *out.entry(group(kind)).or_default() += secs * 1000.0 / orders;
        }
        out
    }
}

/// The role a kind of process or backend belongs to: `api`, `consumer`,
/// `relay`, `simulator`, `rabbitmq`, or PostgreSQL's `other`.
pub(crate) fn role(kind: &str) -> &'static str {
    let name = kind.strip_prefix("postgres: ").unwrap_or(kind);
    if name.ends_with("-api") || name.ends_with("-serve") {
        "api"
    } else if name.ends_with("-consumer") || name.ends_with("-consume") {
        "consumer"
    } else if name.ends_with("-relay") {
        "relay"
    } else if name == "psp-sim" {
        "simulator"
    } else if name == "rabbitmq" {
        "rabbitmq"
    } else {
        "other"
    }
}
