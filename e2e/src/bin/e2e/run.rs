//! What the scenarios share with the runner: the run's stack and client
//! ([`Run`]), the shapes of a scenario and its outcome, and the helpers
//! that wait for quiet, read the provider's ledger and count orders. The
//! scenario modules import from here, never from the runner (`main.rs`)
//! or from each other.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use e2e::check::{Dbs, Ledger, Verdict};
use e2e::cluster::{CONSUMERS, Client, Layout};
use e2e::procs::Cluster;
use e2e::world::World;
use serde_json::Value;
use testkit::amqp_url;

pub(crate) const PREFIX: &str = "e2e.";

pub(crate) const QUIET: Duration = Duration::from_secs(120);

/// The provider simulator of the run.
pub(crate) const SIM: &str = "http://127.0.0.1:9099";

pub(crate) struct Run {
    pub(crate) world: &'static World,
    pub(crate) cluster: Cluster,
    pub(crate) dbs: Dbs,
    pub(crate) client: Client,
    /// Poison the scenarios injected on purpose: expected DLQ depth per
    /// consumer DLQ, and rows expected in the outbox DLQ tables.
    pub(crate) poison: HashMap<String, u32>,
    pub(crate) outbox_poison: i64,
    /// The processes of the stack proper (not the extra relays).
    pub(crate) base: Vec<String>,
}

/// How a scenario that cannot run here starts what it returns, e.g.
/// `skipped: no network namespaces`: a SKIP row, never a PASS.
pub(crate) const SKIPPED: &str = "skipped: ";

pub(crate) type Outcome = anyhow::Result<(String, Vec<String>)>;

pub(crate) type Scenario = (
    &'static str,
    fn(&mut Run, i64) -> futures_util::future::BoxFuture<'_, Outcome>,
);

/// The stack's layout: ports 9081-9084 and 9099, databases `e2e_*`.
pub(crate) const LAYOUT: Layout = Layout {
    name: "e2e",
    port_base: 9080,
    profile: "debug",
};

pub(crate) fn bin(name: &str) -> PathBuf {
    LAYOUT.bin(name)
}

/// Waits (at most `QUIET`) until the system is quiet and the tenant's
/// invariants hold, then returns the checker's verdict, violations and all:
/// a lost event shows as one still missing at the deadline.
pub(crate) async fn settle(run: &Run, tenant: i64) -> anyhow::Result<Verdict> {
    let deadline = Instant::now() + QUIET;
    loop {
        // A database or broker still coming back is "not yet", not a verdict.
        let attempt = async {
            let quiet = run.dbs.quiet(tenant).await?;
            let mut verdict = run.dbs.check(tenant, &ledger(run).await?).await?;
            dead_letters(run, &mut verdict).await?;
            anyhow::Ok((quiet, verdict))
        };
        match attempt.await {
            Ok((quiet, verdict)) => {
                if (quiet && verdict.violations.is_empty()) || Instant::now() >= deadline {
                    if !quiet {
                        println!("   not quiet after {QUIET:?}");
                    }
                    return Ok(verdict);
                }
            }
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every DLQ holds exactly the poison injected on purpose, nothing else.
pub(crate) async fn dead_letters(run: &Run, verdict: &mut Verdict) -> anyhow::Result<()> {
    let (queues, rows) = dead_letter_depths(run).await?;
    for (dlq, depth) in queues {
        let expected = run.poison.get(&dlq).copied().unwrap_or(0);
        verdict.dead_letters += depth;
        if depth != expected {
            verdict.violations.push(format!(
                "DLQ: {dlq} holds {depth} messages, {expected} injected"
            ));
        }
    }
    verdict.dead_letters += u32::try_from(rows).unwrap_or(u32::MAX);
    if rows != run.outbox_poison {
        verdict.violations.push(format!(
            "DLQ: the outbox DLQ tables hold {rows} rows, {} injected",
            run.outbox_poison
        ));
    }
    Ok(())
}

/// After a failed scenario: the dead letters it left are its own, and the
/// next scenario is judged on the letters it makes. Counted against every
/// later one, one stray letter failed each of them, and each waited
/// [`QUIET`] for the letter to go (a CI run, session 29).
pub(crate) async fn charge_dead_letters(run: &mut Run) -> anyhow::Result<()> {
    let (queues, rows) = dead_letter_depths(run).await?;
    run.poison.extend(queues);
    run.outbox_poison = rows;
    Ok(())
}

/// Each consumer's DLQ depth, and the rows of the outbox DLQ tables.
async fn dead_letter_depths(run: &Run) -> anyhow::Result<(Vec<(String, u32)>, i64)> {
    let conn = reliability::broker::connect(&amqp_url(), "e2e-checker").await?;
    let channel = reliability::broker::bounded(conn.create_channel()).await?;
    let mut queues = Vec::new();
    for c in CONSUMERS {
        let dlq = reliability::broker::dead_letter_queue(&format!("{PREFIX}{c}"));
        let depth =
            reliability::broker::bounded(reliability::broker::queue_depth(&channel, &dlq)).await?;
        queues.push((dlq, depth));
    }
    let _ = reliability::broker::bounded(conn.close(200, "checked".into())).await;
    let mut rows = 0;
    for pool in [&run.dbs.orders, &run.dbs.inventory, &run.dbs.payments] {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages_dlq")
            .fetch_one(pool)
            .await?;
        rows += n;
    }
    Ok((queues, rows))
}

/// The tenant's outbox rows relayed and its orders decided (between the
/// steps of a scenario). Never fails: if it does not get quiet, the checker
/// says why.
pub(crate) async fn quiesce(run: &Run, tenant: i64) -> anyhow::Result<()> {
    let deadline = Instant::now() + QUIET;
    while !run.dbs.quiet(tenant).await.unwrap_or(false) {
        if Instant::now() >= deadline {
            println!("   not quiet after {QUIET:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// The provider's money per charge key, as it reports it.
pub(crate) async fn ledger(run: &Run) -> anyhow::Result<Ledger> {
    let all: Vec<psp_sim::KeyMoney> = run
        .client
        .http
        .get(format!("{SIM}/control/ledger"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(all.into_iter().map(|m| (m.key.clone(), m)).collect())
}

/// Sets the simulator's faults for the next calls (`{}`: none).
pub(crate) async fn sim_faults(run: &Run, faults: Value) -> anyhow::Result<()> {
    run.client
        .http
        .post(format!("{SIM}/control/faults"))
        .json(&faults)
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

pub(crate) async fn orders_of(dbs: &Dbs, tenant: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(&dbs.orders)
        .await
        .unwrap_or(0)
}

/// Outbox rows of the tenant charged an attempt: none may be, for an
/// outage of the broker.
pub(crate) async fn attempts_spent(
    run: &Run,
    tenant: i64,
    why: &str,
) -> anyhow::Result<Vec<String>> {
    let mut violations = Vec::new();
    for (svc, pool) in [
        ("orders", &run.dbs.orders),
        ("inventory", &run.dbs.inventory),
        ("payments", &run.dbs.payments),
    ] {
        let attempts: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(attempts), 0)::bigint FROM outbox_messages WHERE tenant_id = $1",
        )
        .bind(tenant)
        .fetch_one(pool)
        .await?;
        if attempts > 0 {
            violations.push(format!(
                "relay: {why} cost {svc}'s outbox rows {attempts} attempt(s)"
            ));
        }
    }
    Ok(violations)
}

/// Runs a command off the async threads (the traffic keeps flowing).
pub(crate) async fn run_cmd(program: &str, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    Ok(out)
}
