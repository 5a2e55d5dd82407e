//! `make e2e-upgrade` (part of `make e2e-full`): a rolling upgrade under
//! load from a release whose relays do not number (953eb30; issue 41).
//!
//! That release's stack runs on its own schema, with orders coming in.
//! Then, as the runbook says: today's migrations run beside it; today's
//! consumers and relays start beside the old ones; each API is replaced on
//! its port; the old consumers and relays stop. The load goes on all the
//! while. Every ordered history must be in outbox order and hold no event
//! an old relay published, and nothing may be lost: the checker's
//! invariants and `projection verify` (docs/adr/0028, amended in session
//! 34). The release has no graph service; today's is not started here.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::check::{Dbs, Ledger, Verdict};
use e2e::cluster::{self, Client, Layout};
use e2e::procs::Cluster;

use crate::report::Row;
use crate::run::{QUIET, bin};

/// The row's name: `E2E_ONLY=upgrade` runs it alone.
pub(crate) const NAME: &str =
    "upgrade: a release whose relays do not number, rolled to today's under load";

/// Ports 9381-9385 and 9399, databases `upgrade_*`: beside the run's own
/// stack, which starts after this row.
const UPGRADE: Layout = Layout {
    name: "upgrade",
    port_base: 9380,
    profile: "debug",
};

const TENANT: i64 = 1;

/// Orders a second, all along: both releases' processes together on two
/// cores keep up with it in debug builds.
const RATE: usize = 8;

/// Decided orders between two steps: each step runs under load a while,
/// counted, not slept.
const BETWEEN_STEPS: i64 = 24;

/// The row, from the old release's binaries in `old_bins`.
pub(crate) async fn row(old_bins: &Path) -> Row {
    let t0 = Instant::now();
    let (faults, verdict) = match upgrade(old_bins).await {
        Ok(done) => done,
        Err(e) => (
            "(scenario aborted)".into(),
            Verdict {
                violations: vec![format!("scenario: {e:#}")],
                ..Verdict::default()
            },
        ),
    };
    let secs = t0.elapsed().as_secs_f64();
    match verdict.violations.as_slice() {
        [] => println!("   PASS {NAME} ({secs:.1} s): {faults}"),
        v => println!("   FAIL {NAME} ({secs:.1} s): {}", v.join("; ")),
    }
    Row {
        name: NAME,
        faults,
        verdict,
        secs,
        skipped: None,
    }
}

async fn upgrade(old_bins: &Path) -> anyhow::Result<(String, Verdict)> {
    // 953eb30 takes one broker address, not the world's list of nodes.
    let amqp = testkit::amqp_url();
    let one_node = amqp.split(',').next().unwrap_or_default();
    let env = [
        ("AMQP_URL", one_node),
        ("RELAY_BACKOFF_MS", "200"),
        ("RELAY_CONFIRM_TIMEOUT_MS", "2000"),
    ];
    let (mut old, mut dbs) = cluster::launch_built(&UPGRADE, &env, Some(&bins(old_bins)?)).await?;
    dbs.rolled_from_unnumbered = true;
    let client = Client::new(&UPGRADE)?;
    client
        .stock(TENANT, &format!("SKU-{TENANT}"), 1_000_000)
        .await?;
    let done = AtomicBool::new(false);
    let (placed, rolled) = tokio::join!(client.orders_until(TENANT, RATE, &done), async {
        let rolled = roll(&mut old, &dbs).await;
        done.store(true, Ordering::Release);
        rolled
    });
    let mut today = rolled?;
    let placed = placed?;
    let mut verdict = settle(&dbs, &client).await?;
    if verdict.violations.is_empty() {
        verdict.violations.extend(dbs.views_verified().await?);
    }
    today.stop_all();
    old.stop_all();
    let (unnumbered, numbered) = published(&dbs).await?;
    let history: i64 = sqlx::query_scalar("SELECT count(*) FROM aggregate_history")
        .fetch_one(&dbs.projection)
        .await?;
    // A roll with no traffic on either side would prove nothing.
    if unnumbered == 0 || numbered == 0 {
        verdict.violations.push(format!(
            "upgrade: {unnumbered} events published by 953eb30's relays, {numbered} by today's: not under load on both sides"
        ));
    }
    Ok((
        format!(
            "{placed} orders at {RATE}/s; today's migrations, consumers and relays beside 953eb30's, the APIs replaced, the old processes stopped; {unnumbered} events published unnumbered by the old relays, {numbered} numbered by today's, {history} in the ordered history"
        ),
        verdict,
    ))
}

/// Events the old relays published (no number) and today's (numbered), in
/// the sources the ordered subscription reads.
async fn published(dbs: &Dbs) -> anyhow::Result<(i64, i64)> {
    let (mut unnumbered, mut numbered) = (0, 0);
    for pool in [&dbs.orders, &dbs.inventory] {
        let (u, n): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE aggregate_seq IS NULL), count(aggregate_seq) FROM outbox_messages",
        )
        .fetch_one(pool)
        .await?;
        unnumbered += u;
        numbered += n;
    }
    Ok((unnumbered, numbered))
}

/// The old release's services, with today's provider simulator: the
/// provider is not part of the upgrade, and only today's reports its
/// ledger, which the checker holds the money to.
fn bins(old_bins: &Path) -> anyhow::Result<PathBuf> {
    let dir = std::env::current_dir()?.join(".run/upgrade/bins");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(old_bins)? {
        let name = entry?.file_name();
        if name != "psp-sim" {
            std::os::unix::fs::symlink(old_bins.join(&name), dir.join(&name))?;
        }
    }
    std::os::unix::fs::symlink(std::path::absolute(bin("psp-sim"))?, dir.join("psp-sim"))?;
    Ok(dir)
}

/// The runbook's steps, each after [`BETWEEN_STEPS`] more decided orders.
/// Returns today's processes, running.
async fn roll(old: &mut Cluster, dbs: &Dbs) -> anyhow::Result<Cluster> {
    let services: Vec<_> = contracts::roster::services()
        .iter()
        .filter(|s| old.procs.contains_key(&format!("{}-api", s.name)))
        .collect();
    decided_more(dbs, BETWEEN_STEPS).await?;
    // 1. Today's migrations, beside the old release: from here on, its
    //    relays claim nothing (migration 0012).
    for svc in &services {
        let mut migrate = std::process::Command::new(bin(svc.name));
        migrate.arg("migrate").envs(old.env().iter().cloned());
        let out = tokio::task::spawn_blocking(move || migrate.output()).await??;
        anyhow::ensure!(
            out.status.success(),
            "today's {} migrate: {}",
            svc.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // 2. Today's consumers and relays beside the old ones.
    let mut today = Cluster::new(
        old.env().to_vec(),
        PathBuf::from(".run/upgrade/today"),
        UPGRADE.port_base + 250,
    )?;
    for svc in &services {
        today.add(
            &format!("{}-consumer", svc.name),
            bin(svc.name),
            &["consume"],
            None,
        );
        if svc.outbox {
            today.add(
                &format!("{}-relay", svc.name),
                bin(svc.name),
                &["relay"],
                None,
            );
        }
    }
    today.start_all()?;
    today.wait_ready().await?;
    decided_more(dbs, BETWEEN_STEPS).await?;
    // 3. Each API in turn: the old one stops, today's takes its port.
    for svc in &services {
        let name = format!("{}-api", svc.name);
        stop(old, &name).await?;
        today.add(
            &name,
            bin(svc.name),
            &["serve"],
            Some(UPGRADE.port(svc.name)),
        );
        today.start(&name, None)?;
        today.ready(&[&name]).await?;
    }
    decided_more(dbs, BETWEEN_STEPS).await?;
    // 4. The old consumers and relays stop.
    for svc in &services {
        stop(old, &format!("{}-consumer", svc.name)).await?;
        if svc.outbox {
            stop(old, &format!("{}-relay", svc.name)).await?;
        }
    }
    decided_more(dbs, BETWEEN_STEPS).await?;
    Ok(today)
}

/// The graceful stop a rolling upgrade gives a process: SIGTERM, and its
/// drain (bounded by its own shutdown deadline).
async fn stop(cluster: &mut Cluster, name: &str) -> anyhow::Result<()> {
    cluster.signal(name, "TERM")?;
    cluster.wait_exit(name, Duration::from_secs(40)).await;
    Ok(())
}

/// Waits (at most [`QUIET`]) until `more` orders of the tenant were decided
/// since the call.
async fn decided_more(dbs: &Dbs, more: i64) -> anyhow::Result<()> {
    let decided = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM orders WHERE tenant_id = $1 AND status <> 'pending'",
        )
        .bind(TENANT)
        .fetch_one(&dbs.orders)
        .await
    };
    let target = decided().await? + more;
    let deadline = Instant::now() + QUIET;
    while decided().await? < target {
        anyhow::ensure!(
            Instant::now() < deadline,
            "fewer than {more} orders decided in {QUIET:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Waits (at most [`QUIET`]) for quiet and the invariants, as the runner's
/// settle does for a scenario; the verdict, violations and all.
async fn settle(dbs: &Dbs, client: &Client) -> anyhow::Result<Verdict> {
    let deadline = Instant::now() + QUIET;
    loop {
        let quiet = dbs.quiet(TENANT).await?;
        let ledger: Ledger = client
            .http
            .get(format!("{}/control/ledger", UPGRADE.url("psp-sim")))
            .send()
            .await?
            .error_for_status()?
            .json::<Vec<psp_sim::KeyMoney>>()
            .await?
            .into_iter()
            .map(|m| (m.key.clone(), m))
            .collect();
        let verdict = dbs.check(TENANT, &ledger).await?;
        if (quiet && verdict.violations.is_empty()) || Instant::now() >= deadline {
            return Ok(verdict);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
