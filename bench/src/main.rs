//! `make bench`: the system measured against the raw limits of the same
//! PostgreSQL and RabbitMQ, in one run, each figure next to its limit:
//!
//! 1. relay drain (1, 2, 4 relays, and one log relay reading the rows'
//!    commits from its slot) vs a raw publisher of the same messages with
//!    pipelined confirms and no database, through lapin and through a
//!    client with no library (AMQP frames by hand);
//! 2. consumer apply (dedup + state + offset + commit + ack) vs a raw
//!    consume + ack of the same queue;
//! 3. `POST /orders` at 1, 8, 32 connections vs pgbench running the same
//!    SQL transaction on the same database;
//! 4. idempotent replay latency;
//! 5. placed → confirmed (orders and projection), light and heavy load;
//! 6. resources: peak RSS, outbox size after the drain, CPU per 1k events;
//! 7. the saga as processes: rates, the cost map per decided order, and the
//!    same rounds through a baseline build (`BENCH_BASELINE`).
//!
//! `bench --smoke` runs everything tiny (seconds), for CI. The full run
//! writes `docs/benchmarks.md`.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

mod api;
mod cost;
mod graph_apply;
mod ordered;
mod pipeline;
mod processes;
mod rawamqp;
mod saga;
mod server;

use api::http;
use pipeline::relay_and_consumer;
use processes::processes;
use saga::end_to_end;

struct Sizes {
    /// Outbox rows the relays drain.
    rows: i64,
    /// Messages consumed raw and through the consumer runtime.
    consume: u64,
    /// Duration of each HTTP load level.
    http: Duration,
    replays: usize,
    /// Orders followed to `confirmed` at light load, and per client at heavy.
    e2e_light: usize,
    e2e_heavy: usize,
    /// Orders per tenant (4 tenants) through the stack run as processes.
    procs_orders: usize,
}

impl Sizes {
    fn new(smoke: bool) -> Self {
        let mut sizes = Self::preset(smoke);
        // For quick iterations on one figure: BENCH_ROWS=50000 BENCH_CONSUME=20000.
        if let Some(rows) = env_number("BENCH_ROWS") {
            sizes.rows = rows;
        }
        if let Some(n) = env_number("BENCH_CONSUME") {
            sizes.consume = n.try_into().unwrap_or(sizes.consume);
        }
        // BENCH_PROCS_ORDERS=200: orders per tenant through the saga as processes.
        if let Some(n) = env_number("BENCH_PROCS_ORDERS") {
            sizes.procs_orders = n.try_into().unwrap_or(sizes.procs_orders);
        }
        // The raw consumer and the consumer runtime each take `consume`
        // messages from what the last drain left in the queue.
        sizes.consume = sizes.consume.min(sizes.rows.unsigned_abs() / 2);
        sizes
    }

    fn preset(smoke: bool) -> Self {
        if smoke {
            Self {
                rows: 2_000,
                consume: 500,
                http: Duration::from_secs(1),
                replays: 50,
                e2e_light: 3,
                e2e_heavy: 2,
                procs_orders: 5,
            }
        } else {
            Self {
                rows: 200_000,
                consume: 50_000,
                http: Duration::from_secs(10),
                replays: 2_000,
                e2e_light: 100,
                e2e_heavy: 20,
                procs_orders: 500,
            }
        }
    }
}

fn env_number(name: &str) -> Option<i64> {
    std::env::var(name).ok()?.parse().ok()
}

/// measure, figure, limit, ratio, target
#[derive(Default)]
struct Table(Vec<[String; 5]>);

impl Table {
    fn row(&mut self, cells: [&str; 5]) {
        let row = cells.map(str::to_owned);
        println!(
            "{:<44} {:<40} {:<28} {:>7}  {}",
            row[0], row[1], row[2], row[3], row[4]
        );
        self.0.push(row);
    }

    fn markdown(&self) -> String {
        let mut s =
            String::from("| measure | figure | limit | ratio | target |\n|---|---|---|---|---|\n");
        for r in &self.0 {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                r[0], r[1], r[2], r[3], r[4]
            );
        }
        s
    }
}

struct Latencies(Vec<Duration>);

impl Latencies {
    fn quantile(&mut self, q: f64) -> Duration {
        self.0.sort_unstable();
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i]
    }

    fn summary(&mut self) -> String {
        format!(
            "p50 {:.1} p99 {:.1} max {:.1} ms",
            ms(self.quantile(0.5)),
            ms(self.quantile(0.99)),
            ms(self.quantile(1.0))
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let sizes = Sizes::new(smoke);
    let started = Instant::now();
    println!(
        "bench ({}): {} outbox rows, {} consumed, {:?} per HTTP level",
        if smoke { "smoke" } else { "full" },
        sizes.rows,
        sizes.consume,
        sizes.http
    );
    println!(
        "{:<44} {:<40} {:<28} {:>7}  target",
        "measure", "figure", "limit", "ratio"
    );
    // For quick iterations on one part: BENCH_ONLY=relay,ordered,graph,http,e2e,procs (no report).
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let runs = |part: &str| only.is_empty() || only.split(',').any(|p| p.trim() == part);
    let mut table = Table::default();
    if runs("relay") {
        relay_and_consumer(&sizes, &mut table).await?;
    }
    if runs("ordered") {
        ordered::ordered_apply(&sizes, &mut table).await?;
    }
    if runs("graph") {
        graph_apply::graph_apply(&sizes, &mut table).await?;
    }
    if runs("http") {
        http(&sizes, &mut table).await?;
    }
    if runs("e2e") {
        end_to_end(&sizes, &mut table).await?;
    }
    table.row([
        "peak RSS of the bench process",
        &format!(
            "{} MiB",
            e2e::procs::peak_rss_kib("self").unwrap_or(0) / 1024
        ),
        "",
        "",
        "the in-process stack of the parts above",
    ]);
    if runs("procs") {
        processes(&sizes, &mut table).await?;
    }
    let secs = started.elapsed().as_secs();
    println!("bench: done in {secs}s");
    if !smoke && only.is_empty() {
        write_report(&table, secs)?;
        println!("wrote docs/benchmarks.md");
    }
    Ok(())
}

// ---------------------------------------------------------------- machine

/// CPU seconds (user + system) this process used so far.
fn cpu_self() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15; 11 and 12 after the ")".
    (ticks(11) + ticks(12)) / 100.0
}

fn command_output(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn write_report(table: &Table, secs: u64) -> anyhow::Result<()> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name\t: ").map(str::to_owned))
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    let doc = format!(
        "# Benchmarks\n\n\
         The latest `make bench` run, written by the bench itself (`bench/src/main.rs`).\n\
         Every figure stands next to the raw limit of the same PostgreSQL and RabbitMQ\n\
         on the same machine, measured in the same run.\n\n\
         ## How to reproduce\n\n\
         ```sh\nmake bench          # release build, about {mins} min; rewrites this file\n\
         make bench-smoke    # seconds, what CI runs\n```\n\n\
         ## Machine\n\n\
         - {} cores, {cpu}\n- {mem}\n- {}\n- RabbitMQ {}\n- run took {secs} s, finished {}\n\n\
         ## Results\n\n{}\n\
         See the analysis below the table for what bounds each figure.\n",
        std::thread::available_parallelism().map_or(0, usize::from),
        command_output(
            "psql",
            &[
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-Atc",
                "SELECT version()"
            ]
        ),
        command_output("rabbitmqctl", &["-q", "version"]),
        command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        table.markdown(),
        mins = secs.div_ceil(60),
    );
    // Hand-written analysis lives below the marker and is kept across runs.
    let path = std::path::Path::new("docs/benchmarks.md");
    let kept = std::fs::read_to_string(path)
        .ok()
        .and_then(|old| old.split_once(ANALYSIS).map(|(_, rest)| rest.to_owned()))
        .unwrap_or_else(|| "\n".into());
    std::fs::write(path, format!("{doc}\n{ANALYSIS}{kept}"))?;
    Ok(())
}

const ANALYSIS: &str = "<!-- analysis: kept across runs -->";
