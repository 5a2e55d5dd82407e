//! Fault scenarios: several relays, a late commit, an unroutable event,
//! provider faults, reordered delivery, poison and its re-drive, a stock
//! race. Whole servers going away are in `servers.rs`.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions};
use reliability::broker::{self};
use reliability::{TenantId, TenantTx, db};
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use testkit::{amqp_url, database_url, wait_until};

mod poison;

use crate::run::{Outcome, PREFIX, Run, Scenario, quiesce};
use poison::poison;

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
    let charged = crate::run::ledger(run)
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
