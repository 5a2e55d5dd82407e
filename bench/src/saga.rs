//! Placed to confirmed through the in-process stack, light and heavy.

use std::time::{Duration, Instant};

use crate::{Latencies, Sizes, Table, ms};

/// Places one order; the time until orders and the projection show it confirmed.
async fn follow(stack: &e2e::Stack) -> anyhow::Result<(Duration, Duration)> {
    let t0 = Instant::now();
    let id = stack.order(1, "c-bench", "SKU-B", 1).await;
    let path = format!("/orders/{id}");
    let deadline = t0 + Duration::from_secs(60);
    let mut seen = [None, None];
    while seen.iter().any(Option::is_none) {
        anyhow::ensure!(Instant::now() < deadline, "order {id} never confirmed");
        if seen[0].is_none() && stack.orders.get(1, &path).await.1["status"] == "confirmed" {
            seen[0] = Some(t0.elapsed());
        }
        if seen[1].is_none() && stack.projection.get(1, &path).await.1["status"] == "confirmed" {
            seen[1] = Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok((seen[0].unwrap_or_default(), seen[1].unwrap_or_default()))
}

pub(crate) async fn end_to_end(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let stack = e2e::Stack::start().await?;
    stack.stock(1, "SKU-B", 1_000_000).await;
    let mut light = (Vec::new(), Vec::new());
    for _ in 0..s.e2e_light {
        let (o, p) = follow(&stack).await?;
        light.0.push(o);
        light.1.push(p);
    }
    let heavy_clients = 16;
    let runs = futures_util::future::join_all((0..heavy_clients).map(|_| async {
        let mut out = Vec::new();
        for _ in 0..s.e2e_heavy {
            out.push(follow(&stack).await?);
        }
        anyhow::Ok(out)
    }))
    .await;
    let mut heavy = (Vec::new(), Vec::new());
    for r in runs {
        for (o, p) in r? {
            heavy.0.push(o);
            heavy.1.push(p);
        }
    }
    let mut light_orders = Latencies(light.0);
    let p50 = ms(light_orders.quantile(0.5));
    t.row([
        "placed -> confirmed in orders, light (1 at a time)",
        &light_orders.summary(),
        "",
        "",
        &format!(
            "p50 < 30 ms ({})",
            if p50 < 30.0 { "met" } else { "missed" }
        ),
    ]);
    t.row([
        "placed -> confirmed in projection, light",
        &Latencies(light.1).summary(),
        "",
        "",
        "",
    ]);
    t.row([
        &format!("placed -> confirmed in orders, {heavy_clients} clients"),
        &Latencies(heavy.0).summary(),
        "",
        "",
        "",
    ]);
    t.row([
        &format!("placed -> confirmed in projection, {heavy_clients} clients"),
        &Latencies(heavy.1).summary(),
        "",
        "",
        "",
    ]);
    stack.stop().await;
    Ok(())
}
