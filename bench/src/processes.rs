//! The stack as separate processes: the order rate through the saga and
//! each role's peak RSS.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::{Sizes, Table, pct};

/// The stack as separate processes, as `make up` and `make e2e` run it
/// (binaries of the bench's own profile): the order rate through the whole
/// saga, and the peak RSS of each service role under that load.
pub(crate) async fn processes(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    use e2e::cluster::{self, CONSUMERS, Client, Layout};
    let layout = Layout {
        name: "bench",
        port_base: 9180,
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    };
    let (mut procs, dbs) = cluster::launch(&layout, &[("RUST_LOG", "warn")]).await?;
    let client = Client::new(&layout)?;
    // The same load against a provider answering at once, in 100 ms and in
    // 300 ms (real providers: 200-800 ms); 4 fresh tenants each time.
    for (round, latency_ms) in [0_u64, 100, 300].into_iter().enumerate() {
        client
            .http
            .post(format!("{}/control/faults", layout.url("psp-sim")))
            .json(&json!({ "latency_ms": latency_ms }))
            .send()
            .await?
            .error_for_status()?;
        let first = 1 + 4 * round as i64;
        let tenants = first..=first + 3;
        for tenant in tenants.clone() {
            client
                .stock(tenant, &format!("SKU-{tenant}"), 1_000_000)
                .await?;
        }
        let t0 = Instant::now();
        let placed = futures_util::future::join_all(
            tenants
                .clone()
                .map(|tenant| client.orders(tenant, s.procs_orders)),
        )
        .await;
        let mut orders = 0;
        for p in placed {
            orders += p?.len();
        }
        let posted = t0.elapsed().as_secs_f64();
        let deadline = t0 + Duration::from_secs(600);
        for tenant in tenants {
            while !dbs.quiet(tenant).await? {
                anyhow::ensure!(Instant::now() < deadline, "tenant {tenant} never settled");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let decided = t0.elapsed().as_secs_f64();
        let (decided_rate, accepted_rate) = (orders as f64 / decided, orders as f64 / posted);
        println!(
            "   provider {latency_ms} ms: {decided_rate:.0} decided/s, {accepted_rate:.0} accepted/s"
        );
        t.row([
            &format!(
                "orders through the saga, as processes, provider {latency_ms} ms: {orders} orders, 4 tenants x 16 clients"
            ),
            &format!("{decided_rate:.0} orders/s decided"),
            &format!("{accepted_rate:.0} orders/s accepted"),
            &pct(decided_rate / accepted_rate),
            match latency_ms {
                0 => "decided >= 90% of accepted",
                100 => "decided >= 200/s",
                _ => "",
            },
        ]);
    }
    let rss = procs.peak_rss_kib();
    procs.stop_all();
    let mib = |name: &str| rss.get(name).map(|kib| kib / 1024);
    for svc in ["orders", "inventory", "payments", "projection"] {
        let roles: Vec<String> = ["api", "consumer", "relay"]
            .iter()
            .filter_map(|role| Some(format!("{role} {}", mib(&format!("{svc}-{role}"))?)))
            .collect();
        t.row([
            &format!("peak RSS under that load, {svc}"),
            &format!("{} MiB", roles.join(" / ")),
            "",
            "",
            "one process per role",
        ]);
    }
    t.row([
        "peak RSS under that load, provider simulator",
        &format!("{} MiB", mib("psp-sim").unwrap_or_default()),
        "",
        "",
        "",
    ]);
    // Leave nothing behind: the databases and the run's queues and exchange.
    for pool in [&dbs.orders, &dbs.inventory, &dbs.payments, &dbs.projection] {
        pool.close().await;
    }
    cluster::drop_databases(&layout).await?;
    let queues: Vec<String> = CONSUMERS
        .iter()
        .map(|c| format!("{}{c}", layout.queue_prefix()))
        .collect();
    reliability::testing::delete_broker_objects(&queues, &format!("{}.events", layout.name)).await;
    Ok(())
}
