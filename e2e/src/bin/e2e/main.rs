//! `make e2e`: the system as real processes against the real PostgreSQL and
//! RabbitMQ, put through crashes (`kill -9`, fail points that abort at exact
//! places), a broker restart, duplicate storms and client retries. After each
//! scenario it waits (with a deadline) for the system to go quiet, then
//! checks the invariants of ARCHITECTURE.md from the databases and the
//! provider's charge counts. Prints a table; exits 1 on any violation.
//!
//! It runs on databases, ports (908x, 9099), an exchange and queues of its
//! own, so it never touches `make up`'s stack.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use e2e::check::{Dbs, Ledger, Verdict};
use e2e::cluster::{self, CONSUMERS, Client, Layout, SECRET};
use e2e::procs::Cluster;
use futures_util::FutureExt;
use reliability::testing::{amqp_url, wait_until};
use serde_json::Value;

const PREFIX: &str = "e2e.";
const QUIET: Duration = Duration::from_secs(120);
/// The provider simulator of the run.
const SIM: &str = "http://127.0.0.1:9099";

struct Run {
    cluster: Cluster,
    dbs: Dbs,
    client: Client,
    /// Poison the scenarios injected on purpose: expected DLQ depth per
    /// consumer DLQ, and rows expected in the outbox DLQ tables.
    poison: HashMap<String, u32>,
    outbox_poison: i64,
    /// The processes of the stack proper (not the extra relays).
    base: Vec<String>,
}

struct Row {
    name: &'static str,
    faults: String,
    verdict: Verdict,
    secs: f64,
}

mod alarm;
mod faults;
mod hostile;
mod money;
mod scale;

/// How long one scenario may run before it counts as stuck.
const SCENARIO_LIMIT: Duration = Duration::from_secs(300);

type Outcome = anyhow::Result<(String, Vec<String>)>;
type Scenario = (
    &'static str,
    fn(&mut Run, i64) -> futures_util::future::BoxFuture<'_, Outcome>,
);

fn scenarios() -> Vec<Scenario> {
    let mut all: Vec<Scenario> = vec![
        (
            "baseline: stock, orders, too many units, unknown sku",
            |r, t| Box::pin(baseline(r, t)),
        ),
        ("relay aborts after confirm, before mark", |r, t| {
            Box::pin(crash_with_fail_point(
                r,
                t,
                "orders-relay",
                "relay.after_confirm=abort",
            ))
        }),
        ("relay aborts after publish, before the confirm", |r, t| {
            Box::pin(crash_with_fail_point(
                r,
                t,
                "orders-relay",
                "relay.before_confirm=abort",
            ))
        }),
        ("relay kill -9 mid-flow", |r, t| {
            Box::pin(kill_mid_flow(r, t, "orders-relay"))
        }),
        (
            "three orders relays and two inventory relays at once",
            |r, t| Box::pin(faults::many_relays(r, t)),
        ),
        (
            "an earlier outbox id commits after later ones are consumed",
            |r, t| Box::pin(faults::late_commit(r, t)),
        ),
        (
            "unroutable event: backoff, then the outbox DLQ table",
            |r, t| Box::pin(faults::unroutable(r, t)),
        ),
        ("consumer aborts after commit, before ack", |r, t| {
            Box::pin(crash_with_fail_point(
                r,
                t,
                "inventory-consumer",
                "consumer.after_commit=abort",
            ))
        }),
        ("consumer aborts mid-transaction", |r, t| {
            Box::pin(crash_with_fail_point(
                r,
                t,
                "inventory-consumer",
                "consumer.before_commit=abort",
            ))
        }),
        ("payments aborts after provider answered", |r, t| {
            Box::pin(crash_with_fail_point(
                r,
                t,
                "payments-consumer",
                "payments.after_provider=abort",
            ))
        }),
        ("provider charges, then times out or fails", |r, t| {
            Box::pin(faults::provider_charges_then_fails(r, t))
        }),
        ("broker restart with 1000 orders in flight", |r, t| {
            Box::pin(faults::broker_restart(r, t))
        }),
        (
            "broker memory alarm blocks publishers under load",
            |r, t| Box::pin(alarm::memory_alarm(r, t)),
        ),
        ("PostgreSQL restart -m immediate under load", |r, t| {
            Box::pin(faults::postgres_restart(r, t))
        }),
        ("duplicate storm: every event re-published twice", |r, t| {
            Box::pin(duplicate_storm(r, t))
        }),
        (
            "reordered delivery: projection gets each order backwards",
            |r, t| Box::pin(faults::reordered(r, t)),
        ),
        (
            "poison: malformed, unknown version, failing handler",
            |r, t| Box::pin(faults::poison(r, t)),
        ),
        ("50 concurrent identical POSTs", |r, t| {
            Box::pin(identical_posts(r, t))
        }),
        (
            "Idempotency-Key rules: other body, bad keys, replays",
            |r, t| Box::pin(hostile::key_rules(r, t)),
        ),
        ("orders API kill -9 under client retries", |r, t| {
            Box::pin(api_killed_under_retries(r, t))
        }),
        ("20 orders race for 10 units", |r, t| {
            Box::pin(faults::race(r, t))
        }),
        (
            "tenants: cross-tenant reads and writes, RLS wall",
            |r, t| Box::pin(hostile::cross_tenant(r, t)),
        ),
        ("hostile input: tokens, bodies, sizes, ranges", |r, t| {
            Box::pin(hostile::bad_input(r, t))
        }),
        (
            "replicas: every role x2-3, one of each killed -9 under load",
            |r, t| Box::pin(scale::replicas(r, t)),
        ),
        ("provider at 300 ms under steady load", |r, t| {
            Box::pin(scale::slow_provider(r, t))
        }),
        ("one tenant bursts 10x beside two others", |r, t| {
            Box::pin(scale::burst(r, t))
        }),
        (
            "subscriber queues deleted while their consumers are down",
            |r, t| Box::pin(scale::deleted_queues(r, t)),
        ),
    ];
    all.extend(money::scenarios());
    all
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut run = setup().await?;
    println!(
        "stack up in {:.1}s; running scenarios (logs in .run/e2e/)",
        started.elapsed().as_secs_f64()
    );
    // `E2E_ONLY=broker` runs the scenarios whose name contains "broker".
    let only = std::env::var("E2E_ONLY").ok();
    let mut rows = Vec::new();
    for (i, (name, scenario)) in scenarios().into_iter().enumerate() {
        let tenant = i as i64 + 1;
        if only.as_deref().is_some_and(|o| !name.contains(o)) {
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
        // Whatever happened, the next scenario starts from a whole stack.
        let base = run.base.clone();
        let restarted = run.cluster.restore(&base)?;
        if !restarted.is_empty() {
            extra.push(format!(
                "scenario left {restarted:?} down or armed (restarted)"
            ));
        }
        let mut verdict = settle(&run, tenant).await?;
        verdict.violations.extend(extra);
        // The verdict now, not only in the table at the end.
        let secs = t0.elapsed().as_secs_f64();
        match verdict.violations.as_slice() {
            [] => println!("   PASS {name} ({secs:.1} s): {faults}"),
            violations => println!("   FAIL {name} ({secs:.1} s): {}", violations.join("; ")),
        }
        rows.push(Row {
            name,
            faults,
            verdict,
            secs: t0.elapsed().as_secs_f64(),
        });
    }
    run.cluster.stop_all();
    if report(&rows, started.elapsed().as_secs_f64()) {
        anyhow::bail!("invariants violated");
    }
    Ok(())
}

fn report(rows: &[Row], total: f64) -> bool {
    println!();
    println!(
        "{:<62} {:>6} {:>5} {:>5} {:>6} {:>5} {:>4} {:>4} {:>5}  verdict",
        "scenario", "orders", "conf", "canc", "events", "dups", "lost", "dlq", "secs"
    );
    let mut failed = false;
    for r in rows {
        let lost = r
            .verdict
            .violations
            .iter()
            .filter(|v| v.starts_with("I1"))
            .count();
        let ok = r.verdict.violations.is_empty();
        failed |= !ok;
        println!(
            "{:<62} {:>6} {:>5} {:>5} {:>6} {:>5} {:>4} {:>4} {:>5.1}  {}",
            r.name,
            r.verdict.orders,
            r.verdict.confirmed,
            r.verdict.cancelled,
            r.verdict.events,
            r.verdict.duplicates,
            lost,
            r.verdict.dead_letters,
            r.secs,
            if ok { "PASS" } else { "FAIL" }
        );
        println!("    faults: {}", r.faults);
    }
    for r in rows.iter().filter(|r| !r.verdict.violations.is_empty()) {
        println!("\n{} violated:", r.name);
        for v in &r.verdict.violations {
            println!("  {v}");
        }
    }
    let passed = rows
        .iter()
        .filter(|r| r.verdict.violations.is_empty())
        .count();
    println!(
        "\ncolumns: dups = duplicate deliveries absorbed (I2), lost = committed events never applied (I1), dlq = messages in DLQs (only injected poison allowed)"
    );
    println!(
        "e2e: {passed} passed, {} failed in {total:.0}s",
        rows.len() - passed
    );
    failed
}

/// The stack's layout: ports 9081-9084 and 9099, databases `e2e_*`.
const LAYOUT: Layout = Layout {
    name: "e2e",
    port_base: 9080,
    profile: "debug",
};

fn bin(name: &str) -> PathBuf {
    LAYOUT.bin(name)
}

async fn setup() -> anyhow::Result<Run> {
    // Backoff in steps of 200 ms (not 30 s): an unroutable event reaches
    // the DLQ table after 10 attempts in about 10 s.
    faults::ensure_max_connections(300).await?;
    // Provider calls: 6 in flight, 3 per tenant, so that a tenant's burst
    // against a slow provider meets the share at a load these 2 cores carry
    // in debug builds.
    let (mut cluster, dbs) = cluster::launch(
        &LAYOUT,
        &[
            ("RELAY_BACKOFF_MS", "200"),
            ("RELAY_CONFIRM_TIMEOUT_MS", "2000"),
            ("PSP_MAX_IN_FLIGHT", "6"),
            ("PSP_TENANT_IN_FLIGHT", "3"),
        ],
    )
    .await?;
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
        cluster,
        dbs,
        client: Client::new(&LAYOUT)?,
        poison: HashMap::new(),
        outbox_poison: 0,
        base,
    })
}

/// Waits (at most `QUIET`) until the system is quiet and the tenant's
/// invariants hold, then returns the checker's verdict, violations and all:
/// a lost event shows as one still missing at the deadline.
async fn settle(run: &Run, tenant: i64) -> anyhow::Result<Verdict> {
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
async fn dead_letters(run: &Run, verdict: &mut Verdict) -> anyhow::Result<()> {
    let conn = reliability::broker::connect(&amqp_url(), "e2e-checker").await?;
    let channel = reliability::broker::bounded(conn.create_channel()).await?;
    for c in CONSUMERS {
        let dlq = reliability::broker::dead_letter_queue(&format!("{PREFIX}{c}"));
        let depth =
            reliability::broker::bounded(reliability::broker::queue_depth(&channel, &dlq)).await?;
        let expected = run.poison.get(&dlq).copied().unwrap_or(0);
        verdict.dead_letters += depth;
        if depth != expected {
            verdict.violations.push(format!(
                "DLQ: {dlq} holds {depth} messages, {expected} injected"
            ));
        }
    }
    let _ = reliability::broker::bounded(conn.close(200, "checked".into())).await;
    let mut rows = 0;
    for pool in [&run.dbs.orders, &run.dbs.inventory, &run.dbs.payments] {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages_dlq")
            .fetch_one(pool)
            .await?;
        rows += n;
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

/// The tenant's outbox rows relayed and its orders decided (between the
/// steps of a scenario). Never fails: if it does not get quiet, the checker
/// says why.
async fn quiesce(run: &Run, tenant: i64) -> anyhow::Result<()> {
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
async fn ledger(run: &Run) -> anyhow::Result<Ledger> {
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
async fn sim_faults(run: &Run, faults: Value) -> anyhow::Result<()> {
    run.client
        .http
        .post(format!("{SIM}/control/faults"))
        .json(&faults)
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

async fn baseline(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    run.client.orders(tenant, 10).await?;
    let too_many = run
        .client
        .order(tenant, "too-many", "c-x", &format!("SKU-{tenant}"), 1000)
        .await?;
    let unknown = run
        .client
        .order(tenant, "unknown", "c-y", "NO-SUCH-SKU", 1)
        .await?;
    quiesce(run, tenant).await?;
    let mut violations = vec![];
    for (what, id) in [("too many units", too_many), ("unknown sku", unknown)] {
        let status = order_status(&run.dbs, id).await?;
        let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE order_id = $1")
            .bind(id)
            .fetch_one(&run.dbs.payments)
            .await?;
        if status != "cancelled" || payments != 0 {
            violations.push(format!(
                "I6: order {id} ({what}) is {status} with {payments} payment(s); expected cancelled, none"
            ));
        }
    }
    Ok((
        "none; an order over stock, an unknown sku".into(),
        violations,
    ))
}

async fn order_status(dbs: &Dbs, order_id: i64) -> anyhow::Result<String> {
    Ok(
        sqlx::query_scalar("SELECT status FROM orders WHERE order_id = $1")
            .bind(order_id)
            .fetch_one(&dbs.orders)
            .await?,
    )
}

/// Restarts `proc` with a fail point that aborts it at an exact place,
/// drives orders until it dies there, then restarts it clean.
async fn crash_with_fail_point(
    run: &mut Run,
    tenant: i64,
    proc: &str,
    fail_point: &str,
) -> anyhow::Result<(String, Vec<String>)> {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    run.cluster.kill9(proc);
    run.cluster.start(proc, Some(fail_point))?;
    run.client.orders(tenant, 10).await?;
    run.cluster.wait_exit(proc, Duration::from_secs(60)).await;
    run.cluster.start(proc, None)?;
    Ok((format!("{fail_point} in {proc}, restart"), vec![]))
}

async fn kill_mid_flow(
    run: &mut Run,
    tenant: i64,
    proc: &str,
) -> anyhow::Result<(String, Vec<String>)> {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    let (client, cluster, dbs) = (&run.client, &mut run.cluster, &run.dbs);
    let (placed, ()) = tokio::join!(client.orders(tenant, 30), async {
        wait_until(Duration::from_secs(30), "orders flowing", || async {
            orders_of(dbs, tenant).await >= 5
        })
        .await;
        cluster.kill9(proc);
    });
    placed?;
    orders_after_kill(&run.client, tenant).await?;
    run.cluster.start(proc, None)?;
    Ok((
        format!("kill -9 {proc} with orders in flight, restart"),
        vec![],
    ))
}

async fn orders_of(dbs: &Dbs, tenant: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(&dbs.orders)
        .await
        .unwrap_or(0)
}

/// A few more orders while a part is down: they must wait, not vanish.
async fn orders_after_kill(client: &Client, tenant: i64) -> anyhow::Result<()> {
    for i in 0..5 {
        client
            .order(
                tenant,
                &format!("while-down-{tenant}-{i}"),
                "c-down",
                &format!("SKU-{tenant}"),
                1,
            )
            .await?;
    }
    Ok(())
}

async fn duplicate_storm(run: &mut Run, tenant: i64) -> anyhow::Result<(String, Vec<String>)> {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    run.client.orders(tenant, 10).await?;
    for round in 0..2 {
        quiesce(run, tenant).await?;
        for pool in [&run.dbs.orders, &run.dbs.inventory, &run.dbs.payments] {
            sqlx::query("UPDATE outbox_messages SET processed_at = NULL WHERE tenant_id = $1")
                .bind(tenant)
                .execute(pool)
                .await?;
        }
        println!(
            "   re-published every event of tenant {tenant} (round {})",
            round + 1
        );
    }
    Ok(("every event of the tenant published 3 times".into(), vec![]))
}

async fn identical_posts(run: &mut Run, tenant: i64) -> anyhow::Result<(String, Vec<String>)> {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    let sku = format!("SKU-{tenant}");
    let ids = futures_util::future::join_all(
        (0..50).map(|_| run.client.order(tenant, "the-same-key", "c-1", &sku, 1)),
    )
    .await;
    let ids: Vec<i64> = ids.into_iter().collect::<anyhow::Result<_>>()?;
    let mut violations = vec![];
    if ids.iter().any(|id| *id != ids[0]) {
        violations.push(format!(
            "I3: one key answered with different orders: {ids:?}"
        ));
    }
    let n = orders_of(&run.dbs, tenant).await;
    if n != 1 {
        violations.push(format!("I3: 50 identical POSTs made {n} orders"));
    }
    Ok((
        "50 concurrent POSTs, one Idempotency-Key".into(),
        violations,
    ))
}

async fn api_killed_under_retries(
    run: &mut Run,
    tenant: i64,
) -> anyhow::Result<(String, Vec<String>)> {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    let (client, cluster, dbs) = (&run.client, &mut run.cluster, &run.dbs);
    // The clients retry every key until answered, across the crash.
    let (placed, restarted) = tokio::join!(client.orders(tenant, 20), async {
        wait_until(Duration::from_secs(30), "orders flowing", || async {
            orders_of(dbs, tenant).await >= 3
        })
        .await;
        cluster.kill9("orders-api");
        cluster.start("orders-api", None)
    });
    restarted?;
    let ids = placed?;
    let mut distinct = ids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let n = orders_of(&run.dbs, tenant).await;
    let mut violations = vec![];
    if n != 20 || distinct.len() != 20 {
        violations.push(format!(
            "I3: 20 keys, retried across a crash, made {n} orders ({} distinct answers)",
            distinct.len()
        ));
    }
    Ok((
        "kill -9 orders serve; clients retry their keys".into(),
        violations,
    ))
}
