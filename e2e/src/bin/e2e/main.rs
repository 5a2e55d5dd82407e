//! `make e2e`: the system as real processes against the real PostgreSQL and
//! RabbitMQ, put through crashes (`kill -9`, fail points that abort at exact
//! places), a broker restart, duplicate storms and client retries. After each
//! scenario it waits (with a deadline) for the system to go quiet, then
//! checks the invariants of ARCHITECTURE.md from the databases and the
//! provider's charge counts. Prints a table; exits 1 on any violation.
//!
//! It runs in a world of its own (`e2e::world`): a PostgreSQL cluster and a
//! three-node RabbitMQ cluster made for the run on spare ports and removed
//! after it, so it never touches the developer's servers nor `make up`'s
//! stack; the last row proves the developer's servers were left alone.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use e2e::cluster::{self, Client};
use e2e::untouched::Untouched;
use e2e::world::World;
use futures_util::FutureExt;
use testkit::amqp_url;

use report::{Row, report, untouched_row, verified_row};
use run::{LAYOUT, Run, SKIPPED, Scenario, bin, charge_dead_letters, settle};

mod alarm;
mod broker_state;
mod crashes;
mod cutoff;
mod drift;
mod faults;
mod hostile;
mod money;
mod ordered;
mod partial;
mod pooled;
mod report;
mod run;
mod scale;
mod servers;
mod upgrade;

/// How long one scenario may run before it counts as stuck: the longest
/// fault held is the 5-minute memory alarm, and its drain.
const SCENARIO_LIMIT: Duration = Duration::from_secs(420);

fn scenarios() -> Vec<Scenario> {
    [
        crashes::scenarios(),
        faults::scenarios(),
        servers::scenarios(),
        hostile::scenarios(),
        scale::scenarios(),
        money::scenarios(),
        partial::scenarios(),
        cutoff::scenarios(),
        ordered::scenarios(),
        drift::scenarios(),
    ]
    .concat()
}

/// Set in the runner's environment by the process that made its world.
const IN_WORLD: &str = "E2E_IN_WORLD";

/// Two processes: this one makes the world, runs itself again inside it
/// (the environment names the world's servers, so every child and every
/// `DATABASE_URL` / `AMQP_URL` reader of the runner sees only them), and
/// removes the world however the runner ends.
fn main() -> anyhow::Result<()> {
    let started = Instant::now();
    let world = World::describe(PathBuf::from(".run/e2e/world"))?;
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    };
    if std::env::var_os(IN_WORLD).is_some() {
        let world: &'static World = Box::leak(Box::new(world));
        return runtime()?.block_on(run_all(world, started));
    }
    // The developer's servers, as the environment names them: only watched.
    let dev_db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let dev_amqp = amqp_url();
    let pooled = if world.pooler().is_some() {
        ", PgBouncer in transaction mode in front of it"
    } else {
        ""
    };
    println!(
        "making the world: PostgreSQL{pooled}, a 3-node RabbitMQ cluster and a FalkorDB on spare ports"
    );
    let made = world.create();
    let status = made.and_then(|()| {
        println!(
            "world ready in {:.1}s: PostgreSQL {}, RabbitMQ {}",
            started.elapsed().as_secs_f64(),
            world.database_url(),
            world.amqp_url()
        );
        Ok(std::process::Command::new(std::env::current_exe()?)
            .env(IN_WORLD, "1")
            .env("DATABASE_URL", world.database_url())
            .env("AMQP_URL", world.amqp_url())
            .env("GRAPH_URL", world.graph_url())
            .env("E2E_DEV_DATABASE_URL", dev_db)
            .env("E2E_DEV_AMQP_URL", dev_amqp)
            .status()?)
    });
    world.remove();
    match status? {
        s if s.success() => Ok(()),
        s => std::process::exit(s.code().unwrap_or(1)),
    }
}

async fn run_all(world: &'static World, started: Instant) -> anyhow::Result<()> {
    let dev = |name: &str| std::env::var(name).unwrap_or_default();
    let watch = Untouched::watch(&dev("E2E_DEV_DATABASE_URL"), &dev("E2E_DEV_AMQP_URL")).await;
    // `E2E_UPGRADE_FROM=<dir of an older release's binaries>` (make
    // e2e-upgrade): the rolling upgrade first, on a stack of its own, before
    // the run's stack starts beside it.
    let mut rows = Vec::new();
    if let Some(old_bins) = std::env::var_os("E2E_UPGRADE_FROM").filter(|d| !d.is_empty()) {
        println!("-- {}", upgrade::NAME);
        rows.push(upgrade::row(std::path::Path::new(&old_bins)).await);
    }
    let mut run = setup(world).await?;
    println!(
        "stack up in {:.1}s; running scenarios (logs in .run/e2e/)",
        started.elapsed().as_secs_f64()
    );
    // `E2E_ONLY=broker` runs the scenarios whose name contains "broker";
    // `E2E_ONLY=broker,frozen` those with either. `E2E_SKIP` leaves out
    // those whose name contains any of its words (make e2e-pgbouncer's
    // broker-only scenarios).
    let list = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let (only, skip) = (list("E2E_ONLY"), list("E2E_SKIP"));
    for (i, (name, scenario)) in scenarios().into_iter().enumerate() {
        let tenant = i as i64 + 1;
        let named = |list: &Option<String>| {
            list.as_deref()
                .map(|l| l.split(',').any(|o| name.contains(o)))
        };
        if named(&only) == Some(false) || named(&skip) == Some(true) {
            continue;
        }
        let t0 = Instant::now();
        println!("-- {name} (tenant {tenant})");
        // The longest scenario takes under a minute; one stuck on a call
        // with no deadline of its own is a failure, not a hung run.
        let outcome = tokio::time::timeout(
            SCENARIO_LIMIT,
            std::panic::AssertUnwindSafe(scenario(&mut run, tenant)).catch_unwind(),
        )
        .await;
        let (faults, mut extra) = match outcome {
            Err(_) => (
                "(scenario aborted)".into(),
                vec![format!(
                    "scenario: still running after {SCENARIO_LIMIT:?} (a wait with no deadline)"
                )],
            ),
            Ok(outcome) => match outcome {
                Ok(Ok(outcome)) => outcome,
                // A scenario that could not drive its traffic or timed out
                // waiting is a failure of the system under test, not of the
                // runner: report it and go on.
                Ok(Err(e)) => (
                    "(scenario aborted)".into(),
                    vec![format!("scenario: {e:#}")],
                ),
                Err(panic) => {
                    let why = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_default();
                    (
                        "(scenario aborted)".into(),
                        vec![format!("scenario: {why}")],
                    )
                }
            },
        };
        // Whatever happened, the next scenario starts from a whole world
        // and a whole stack.
        match run.world.heal().await {
            Ok(started) if started.is_empty() => {}
            Ok(started) => extra.push(format!(
                "scenario left broker nodes {started:?} down (started)"
            )),
            Err(e) => extra.push(format!(
                "the world's broker cluster did not come back: {e:#}"
            )),
        }
        let base = run.base.clone();
        let restarted = run.cluster.restore(&base)?;
        if !restarted.is_empty() {
            extra.push(format!(
                "scenario left {restarted:?} down or armed (restarted)"
            ));
        }
        let mut verdict = settle(&run, tenant).await?;
        verdict.violations.extend(extra);
        let skipped = faults.strip_prefix(SKIPPED).map(str::to_owned);
        // The verdict now, not only in the table at the end.
        let secs = t0.elapsed().as_secs_f64();
        match (&skipped, verdict.violations.as_slice()) {
            (_, [_, ..]) => {
                // The short ones first (a DLQ, a park, an event never
                // applied): CI's summary keeps a line's first 1,500
                // characters, and a graph's shapes are long.
                let mut said: Vec<&str> = verdict.violations.iter().map(String::as_str).collect();
                said.sort_by_key(|v| v.len());
                println!(
                    "   FAIL {name} ({secs:.1} s): {} violations: {}",
                    said.len(),
                    said.join("; ")
                );
                if let Err(e) = charge_dead_letters(&mut run).await {
                    println!("   dead letters not counted: {e:#}");
                }
                broker_state::print(&run).await;
                if said.iter().any(|v| v.starts_with("graph")) {
                    println!("   graph store: {}", run.world.falkordb_warnings());
                }
            }
            (Some(why), []) => println!("   SKIP {name}: {why}"),
            (None, []) => println!("   PASS {name} ({secs:.1} s): {faults}"),
        }
        rows.push(Row {
            name,
            faults,
            verdict,
            secs,
            skipped,
        });
    }
    if let Some(pooler) = world.pooler() {
        rows.push(pooled::row(pooler, &world.database_url(), Instant::now()));
    }
    rows.push(verified_row(&run.dbs).await);
    run.cluster.stop_all();
    rows.push(untouched_row(watch).await);
    let strict = std::env::var("E2E_STRICT").is_ok_and(|v| v == "1");
    let (failed, skipped) = report(&rows, started.elapsed().as_secs_f64());
    if failed {
        anyhow::bail!("invariants violated");
    }
    if skipped && strict {
        anyhow::bail!("E2E_STRICT=1: a scenario that cannot run here counts as a failure");
    }
    Ok(())
}

async fn setup(world: &'static World) -> anyhow::Result<Run> {
    // Backoff in steps of 200 ms (not 30 s): an unroutable event reaches
    // the DLQ table after 10 attempts in about 10 s.
    // Provider calls: 6 in flight, 3 per tenant, so that a tenant's burst
    // against a slow provider meets the share at a load these 2 cores carry
    // in debug builds.
    let mut env = vec![
        ("RELAY_BACKOFF_MS", "200".to_owned()),
        ("RELAY_CONFIRM_TIMEOUT_MS", "2000".to_owned()),
        ("PSP_MAX_IN_FLIGHT", "6".to_owned()),
        ("PSP_TENANT_IN_FLIGHT", "3".to_owned()),
    ];
    // The e2e-log profile: every relay role reads its outbox's commits
    // from a replication slot (docs/adr/0038).
    if let Ok(mode) = std::env::var("E2E_RELAY_MODE") {
        env.push(("RELAY_MODE", mode));
    }
    // The e2e-pgbouncer profile: the runtime role through the pooler.
    if let Some(pooler) = world.pooler() {
        env.push(("DB_POOLER", format!("127.0.0.1:{}", pooler.port)));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (mut cluster, dbs) = cluster::launch(&LAYOUT, &env).await?;
    let base: Vec<String> = cluster.procs.keys().cloned().collect();
    // Extra relays, started by the scenario that runs several at once.
    for extra in ["orders-relay-2", "orders-relay-3"] {
        cluster.add(extra, bin("orders"), &["relay"], None);
    }
    cluster.add("inventory-relay-2", bin("inventory"), &["relay"], None);
    for (name, service, role) in scale::REPLICAS {
        cluster.add(name, bin(service), &[role], None);
    }
    Ok(Run {
        world,
        cluster,
        dbs,
        client: Client::new(&LAYOUT)?,
        poison: HashMap::new(),
        outbox_poison: 0,
        base,
    })
}
