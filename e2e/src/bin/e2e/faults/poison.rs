//! Poison on a subscriber queue: a malformed message, an unknown version
//! and a handler that fails for good, each dead-lettered (the ordered
//! history parks instead) while the rest flows; the DLQ gauges see them;
//! a re-drive after the fix applies them once.

use std::time::Duration;

use reliability::broker::{self, Outgoing, Publisher};
use serde_json::json;
use testkit::{amqp_url, wait_until};

use super::sku;
use crate::run::{Outcome, PREFIX, Run, bin, quiesce, run_cmd};

/// A malformed message and an unknown version are dead-lettered at once; a
/// handler failing on everything dead-letters after bounded tries while the
/// rest of the system keeps flowing; once fixed, the operator's re-drive
/// applies each event once, and only the poison stays in the DLQ.
pub async fn poison(run: &mut Run, tenant: i64) -> Outcome {
    const PROJECTION: &str = "projection.views";
    const HISTORY: &str = "projection.history";
    run.client.stock(tenant, &sku(tenant), 100).await?;
    let envelope = json!({
        "id": 900_000_000_i64 + tenant, "source": "orders", "tenant_id": tenant,
        "aggregate_type": "order", "aggregate_id": "0", "event_type": "OrderPlaced",
        "event_version": 99, "occurred_at": "2026-01-01T00:00:00Z", "payload": {}
    });
    let poison = [
        (format!("orders:poison-{tenant}"), b"{not json".to_vec()),
        (
            format!("orders:{}", 900_000_000_i64 + tenant),
            serde_json::to_vec(&envelope)?,
        ),
    ];
    publish(
        &poison
            .iter()
            .map(|(id, body)| Outgoing {
                routing_key: "orders.OrderPlaced".into(),
                message_id: id.clone(),
                kind: "OrderPlaced".into(),
                headers: Default::default(),
                body: body.clone(),
            })
            .collect::<Vec<_>>(),
    )
    .await?;
    // Every consumer bound to orders.OrderPlaced dead-letters both at once,
    // the graph's too (ADR 0030).
    for c in ["inventory.stock", PROJECTION, "graph.edges"] {
        *run.poison
            .entry(broker::dead_letter_queue(&format!("{PREFIX}{c}")))
            .or_default() += 2;
    }
    // The ordered history dead-letters what has no aggregate to park (the
    // malformed one) and parks the v99 event's aggregate; the operator
    // drops that event for good.
    *run.poison
        .entry(broker::dead_letter_queue(&format!("{PREFIX}{HISTORY}")))
        .or_default() += 1;
    let dbs = &run.dbs;
    wait_until(
        Duration::from_secs(60),
        "the v99 event parked in the history",
        || async {
            reliability::consumer::parked(&dbs.projection, Some(HISTORY))
                .await
                .is_ok_and(|p| p.iter().any(|a| a.tenant_id == tenant))
        },
    )
    .await;
    let shown =
        reliability::consumer::first_parked(&run.dbs.projection, HISTORY, tenant, "order", "0")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no parked v99 event to skip"))?;
    let skipped = reliability::consumer::skip(
        &run.dbs.projection,
        HISTORY,
        tenant,
        "order",
        "0",
        shown.message_id,
    )
    .await?;
    anyhow::ensure!(skipped.is_some(), "no parked v99 event to skip");
    let projection_dlq = broker::dead_letter_queue(&format!("{PREFIX}{PROJECTION}"));
    wait_for_depth(&projection_dlq, 2).await;

    // A projection whose handler fails on everything.
    run.cluster.kill9("projection-consumer");
    // Narrowed to the views: the history in the same process is not the
    // one with the bug.
    let failing = format!("consumer.handler@{PROJECTION}=error*");
    run.cluster.start("projection-consumer", Some(&failing))?;
    run.client.orders(tenant, 2).await?;
    quiesce(run, tenant).await?;
    let events = tenant_events(run, tenant).await?;
    // The stock adjustment may have been applied before the failures began.
    let before = u32::try_from(applied(&run.dbs, tenant, PROJECTION).await?)?;
    wait_for_depth(&projection_dlq, 2 + events - before).await;

    // Fixed and restarted; the operator re-drives with the real CLI.
    run.cluster.kill9("projection-consumer");
    run.cluster.start("projection-consumer", None)?;
    let out = run_cmd(
        bin("reliability").to_str().unwrap_or("reliability"),
        &[
            "queue",
            "dlq",
            "redrive",
            "--yes",
            &format!("{PREFIX}{PROJECTION}"),
        ],
    )
    .await?;
    anyhow::ensure!(
        out.status.success(),
        "reliability queue dlq redrive: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dbs = &run.dbs;
    wait_until(
        Duration::from_secs(60),
        "every re-driven event applied",
        || async {
            applied(dbs, tenant, PROJECTION)
                .await
                .is_ok_and(|n| n >= i64::from(events))
        },
    )
    .await;
    wait_for_depth(&projection_dlq, 2).await;
    let mut violations = vec![];
    let n = applied(&run.dbs, tenant, PROJECTION).await?;
    if n != i64::from(events) {
        violations.push(format!(
            "I2: {events} events re-driven, {n} dedup records in the projection"
        ));
    }
    let conn = broker::connect(&amqp_url(), "e2e-peek").await?;
    let left =
        operator::dlq::peek_dead_letters(&conn, &format!("{PREFIX}{PROJECTION}"), 10).await?;
    broker::bounded(conn.close(200, "peeked".into())).await?;
    let mut left: Vec<String> = left.into_iter().filter_map(|d| d.message_id).collect();
    left.sort();
    let mut injected: Vec<String> = poison.iter().map(|(id, _)| id.clone()).collect();
    injected.sort();
    if left != injected {
        violations.push(format!(
            "DLQ: {projection_dlq} holds {left:?}; only the poison {injected:?} should stay"
        ));
    }
    violations.extend(dlq_metrics(run).await?);
    Ok((
        format!(
            "malformed + v99 published (the ordered history parks v99's aggregate; skipped); projection handler failing (consumer.handler@projection.views=error*): {} events dead-lettered, then `reliability queue dlq redrive`",
            events - before
        ),
        violations,
    ))
}

/// What every role's `/metrics` says the DLQs hold, against what they hold:
/// each consumer process's `consumer_dlq_depth` (the broker's DLQ depth) and
/// each relay process's `outbox_dlq_depth` (the outbox DLQ table's rows).
/// Gauges refresh every few seconds, so each is given ten to agree.
async fn dlq_metrics(run: &Run) -> anyhow::Result<Vec<String>> {
    let conn = broker::connect(&amqp_url(), "e2e-metrics").await?;
    let channel = broker::bounded(conn.create_channel()).await?;
    let mut expected = Vec::new();
    for (svc, consumer) in [
        ("inventory", "inventory.stock"),
        ("payments", "payments.charges"),
        ("orders", "orders.saga"),
        ("projection", "projection.views"),
    ] {
        let dlq = broker::dead_letter_queue(&format!("{PREFIX}{consumer}"));
        let depth = broker::bounded(broker::queue_depth(&channel, &dlq)).await?;
        let series = format!("consumer_dlq_depth{{consumer=\"{consumer}\"}}");
        expected.push((format!("{svc}-consumer"), series, f64::from(depth)));
    }
    let _ = broker::bounded(conn.close(200, "depths read".into())).await;
    for (svc, pool) in [
        ("orders", &run.dbs.orders),
        ("inventory", &run.dbs.inventory),
        ("payments", &run.dbs.payments),
    ] {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages_dlq")
            .fetch_one(pool)
            .await?;
        let series = format!("outbox_dlq_depth{{source=\"{svc}\"}}");
        expected.push((format!("{svc}-relay"), series, rows as f64));
    }
    let mut violations = Vec::new();
    for (process, series, want) in expected {
        let Some(port) = run.cluster.metrics_port(&process) else {
            violations.push(format!("metrics: {process} serves no /metrics"));
            continue;
        };
        let url = format!("http://127.0.0.1:{port}/metrics");
        let mut seen = None;
        for _ in 0..50 {
            seen = scrape(&run.client.http, &url, &series).await;
            if seen == Some(want) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if seen != Some(want) {
            violations.push(format!(
                "metrics: {process} :{port} exports {series} = {seen:?}, the DLQ holds {want}"
            ));
        }
    }
    Ok(violations)
}

/// The value of one series (`name{labels}`) in a Prometheus text page.
async fn scrape(http: &reqwest::Client, url: &str, series: &str) -> Option<f64> {
    let page = http.get(url).send().await.ok()?.text().await.ok()?;
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

async fn publish(messages: &[Outgoing]) -> anyhow::Result<()> {
    let conn = broker::connect(&amqp_url(), "e2e-poison").await?;
    let publisher = Publisher::new(&conn, "e2e.events", Duration::from_secs(10)).await?;
    for r in publisher.publish_batch(messages).await {
        r?;
    }
    broker::bounded(conn.close(200, "published".into())).await?;
    Ok(())
}

async fn wait_for_depth(queue: &str, n: u32) {
    wait_until(
        Duration::from_secs(90),
        &format!("{queue} holding {n} messages"),
        || async {
            let Ok(conn) = broker::connect(&amqp_url(), "e2e-depth").await else {
                return false;
            };
            // Every call bounded: over a reset lapin can leave one pending
            // forever, and this wait's deadline is only checked between tries.
            let depth = broker::inspect_queue(&conn, queue)
                .await
                .map_or(0, |(ready, _)| ready);
            let _ = broker::bounded(conn.close(200, "depth".into())).await;
            depth == n
        },
    )
    .await;
}

/// The tenant's events in every outbox (all of them reach the projection).
async fn tenant_events(run: &Run, tenant: i64) -> anyhow::Result<u32> {
    let mut n = 0;
    for pool in [&run.dbs.orders, &run.dbs.inventory, &run.dbs.payments] {
        let k: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE tenant_id = $1")
                .bind(tenant)
                .fetch_one(pool)
                .await?;
        n += u32::try_from(k)?;
    }
    Ok(n)
}

async fn applied(dbs: &e2e::check::Dbs, tenant: i64, consumer: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM processed_messages WHERE tenant_id = $1 AND consumer = $2",
    )
    .bind(tenant)
    .bind(consumer)
    .fetch_one(&dbs.projection)
    .await?)
}
