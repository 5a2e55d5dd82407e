//! Partial failures, in the world of the run (docs/adr/0023): a broker node
//! killed under load, the quorum lost and regained, a consumer frozen in
//! the middle of its transaction while its twin runs, a relay frozen in
//! the middle of its window. The checker judges each as any other.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::world::World;
use testkit::wait_until;

use crate::run::{Outcome, Run, Scenario, attempts_spent, orders_of, quiesce};

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![
        (
            "the broker node leading the queues killed -9 under load",
            |r, t| Box::pin(leader_killed(r, t)),
        ),
        (
            "2 of 3 broker nodes down for 60 s: quorum lost, regained",
            |r, t| Box::pin(quorum_lost(r, t)),
        ),
        (
            "a consumer frozen mid-transaction beside its twin, past its timeouts",
            |r, t| Box::pin(consumer_frozen(r, t)),
        ),
        ("a relay frozen mid-window for 90 s, then thawed", |r, t| {
            Box::pin(relay_frozen(r, t))
        }),
    ]
}

fn sku(tenant: i64) -> String {
    format!("SKU-{tenant}")
}

/// The node leading `queue` (its index in the world), asked of any node
/// that answers.
async fn leader_of(world: &'static World, queue: &str) -> anyhow::Result<usize> {
    let mut last = None;
    for i in 0..world.nodes().len() {
        match world.ctl(i, &["-s", "list_queues", "name", "leader"]).await {
            Ok(out) => {
                let leader = out
                    .lines()
                    .filter_map(|l| l.split_once('\t'))
                    .find(|(name, _)| name.trim() == queue)
                    .map(|(_, node)| node.trim().to_owned())
                    .ok_or_else(|| anyhow::anyhow!("{queue} not listed: {out}"))?;
                return world
                    .nodes()
                    .iter()
                    .position(|n| n.name == leader)
                    .ok_or_else(|| anyhow::anyhow!("{queue}'s leader {leader} is not ours"));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no broker node answered")))
}

/// Under steady load, the node leading inventory's queue dies without a
/// word (`kill -9` of its VM) and comes back 20 s later. Clients on it
/// reconnect to the others; the queues elect new leaders.
async fn leader_killed(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 100_000).await?;
    let (client, dbs, world) = (&run.client, &run.dbs, run.world);
    let queue = format!("{}inventory.stock", crate::run::PREFIX);
    let done = AtomicBool::new(false);
    let (placed, killed) = tokio::join!(client.orders_until(tenant, 10, &done), async {
        let fault = async {
            wait_until(Duration::from_secs(60), "50 orders placed", || async {
                orders_of(dbs, tenant).await >= 50
            })
            .await;
            let leader = leader_of(world, &queue).await?;
            world.kill_node(leader).await?;
            let at = orders_of(dbs, tenant).await;
            tokio::time::sleep(Duration::from_secs(20)).await;
            // The load stops with the outage; what it left drains after.
            done.store(true, Ordering::Release);
            world.start_node(leader).await?;
            anyhow::Ok((world.nodes()[leader].name.clone(), at))
        };
        let outcome = fault.await;
        done.store(true, Ordering::Release);
        outcome
    });
    let (node, at) = killed?;
    let placed = placed?;
    Ok((
        format!("kill -9 of {node} (leading {queue}) at order {at} of {placed}; back after 20 s"),
        vec![],
    ))
}

/// Two of three nodes die: every quorum queue loses its majority and can
/// take nothing. Orders keep coming and wait in the outboxes, spending no
/// attempt; nothing reaches a DLQ; all completes once the nodes are back.
async fn quorum_lost(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 100_000).await?;
    let (client, dbs, world) = (&run.client, &run.dbs, run.world);
    let down = [1, 2];
    let done = AtomicBool::new(false);
    let (placed, outage) = tokio::join!(client.orders_until(tenant, 5, &done), async {
        let outage = async {
            wait_until(Duration::from_secs(60), "30 orders placed", || async {
                orders_of(dbs, tenant).await >= 30
            })
            .await;
            for i in down {
                world.kill_node(i).await?;
            }
            let at = orders_of(dbs, tenant).await;
            tokio::time::sleep(Duration::from_secs(60)).await;
            let during = orders_of(dbs, tenant).await - at;
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_messages WHERE tenant_id = $1 AND processed_at IS NULL",
            )
            .bind(tenant)
            .fetch_one(&dbs.orders)
            .await?;
            done.store(true, Ordering::Release);
            let started = futures_util::future::join_all(down.map(|i| world.start_node(i))).await;
            started.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
            anyhow::Ok((at, during, pending))
        };
        let outcome = outage.await;
        done.store(true, Ordering::Release);
        outcome
    });
    let (at, during, pending) = outage?;
    let placed = placed?;
    quiesce(run, tenant).await?;
    let violations = attempts_spent(run, tenant, "the lost quorum").await?;
    Ok((
        format!(
            "2 of 3 nodes killed -9 at order {at} of {placed} for 60 s; {during} orders accepted meanwhile, {pending} events waited in the orders outbox"
        ),
        violations,
    ))
}

/// The bound on how long an order waits on a consumer frozen in its
/// transaction, with the defaults: PostgreSQL ends the frozen session after
/// the app role's 15 s `idle_in_transaction_session_timeout` (its locks
/// go), the broker drops the frozen connection after two missed 15 s
/// heartbeats (its unacked deliveries go to the twin), plus the twin's
/// retry backoff and the saga's own steps.
const FROZEN_BOUND: Duration = Duration::from_secs(120);
/// Frozen at least past the timeouts that free its locks and its
/// deliveries (15 s, 30 s), with a margin, and until every order is
/// decided (at most [`FROZEN_BOUND`]): each decision is made while it is
/// frozen, and thawed it finds its session and its connection gone.
/// Frozen for the whole bound whatever the orders did (until session 30),
/// it showed nothing more, for a minute more of CI in each of two passes.
const FROZEN_AT_LEAST: Duration = Duration::from_secs(45);

/// Inventory's consumer stops itself (SIGSTOP) inside its transaction, with
/// the product row locked and deliveries unacked, and stays frozen while
/// its twin runs (see [`FROZEN_AT_LEAST`]). Orders placed meanwhile must be decided
/// within [`FROZEN_BOUND`]; the thawed process must not apply anything twice.
async fn consumer_frozen(run: &mut Run, tenant: i64) -> Outcome {
    const FROZEN: &str = "inventory-consumer";
    const TWIN: &str = "inventory-consumer-2";
    run.client.stock(tenant, &sku(tenant), 1000).await?;
    run.cluster.start(TWIN, None)?;
    run.cluster.kill9(FROZEN);
    run.cluster
        .start(FROZEN, Some("consumer.before_commit=freeze"))?;
    // Orders until the frozen one has taken one (the twin takes others).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    while !run.cluster.frozen(FROZEN) {
        anyhow::ensure!(Instant::now() < deadline, "{FROZEN} never froze");
        run.client
            .order(
                tenant,
                &format!("freeze-{tenant}-{i}"),
                "c-f",
                &sku(tenant),
                1,
            )
            .await?;
        i += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let frozen_at = Instant::now();
    let since = db_now(run).await?;
    run.client.orders(tenant, 30).await?;
    // Every order of the tenant decided while the process is still frozen.
    let decided = wait_decided(
        run,
        tenant,
        FROZEN_BOUND.saturating_sub(frozen_at.elapsed()),
    )
    .await;
    let (slowest, undecided): (f64, i64) = sqlx::query_as(
        "SELECT coalesce(extract(epoch FROM max(updated_at - greatest(created_at, $2::timestamptz))), 0)::float8,
                count(*) FILTER (WHERE status = 'pending')
         FROM orders WHERE tenant_id = $1",
    )
    .bind(tenant)
    .bind(since)
    .fetch_one(&run.dbs.orders)
    .await?;
    let still_frozen = run.cluster.frozen(FROZEN);
    tokio::time::sleep(FROZEN_AT_LEAST.saturating_sub(frozen_at.elapsed())).await;
    let frozen_for = frozen_at.elapsed();
    run.cluster.signal(FROZEN, "CONT")?;
    quiesce(run, tenant).await?;
    // Thawed, it went on as it was; now as the stack runs it, unarmed.
    run.cluster.kill9(FROZEN);
    run.cluster.start(FROZEN, None)?;
    run.cluster.kill9(TWIN);
    let mut violations = Vec::new();
    if !decided || undecided > 0 {
        violations.push(format!(
            "frozen: {undecided} order(s) still pending while {FROZEN} was frozen"
        ));
    }
    if slowest > FROZEN_BOUND.as_secs_f64() {
        violations.push(format!(
            "frozen: an order took {slowest:.0} s to be decided beside a frozen consumer (bound {FROZEN_BOUND:?})"
        ));
    }
    if !still_frozen {
        violations.push(format!("scenario: {FROZEN} thawed early"));
    }
    Ok((
        format!(
            "{FROZEN} SIGSTOPped inside its transaction for {}s beside {TWIN}; 31 orders, slowest decided in {slowest:.0} s (bound {}s), then thawed",
            frozen_for.as_secs(),
            FROZEN_BOUND.as_secs()
        ),
        violations,
    ))
}

/// The database's clock: order times are compared on it, not ours.
async fn db_now(run: &Run) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT now()::text")
        .fetch_one(&run.dbs.orders)
        .await?)
}

/// Whether every order of the tenant left `pending` within `limit`.
async fn wait_decided(run: &Run, tenant: i64, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM orders WHERE tenant_id = $1 AND status = 'pending'",
        )
        .bind(tenant)
        .fetch_one(&run.dbs.orders)
        .await
        .unwrap_or(1);
        if pending == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The orders relay stops itself after publishing a window, before its
/// confirms are read, holding its claimed rows; a second relay runs beside
/// it. Thawed 90 s later, its session is gone: nothing is lost, whatever it
/// publishes again is absorbed.
async fn relay_frozen(run: &mut Run, tenant: i64) -> Outcome {
    const FROZEN: &str = "orders-relay";
    const TWIN: &str = "orders-relay-2";
    run.client.stock(tenant, &sku(tenant), 1000).await?;
    run.cluster.kill9(FROZEN);
    run.cluster
        .start(FROZEN, Some("relay.before_confirm=freeze"))?;
    let (client, cluster) = (&run.client, &run.cluster);
    let (placed, ()) = tokio::join!(
        client.orders(tenant, 40),
        wait_until(Duration::from_secs(60), "the relay frozen", || async {
            cluster.frozen(FROZEN)
        })
    );
    placed?;
    let frozen_at = Instant::now();
    run.cluster.start(TWIN, None)?;
    // New keys: the first 40 replayed would make no new orders.
    let more = run.client.orders_from(tenant, 40, 20).await;
    let decided = wait_decided(run, tenant, Duration::from_secs(85)).await;
    tokio::time::sleep(Duration::from_secs(90).saturating_sub(frozen_at.elapsed())).await;
    run.cluster.signal(FROZEN, "CONT")?;
    more?;
    quiesce(run, tenant).await?;
    run.cluster.kill9(FROZEN);
    run.cluster.start(FROZEN, None)?;
    run.cluster.kill9(TWIN);
    let mut violations = Vec::new();
    if !decided {
        violations.push(format!(
            "frozen: orders still pending 85 s into the freeze of {FROZEN}, with {TWIN} running"
        ));
    }
    Ok((
        format!(
            "{FROZEN} SIGSTOPped between publish and confirm for 90 s; {TWIN} beside it; 60 orders"
        ),
        violations,
    ))
}
