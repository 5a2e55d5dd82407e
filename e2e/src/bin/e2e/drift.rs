//! Drift injected into the derived views, as an operator's `UPDATE` or a
//! graph statement run by hand would make it: the real `projection
//! verify` and `graph verify` name each difference and exit 1; with
//! `--repair` they mend it, and a second pass finds nothing (ADR 0035).

use std::process::Output;

use graph::store::{Cypher, Params};
use reliability::TenantId;
use serde_json::{Value, json};

use crate::run::{Outcome, Run, Scenario, bin, settle};

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![(
        "drift injected into the projection and the graph: verify names it, --repair mends it",
        |r, t| Box::pin(drifted(r, t)),
    )]
}

/// An edge deleted, a status flipped, a line changed.
const GRAPH_DRIFT: [Cypher; 3] = [
    Cypher(
        "MATCH (o:Order {tenant: $tenant, id: $id})-[r:CONTAINS]->(p:Product {tenant: $tenant}) DELETE r",
    ),
    Cypher(
        "MATCH (o:Order {tenant: $tenant, id: $id}) SET o.status = 'confirmed', o.total_cents = 1",
    ),
    Cypher(
        "MATCH (o:Order {tenant: $tenant, id: $id})-[r:CONTAINS]->(p:Product {tenant: $tenant}) SET r.quantity = 99",
    ),
];

async fn drifted(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    run.client.orders(tenant, 12).await?;
    // The views caught up first, not only the sources quiet: a view
    // changed by hand before its last event is applied is mended by that
    // event, and is no drift (a CI run drifted an order still pending in
    // its view, which OrderConfirmed then set right).
    let settled = settle(run, tenant).await?;
    anyhow::ensure!(
        settled.violations.is_empty(),
        "the views never caught up before the drift: {:?}",
        settled.violations
    );
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT order_id FROM orders WHERE tenant_id = $1 ORDER BY order_id LIMIT 3",
    )
    .bind(tenant)
    .fetch_all(&run.dbs.orders)
    .await?;
    anyhow::ensure!(ids.len() == 3, "three orders to drift, found {}", ids.len());
    let graph = run
        .dbs
        .graph
        .clone()
        .ok_or_else(|| anyhow::anyhow!("this stack runs no graph service"))?;

    // The projection: a status flipped, a total changed. One order in ten
    // is declined, so the flip goes to a status the order does not have.
    sqlx::query(
        "UPDATE order_views
         SET status = CASE status WHEN 'cancelled' THEN 'confirmed' ELSE 'cancelled' END
         WHERE tenant_id = $1 AND order_id = $2",
    )
    .bind(tenant)
    .bind(ids[0])
    .execute(&run.dbs.projection)
    .await?;
    sqlx::query("UPDATE order_views SET total_cents = total_cents + 1 WHERE tenant_id = $1 AND order_id = $2")
        .bind(tenant)
        .bind(ids[1])
        .execute(&run.dbs.projection)
        .await?;
    // The graph: an edge deleted, a status flipped, a line changed.
    for (cypher, id) in GRAPH_DRIFT.into_iter().zip(&ids) {
        let mut params = Params::new();
        params.insert("id".into(), json!(id));
        graph.run(TenantId::new(tenant)?, cypher, params).await?;
    }

    let mut violations = Vec::new();
    let expect = [("projection", vec![ids[0], ids[1]]), ("graph", ids.clone())];
    for (view, drifted) in &expect {
        let found = verify(run, view, tenant, false).await?;
        if found.0.status.code() != Some(1) {
            violations.push(format!(
                "{view} verify exited {:?} with drift, not 1",
                found.0.status.code()
            ));
        }
        let named = orders_named(&found.1, tenant, false);
        for id in drifted {
            if !named.contains(id) {
                violations.push(format!(
                    "{view} verify did not name drifted order {id}: {named:?}"
                ));
            }
        }
        let repaired = verify(run, view, tenant, true).await?;
        let mended = orders_named(&repaired.1, tenant, true);
        for id in drifted {
            if !mended.contains(id) {
                violations.push(format!(
                    "{view} verify --repair did not mend order {id}: {}",
                    String::from_utf8_lossy(&repaired.0.stdout)
                ));
            }
        }
        let after = verify(run, view, tenant, false).await?;
        let left = orders_named(&after.1, tenant, false);
        if !left.is_empty() {
            violations.push(format!("{view} verify after --repair still names {left:?}"));
        }
    }
    Ok((
        "a status, a total, an edge and a line changed by hand in the projection and the graph; the CLIs run as an operator would".into(),
        violations,
    ))
}

/// `<view> verify --json` (and `--repair`) as a process, with the stack's
/// databases and graph; its output and its lines as JSON.
async fn verify(
    run: &Run,
    view: &str,
    tenant: i64,
    repair: bool,
) -> anyhow::Result<(Output, Vec<Value>)> {
    let env = |name: &str| {
        run.cluster
            .env()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let sources = format!(
        "orders={},inventory={},payments={}",
        env("ORDERS_DATABASE_URL"),
        env("INVENTORY_DATABASE_URL"),
        env("PAYMENTS_DATABASE_URL")
    );
    let mut cmd = std::process::Command::new(bin(view));
    cmd.arg("verify").arg("--json");
    if repair {
        cmd.arg("--repair");
    }
    if view == "graph" {
        cmd.args(["--tenant", &tenant.to_string()]);
    }
    cmd.env("VERIFY_SOURCES", sources)
        .env("VERIFY_GRACE_SECS", "0")
        .env("PROJECTION_DATABASE_URL", env("PROJECTION_DATABASE_URL"))
        .env("GRAPH_URL", env("GRAPH_URL"))
        .env("GRAPH_NAME", env("GRAPH_NAME"));
    // Off the async threads: the stack's traffic keeps flowing.
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    Ok((out, lines))
}

/// The orders of `tenant` a pass named (repaired ones, with `repaired`).
fn orders_named(lines: &[Value], tenant: i64, repaired: bool) -> Vec<i64> {
    lines
        .iter()
        .filter(|d| d["view"] == "orders" && d["tenant_id"] == tenant)
        .filter(|d| !repaired || d["repaired"] == true)
        .filter_map(|d| d["entity"].as_str()?.parse().ok())
        .collect()
}
