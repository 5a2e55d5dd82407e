//! Scale-out and topology scenarios: replicas of every role killed under
//! load, a slow provider under steady load, one tenant's burst beside the
//! others, and subscriber queues deleted while their consumers are down.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use lapin::options::QueueDeleteOptions;
use reliability::broker;
use serde_json::json;
use testkit::{amqp_url, wait_until};

use crate::run::{Outcome, PREFIX, Run, Scenario, ledger, orders_of, quiesce};

mod deleted;
use deleted::*;

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![
        (
            "replicas: every role x2-3, one of each killed -9 under load",
            |r, t| Box::pin(replicas(r, t)),
        ),
        ("provider at 300 ms under steady load", |r, t| {
            Box::pin(slow_provider(r, t))
        }),
        ("one tenant bursts 10x beside two others", |r, t| {
            Box::pin(burst(r, t))
        }),
        (
            "subscriber queues deleted while their consumers are down",
            |r, t| Box::pin(deleted_queues(r, t)),
        ),
    ]
}

/// Extra replicas the replica scenario starts beside the base stack.
pub const REPLICAS: [(&str, &str, &str); 11] = [
    ("orders-consumer-2", "orders", "consume"),
    ("orders-consumer-3", "orders", "consume"),
    ("inventory-consumer-2", "inventory", "consume"),
    ("inventory-consumer-3", "inventory", "consume"),
    ("payments-consumer-2", "payments", "consume"),
    ("payments-consumer-3", "payments", "consume"),
    ("projection-consumer-2", "projection", "consume"),
    ("projection-consumer-3", "projection", "consume"),
    ("graph-consumer-2", "graph", "consume"),
    ("graph-consumer-3", "graph", "consume"),
    ("payments-relay-2", "payments", "relay"),
];

fn sku(tenant: i64) -> String {
    format!("SKU-{tenant}")
}

async fn provider_latency(run: &Run, ms: u64) -> anyhow::Result<()> {
    run.client
        .http
        .post("http://127.0.0.1:9099/control/faults")
        .json(&json!({ "latency_ms": ms }))
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

/// Places `per_sec` orders a second for `secs` seconds, each at its
/// scheduled time whatever the earlier ones are doing (an open-loop load).
async fn paced(
    run: &Run,
    tenant: i64,
    tag: &str,
    per_sec: u32,
    secs: u32,
) -> anyhow::Result<Vec<i64>> {
    let start = tokio::time::Instant::now();
    let gap = Duration::from_secs_f64(1.0 / f64::from(per_sec));
    let sku = sku(tenant);
    let placed = join_all((0..per_sec * secs).map(|i| {
        let (key, sku) = (format!("{tag}-{tenant}-{i}"), sku.clone());
        async move {
            tokio::time::sleep_until(start + gap * i).await;
            run.client
                .order(tenant, &key, &format!("c-{i}"), &sku, 1)
                .await
        }
    }))
    .await;
    placed.into_iter().collect()
}

/// Seconds from placed to decided of each order (decided orders only).
async fn decision_times(run: &Run, tenant: i64, ids: &[i64]) -> anyhow::Result<Vec<f64>> {
    settle_times(&run.dbs.orders, "orders", tenant, ids).await
}

/// Seconds from recorded to settled of each of the tenant's payments for
/// `orders`: the provider step alone.
async fn payment_times(run: &Run, tenant: i64, orders: &[i64]) -> anyhow::Result<Vec<f64>> {
    settle_times(&run.dbs.payments, "payments", tenant, orders).await
}

/// `updated_at - created_at` of the settled rows of `table` (orders or
/// payments, both keyed by order), sorted.
async fn settle_times(
    pool: &sqlx::PgPool,
    table: &'static str,
    tenant: i64,
    orders: &[i64],
) -> anyhow::Result<Vec<f64>> {
    // `table` is one of two literals above: nothing to inject.
    let sql = format!(
        "SELECT EXTRACT(EPOCH FROM updated_at - created_at)::float8 FROM {table}
         WHERE tenant_id = $1 AND order_id = ANY($2) AND status <> 'pending'"
    );
    let mut secs: Vec<f64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .bind(orders)
        .fetch_all(pool)
        .await?;
    secs.sort_by(f64::total_cmp);
    Ok(secs)
}

fn p50(sorted: &[f64]) -> f64 {
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The invariants of tenants other than the scenario's own.
async fn check_also(run: &Run, tenants: &[i64]) -> anyhow::Result<Vec<String>> {
    let charges = ledger(run).await?;
    let mut violations = Vec::new();
    for &t in tenants {
        quiesce(run, t).await?;
        let verdict = run.dbs.check(t, &charges).await?;
        violations.extend(
            verdict
                .violations
                .into_iter()
                .map(|v| format!("tenant {t}: {v}")),
        );
    }
    Ok(violations)
}

/// Three replicas of every consumer role (each with its lanes, the payments
/// ones with their provider workers) and two relays per publisher compete;
/// one replica of each is killed -9 mid-load and comes back.
pub async fn replicas(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 10_000).await?;
    for (name, _, _) in REPLICAS {
        run.cluster.start(name, None)?;
    }
    for name in ["orders-relay-2", "inventory-relay-2"] {
        run.cluster.start(name, None)?;
    }
    let mut killed = Vec::new();
    for svc in e2e::cluster::services() {
        killed.push(format!("{svc}-consumer"));
    }
    for svc in contracts::roster::services().iter().filter(|s| s.outbox) {
        killed.push(format!("{}-relay", svc.name));
    }
    let (client, cluster, dbs) = (&run.client, &mut run.cluster, &run.dbs);
    let faults = async {
        let placed = |n: i64| async move {
            wait_until(
                Duration::from_secs(60),
                &format!("{n} orders placed"),
                || async { orders_of(dbs, tenant).await >= n },
            )
            .await;
        };
        placed(60).await;
        for name in &killed {
            cluster.kill9(name);
        }
        // Down while 40 more orders come in.
        placed(100).await;
        for name in &killed {
            cluster.start(name, None)?;
        }
        anyhow::Ok(())
    };
    let (placed, restarted) = tokio::join!(client.orders(tenant, 300), faults);
    restarted?;
    placed?;
    quiesce(run, tenant).await?;
    for (name, _, _) in REPLICAS {
        run.cluster.kill9(name);
    }
    for name in ["orders-relay-2", "inventory-relay-2"] {
        run.cluster.kill9(name);
    }
    // Competing consumers really competed: more than one lane of more than
    // one process added to each consumer's progress.
    let mut violations = Vec::new();
    for (pool, consumer) in [
        (&run.dbs.orders, "orders.saga"),
        (&run.dbs.inventory, "inventory.stock"),
        (&run.dbs.payments, "payments.charges"),
        (&run.dbs.projection, "projection.views"),
    ] {
        let stripes: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM consumer_offsets WHERE tenant_id = $1 AND consumer = $2 AND applied_count > 0",
        )
        .bind(tenant)
        .bind(consumer)
        .fetch_one(pool)
        .await?;
        if stripes < 2 {
            violations.push(format!(
                "scale: {consumer} applied from {stripes} lane(s) only"
            ));
        }
    }
    Ok((
        format!(
            "consumers x3 (4 lanes each), relays x2, payments workers x3; kill -9 {} mid-load, restarted; 300 orders",
            killed.join(", ")
        ),
        violations,
    ))
}

/// The provider answers in 300 ms; three tenants place 3 orders a second
/// each for 10 s. They are decided as fast as they arrive (a worker calling
/// the provider one payment at a time would manage 3 a second in all).
///
/// The rate is each tenant's orders over the time from its first decision
/// to its last: the pace of decisions, whatever the time each takes. Over
/// the time from the first placed to the last decided, as it was, it also
/// charged one order's whole latency. The debug stack's hops took that to
/// 2-3 s on a slow day of these 2 cores, and the run failed at 10.6/s for
/// 15/s offered with the decisions keeping pace (session 24). The latency
/// is reported beside the rate. The load is 9 a second, 45% of what 6
/// calls in flight allow against 300 ms: that day's debug stack decided
/// 10.5-13 a second before its 2 cores were full.
pub async fn slow_provider(run: &mut Run, tenant: i64) -> Outcome {
    const RATE: u32 = 3;
    let tenants = [tenant, tenant + 500, tenant + 1000];
    for t in tenants {
        run.client.stock(t, &sku(t), 10_000).await?;
    }
    provider_latency(run, 300).await?;
    let placed = tokio::try_join!(
        paced(run, tenants[0], "steady", RATE, 10),
        paced(run, tenants[1], "steady", RATE, 10),
        paced(run, tenants[2], "steady", RATE, 10)
    );
    for t in tenants {
        quiesce(run, t).await?;
    }
    provider_latency(run, 0).await?;
    let (a, b, c) = placed?;
    let mut rates = Vec::new();
    let mut times = Vec::new();
    for (t, ids) in tenants.iter().zip([a, b, c]) {
        let (first, last, n): (f64, f64, i64) = sqlx::query_as(
            "SELECT EXTRACT(EPOCH FROM min(updated_at))::float8, EXTRACT(EPOCH FROM max(updated_at))::float8,
                    count(*)
             FROM orders WHERE tenant_id = $1 AND order_id = ANY($2) AND status <> 'pending'",
        )
        .bind(t)
        .bind(&ids)
        .fetch_one(&run.dbs.orders)
        .await?;
        // n decisions span n - 1 gaps.
        rates.push((n - 1).max(0) as f64 / (last - first).max(0.001));
        times.extend(decision_times(run, *t, &ids).await?);
    }
    times.sort_by(f64::total_cmp);
    let decided: f64 = rates.iter().sum();
    let offered = f64::from(RATE) * 3.0;
    let mut violations = check_also(run, &tenants[1..]).await?;
    if decided < 0.8 * offered {
        violations.push(format!(
            "scale: {decided:.1} orders/s decided for {offered}/s offered"
        ));
    }
    Ok((
        format!(
            "provider latency 300 ms, 3 tenants x {RATE} orders/s for 10 s: decided at {decided:.1}/s, placed->decided p50 {:.0} ms, max {:.0} ms",
            p50(&times) * 1000.0,
            times.last().copied().unwrap_or_default() * 1000.0
        ),
        violations,
    ))
}

/// Two tenants place 2 orders a second each, first alone, then while a
/// third bursts at 20 a second against a provider answering in 300 ms. The
/// burst gets its share of provider calls, not the others': their payment
/// step (recorded -> provider answered) p50 stays within twice its value
/// without the burst. Their end-to-end p50 is reported, not asserted: the
/// consumer queues before the payment are FIFO across tenants, so the
/// burst's events delay theirs there (issue 14's closing note).
pub async fn burst(run: &mut Run, tenant: i64) -> Outcome {
    let (other, loud) = (tenant + 500, tenant + 1000);
    for t in [tenant, other, loud] {
        run.client.stock(t, &sku(t), 10_000).await?;
    }
    provider_latency(run, 300).await?;
    let calm = tokio::try_join!(
        paced(run, tenant, "calm", 2, 8),
        paced(run, other, "calm", 2, 8)
    );
    quiesce(run, tenant).await?;
    quiesce(run, other).await?;
    let started = Instant::now();
    let busy = tokio::try_join!(
        paced(run, tenant, "busy", 2, 8),
        paced(run, other, "busy", 2, 8),
        paced(run, loud, "loud", 20, 8)
    );
    quiesce(run, tenant).await?;
    quiesce(run, other).await?;
    quiesce(run, loud).await?;
    let burst_secs = started.elapsed().as_secs_f64();
    provider_latency(run, 0).await?;
    let (calm_a, calm_b) = calm?;
    let (busy_a, busy_b, loud_ids) = busy?;
    let mut before = decision_times(run, tenant, &calm_a).await?;
    before.extend(decision_times(run, other, &calm_b).await?);
    before.sort_by(f64::total_cmp);
    let mut during = decision_times(run, tenant, &busy_a).await?;
    during.extend(decision_times(run, other, &busy_b).await?);
    during.sort_by(f64::total_cmp);
    let loud_times = decision_times(run, loud, &loud_ids).await?;
    let mut paying = payment_times(run, tenant, &busy_a).await?;
    paying.extend(payment_times(run, other, &busy_b).await?);
    paying.sort_by(f64::total_cmp);
    let mut paying_alone = payment_times(run, tenant, &calm_a).await?;
    paying_alone.extend(payment_times(run, other, &calm_b).await?);
    paying_alone.sort_by(f64::total_cmp);
    let (before, during) = (p50(&before), p50(&during));
    let mut violations = check_also(run, &[other, loud]).await?;
    if p50(&paying) > 2.0 * p50(&paying_alone) {
        violations.push(format!(
            "fairness: the others' payment step p50 went from {:.0} ms to {:.0} ms during the burst",
            p50(&paying_alone) * 1000.0,
            p50(&paying) * 1000.0
        ));
    }
    Ok((
        format!(
            "provider 300 ms, 6 calls in flight, 3 per tenant; tenants {tenant},{other} at 2/s, tenant {loud} bursts 20/s ({} orders, p50 {:.0} ms, all decided in {burst_secs:.0} s): others' payment step p50 {:.0} ms alone, {:.0} ms beside the burst; end to end {:.0} ms alone, {:.0} ms beside it",
            loud_ids.len(),
            p50(&loud_times) * 1000.0,
            p50(&paying_alone) * 1000.0,
            p50(&paying) * 1000.0,
            before * 1000.0,
            during * 1000.0
        ),
        violations,
    ))
}
