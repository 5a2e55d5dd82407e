//! Fault scenarios: several relays, a late commit, an unroutable event,
//! provider faults, reordered delivery, poison and its re-drive, a stock
//! race. Whole servers going away are in `servers.rs`.

use std::collections::HashMap;
use std::process::{Command, Output};
use std::str::FromStr;
use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions};
use reliability::broker::{self, Outgoing, Publisher};
use reliability::testing::{amqp_url, database_url, wait_until};
use reliability::{TenantId, TenantTx, db};
use serde_json::json;
use sqlx::postgres::PgConnectOptions;

use crate::{Outcome, PREFIX, Run, Scenario, bin, quiesce};

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![
        (
            "three orders relays and two inventory relays at once",
            |r, t| Box::pin(many_relays(r, t)),
        ),
        (
            "an earlier outbox id commits after later ones are consumed",
            |r, t| Box::pin(late_commit(r, t)),
        ),
        (
            "unroutable event: backoff, then the outbox DLQ table",
            |r, t| Box::pin(unroutable(r, t)),
        ),
        ("provider charges, then times out or fails", |r, t| {
            Box::pin(provider_charges_then_fails(r, t))
        }),
        (
            "reordered delivery: projection gets each order backwards",
            |r, t| Box::pin(reordered(r, t)),
        ),
        (
            "poison: malformed, unknown version, failing handler",
            |r, t| Box::pin(poison(r, t)),
        ),
        ("20 orders race for 10 units", |r, t| Box::pin(race(r, t))),
    ]
}

fn sku(tenant: i64) -> String {
    format!("SKU-{tenant}")
}

/// Runs a command off the async threads (the traffic keeps flowing).
pub(crate) async fn run_cmd(program: &str, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    Ok(out)
}

pub async fn many_relays(run: &mut Run, tenant: i64) -> Outcome {
    const EXTRA: [&str; 3] = ["orders-relay-2", "orders-relay-3", "inventory-relay-2"];
    run.client.stock(tenant, &sku(tenant), 1000).await?;
    for p in EXTRA {
        run.cluster.start(p, None)?;
    }
    let placed = run.client.orders(tenant, 200).await;
    quiesce(run, tenant).await?;
    for p in EXTRA {
        run.cluster.kill9(p);
    }
    placed?;
    Ok((
        "orders relays x3, inventory relays x2 on one outbox each; 200 orders".into(),
        vec![],
    ))
}

/// A transaction takes an outbox id, stays open while later orders are
/// placed, relayed and consumed, then commits: its event must still go out.
pub async fn late_commit(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 100).await?;
    let base = PgConnectOptions::from_str(&database_url())?.database("e2e_orders");
    let app = db::pool(db::options_for_role(&base, db::APP_ROLE), 1).await?;
    let mut tx = TenantTx::begin(&app, TenantId::new(tenant)?).await?;
    let order = orders::domain::new_order(
        "c-late".into(),
        "EUR".into(),
        vec![orders::domain::line(sku(tenant), 1, 1250)?],
    )?;
    let early = orders::http::place(&mut tx, &order).await?;
    let early_id: i64 = sqlx::query_scalar("SELECT max(id) FROM outbox_messages")
        .fetch_one(&mut *tx)
        .await?;
    run.client.orders(tenant, 10).await?;
    let dbs = &run.dbs;
    wait_until(
        Duration::from_secs(60),
        "the later orders decided",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM orders WHERE tenant_id = $1 AND status <> 'pending'",
            )
            .bind(tenant)
            .fetch_one(&dbs.orders)
            .await
            .is_ok_and(|n| n >= 10)
        },
    )
    .await;
    let later: Option<i64> = sqlx::query_scalar(
        "SELECT max(id) FROM outbox_messages WHERE tenant_id = $1 AND processed_at IS NOT NULL",
    )
    .bind(tenant)
    .fetch_one(&run.dbs.orders)
    .await?;
    tx.commit().await?;
    app.close().await;
    let mut violations = vec![];
    if later.is_none_or(|l| l <= early_id) {
        violations.push(format!(
            "scenario: no event after id {early_id} was relayed before the commit"
        ));
    }
    Ok((
        format!(
            "order {} (outbox id {early_id}) committed after ids up to {} were consumed",
            early.order_id,
            later.unwrap_or(0)
        ),
        violations,
    ))
}

/// An event nobody subscribes to is returned by the broker (mandatory
/// publish), retried with backoff, then parked in the outbox DLQ table;
/// everything else keeps flowing. The projection takes `orders.*`, so the
/// event type has a dot (a typo'd type): `orders.Nobody.Listens` matches no
/// binding.
pub async fn unroutable(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 100).await?;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ($1, 'order', '0', 'Nobody.Listens', '{}') RETURNING id",
    )
    .bind(tenant)
    .fetch_one(&run.dbs.orders)
    .await?;
    run.outbox_poison += 1;
    run.client.orders(tenant, 10).await?;
    let dbs = &run.dbs;
    wait_until(
        Duration::from_secs(60),
        "the unroutable event in the outbox DLQ table",
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_messages_dlq WHERE id = $1")
                .bind(id)
                .fetch_one(&dbs.orders)
                .await
                .is_ok_and(|n| n == 1)
        },
    )
    .await;
    let attempts: i32 =
        sqlx::query_scalar("SELECT attempts FROM outbox_messages_dlq WHERE id = $1")
            .bind(id)
            .fetch_one(&run.dbs.orders)
            .await?;
    let mut violations = vec![];
    if attempts < 10 {
        violations.push(format!(
            "relay: event {id} dead-lettered after {attempts} attempts, not 10"
        ));
    }
    Ok((
        format!("orders event {id} routed nowhere; DLQ table after {attempts} attempts"),
        violations,
    ))
}

/// The provider charges and then fails (500) or hangs past the worker's
/// timeout: the worker cannot know, retries with the same key, and the
/// provider must have charged once.
pub async fn provider_charges_then_fails(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 100).await?;
    let faults = json!({"charge_then_fail_next": 3, "charge_then_hang_next": 3, "hang_ms": 2500});
    run.client
        .http
        .post("http://127.0.0.1:9099/control/faults")
        .json(&faults)
        .send()
        .await?
        .error_for_status()?;
    let placed = run.client.orders(tenant, 10).await;
    quiesce(run, tenant).await?;
    run.client
        .http
        .post("http://127.0.0.1:9099/control/faults")
        .json(&json!({}))
        .send()
        .await?
        .error_for_status()?;
    placed?;
    Ok((
        "provider: 3 charges answered 500, 3 hung past the 1 s timeout".into(),
        vec![],
    ))
}

/// The projection consumer is down while orders complete, then every event
/// waiting in its queue is put back in reverse: it sees each order's
/// confirmation before its placement.
pub async fn reordered(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 100).await?;
    run.cluster.kill9("projection-consumer");
    let placed = run.client.orders(tenant, 10).await;
    quiesce(run, tenant).await?;
    let moved = reverse_queue(&format!("{PREFIX}projection.views")).await;
    run.cluster.start("projection-consumer", None)?;
    placed?;
    let moved = moved?;
    Ok((
        format!("projection down; its {moved} waiting events re-queued in reverse order"),
        vec![],
    ))
}

async fn reverse_queue(queue: &str) -> anyhow::Result<usize> {
    let conn = broker::connect(&amqp_url(), "e2e-reorder").await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions { nowait: false })
        .await?;
    let mut taken = Vec::new();
    while let Some(msg) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?
    {
        taken.push(msg.delivery);
    }
    for d in taken.iter().rev() {
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &d.data,
                d.properties.clone(),
            )
            .await?
            .await?;
    }
    if let Some(last) = taken.last() {
        channel
            .basic_ack(last.delivery_tag, BasicAckOptions { multiple: true })
            .await?;
    }
    broker::bounded(conn.close(200, "reordered".into())).await?;
    Ok(taken.len())
}

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
    let left = broker::peek_dead_letters(&conn, &format!("{PREFIX}{PROJECTION}"), 10).await?;
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

async fn applied(dbs: &crate::Dbs, tenant: i64, consumer: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM processed_messages WHERE tenant_id = $1 AND consumer = $2",
    )
    .bind(tenant)
    .bind(consumer)
    .fetch_one(&dbs.projection)
    .await?)
}

/// 20 orders of one unit each, all at once, for 10 units in stock.
/// Orders confirmed, the SKU's on-hand and reserved units, and charges made,
/// for the race below.
async fn race_books(run: &Run, tenant: i64, sku: &str) -> anyhow::Result<(i64, i64, i64, usize)> {
    let statuses: HashMap<String, i64> = sqlx::query_as::<_, (String, i64)>(
        "SELECT status, count(*) FROM orders WHERE tenant_id = $1 GROUP BY status",
    )
    .bind(tenant)
    .fetch_all(&run.dbs.orders)
    .await?
    .into_iter()
    .collect();
    let (on_hand, reserved): (i64, i64) =
        sqlx::query_as("SELECT on_hand, reserved FROM products WHERE tenant_id = $1 AND sku = $2")
            .bind(tenant)
            .bind(sku)
            .fetch_one(&run.dbs.inventory)
            .await?;
    let prefix = format!("pay-{tenant}-");
    let charged = crate::ledger(run)
        .await?
        .values()
        .filter(|m| m.key.starts_with(&prefix) && m.charged_cents > 0)
        .count();
    let confirmed = statuses.get("confirmed").copied().unwrap_or(0);
    Ok((confirmed, on_hand, reserved, charged))
}

pub async fn race(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 10).await?;
    let sku = sku(tenant);
    let placed = futures_util::future::join_all((0..20).map(|i| {
        let (key, customer, sku) = (format!("race-{tenant}-{i}"), format!("c-{i}"), sku.clone());
        let client = &run.client;
        async move { client.order(tenant, &key, &customer, &sku, 1).await }
    }))
    .await;
    placed.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    quiesce(run, tenant).await?;
    // Quiet means decided, not yet applied everywhere: the last
    // OrderConfirmed may still be on its way to inventory. Read until the
    // books agree, or report what they say at the deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut violations = vec![];
    loop {
        let (confirmed, on_hand, reserved, charged) = race_books(run, tenant, &sku).await?;
        if confirmed == 10 && on_hand == 0 && reserved == 0 && charged == 10 {
            break;
        }
        if std::time::Instant::now() >= deadline {
            violations.push(format!(
                "I5: 20 orders for 10 units: {confirmed} confirmed, on_hand {on_hand}, reserved {reserved}, {charged} charges"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(("20 concurrent orders, 10 units in stock".into(), violations))
}
