//! Placed to confirmed through the in-process stack, light and heavy,
//! timed by the databases' own record of the confirmation.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::{Latencies, Sizes, Table, ms};

/// How often the watcher looks for confirmations. It looks with one query
/// per database for every order the clients wait on, so its load does not
/// grow with the clients. Until session 23 each client polled its own order
/// over HTTP (two GETs per poll every 50 ms): at 16 clients that was most
/// of the CPU the machine spent, and the latency it measured was the
/// measurement's own queueing (docs/benchmarks.md).
const WATCH: Duration = Duration::from_millis(5);

/// An order a client waits on: when it was sent (epoch seconds), and where
/// to say when orders and the projection recorded it confirmed.
type Waiting =
    std::collections::HashMap<i64, (f64, tokio::sync::oneshot::Sender<(Duration, Duration)>)>;

/// Watches both databases for the orders in `waiting` until `stop`.
async fn watch(
    stack: &e2e::Stack,
    waiting: &std::sync::Mutex<Waiting>,
    stop: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let confirmed = |sql: &'static str, pool: sqlx::PgPool, ids: Vec<i64>| async move {
        let rows: Vec<(i64, f64)> = sqlx::query_as(sql).bind(ids).fetch_all(&pool).await?;
        anyhow::Ok(
            rows.into_iter()
                .collect::<std::collections::HashMap<_, _>>(),
        )
    };
    while !stop.is_cancelled() {
        tokio::time::sleep(WATCH).await;
        let ids: Vec<i64> = waiting
            .lock()
            .expect("watch lock")
            .keys()
            .copied()
            .collect();
        if ids.is_empty() {
            continue;
        }
        let orders = confirmed(
            "SELECT order_id, extract(epoch FROM updated_at)::float8 FROM orders
             WHERE order_id = ANY($1) AND status = 'confirmed'",
            stack.dbs.orders.owner.clone(),
            ids,
        )
        .await?;
        if orders.is_empty() {
            continue;
        }
        // The view's last update: at or after it showed `confirmed`.
        let views = confirmed(
            "SELECT order_id, extract(epoch FROM updated_at)::float8 FROM order_views
             WHERE order_id = ANY($1) AND status = 'confirmed'",
            stack.dbs.projection.owner.clone(),
            orders.keys().copied().collect(),
        )
        .await?;
        let mut waiting = waiting.lock().expect("watch lock");
        for (id, view_at) in views {
            if let Some((sent, tell)) = waiting.remove(&id) {
                let since = |at: f64| Duration::from_secs_f64((at - sent).max(0.0));
                let _ = tell.send((since(orders[&id]), since(view_at)));
            }
        }
    }
    Ok(())
}

/// Places one order; the time from sending it until orders and the
/// projection recorded it confirmed. Each end is the time the confirming
/// transaction began (`updated_at = now()`) on the machine's own clock, the
/// one the client read before sending, so neither the watcher's interval
/// nor its queries count.
async fn follow(
    stack: &e2e::Stack,
    waiting: &std::sync::Mutex<Waiting>,
) -> anyhow::Result<(Duration, Duration)> {
    let sent = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
    let id = stack.order(1, "c-bench", "SKU-B", 1).await;
    let (tell, told) = tokio::sync::oneshot::channel();
    waiting.lock().expect("watch lock").insert(id, (sent, tell));
    match tokio::time::timeout(Duration::from_secs(60), told).await {
        Ok(Ok(times)) => Ok(times),
        _ => anyhow::bail!("order {id} never confirmed in orders and the projection"),
    }
}

pub(crate) async fn end_to_end(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let stack = e2e::Stack::start().await?;
    stack.stock(1, "SKU-B", 1_000_000).await;
    let waiting = std::sync::Mutex::new(Waiting::new());
    let stop = tokio_util::sync::CancellationToken::new();
    let heavy_clients = 16;
    let clients = async {
        let mut light = (Vec::new(), Vec::new());
        for _ in 0..s.e2e_light {
            let (o, p) = follow(&stack, &waiting).await?;
            light.0.push(o);
            light.1.push(p);
        }
        let t0 = Instant::now();
        let heavy_from = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
        let runs = futures_util::future::join_all((0..heavy_clients).map(|_| async {
            let mut out = Vec::new();
            for _ in 0..s.e2e_heavy {
                out.push(follow(&stack, &waiting).await?);
            }
            anyhow::Ok(out)
        }))
        .await;
        stop.cancel();
        anyhow::Ok((light, t0, heavy_from, runs))
    };
    let ((light, t0, heavy_from, runs), ()) =
        tokio::try_join!(clients, watch(&stack, &waiting, &stop))?;
    // Closed-loop clients (Little's law): the rate is the clients over a
    // client's cycle (its order placed, then seen confirmed in orders and
    // in the projection).
    let heavy_secs = t0.elapsed().as_secs_f64();
    let hops = hops(&stack, heavy_from).await?;
    println!("   placed -> confirmed at {heavy_clients} clients, p50 by hop: {hops}");
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
    let rate = heavy.0.len() as f64 / heavy_secs;
    let mut heavy_orders = Latencies(heavy.0);
    let (p50, p99) = (
        ms(heavy_orders.quantile(0.5)),
        ms(heavy_orders.quantile(0.99)),
    );
    t.row([
        &format!("placed -> confirmed in orders, {heavy_clients} clients"),
        &heavy_orders.summary(),
        &format!(
            "{rate:.0} decided/s, a client's cycle {:.0} ms",
            f64::from(heavy_clients) * 1000.0 / rate
        ),
        "",
        &format!(
            "p50 < 100, p99 < 300 ms ({})",
            if p50 < 100.0 && p99 < 300.0 {
                "met"
            } else {
                "missed"
            }
        ),
    ]);
    t.row([
        &format!("placed -> confirmed in orders, {heavy_clients} clients, p50 by hop"),
        &hops,
        "",
        "",
        "where the time goes",
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

/// Where an order's time goes, from each service's own timestamps: the p50
/// over the orders placed since `since` (epoch seconds) of each hop.
async fn hops(stack: &e2e::Stack, since: f64) -> anyhow::Result<String> {
    use std::collections::HashMap;
    type Times = HashMap<i64, Vec<f64>>;
    async fn times(pool: &sqlx::PgPool, sql: &str, since: f64) -> anyhow::Result<Times> {
        let rows: Vec<(i64, Vec<f64>)> = sqlx::query_as(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(since)
            .fetch_all(pool)
            .await?;
        Ok(rows.into_iter().collect())
    }
    let orders = times(
        &stack.dbs.orders.owner,
        "SELECT order_id, ARRAY[extract(epoch FROM created_at), extract(epoch FROM updated_at)]::float8[]
         FROM orders WHERE status = 'confirmed' AND created_at >= to_timestamp($1)",
        since,
    )
    .await?;
    let reserved = times(
        &stack.dbs.inventory.owner,
        "SELECT order_id, ARRAY[extract(epoch FROM created_at)]::float8[]
         FROM reservations WHERE created_at >= to_timestamp($1)",
        since,
    )
    .await?;
    let paid = times(
        &stack.dbs.payments.owner,
        "SELECT order_id, ARRAY[extract(epoch FROM created_at), extract(epoch FROM coalesce(sent_at, created_at)),
                                extract(epoch FROM updated_at)]::float8[]
         FROM payments WHERE status = 'captured' AND created_at >= to_timestamp($1)",
        since,
    )
    .await?;
    let names = [
        "placed -> reserved",
        "reserved -> payment recorded",
        "recorded -> sent to the provider",
        "sent -> captured",
        "captured -> confirmed",
    ];
    let mut hops: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    for (id, o) in &orders {
        let (Some(r), Some(p)) = (reserved.get(id), paid.get(id)) else {
            continue;
        };
        let points = [o[0], r[0], p[0], p[1], p[2], o[1]];
        for (i, pair) in points.windows(2).enumerate() {
            hops[i].push(Duration::from_secs_f64((pair[1] - pair[0]).max(0.0)));
        }
    }
    Ok(names
        .iter()
        .zip(hops)
        .map(|(name, h)| format!("{name} {:.0}", ms(Latencies(h).quantile(0.5))))
        .collect::<Vec<_>>()
        .join(", ")
        + " ms")
}
