//! The graph against the other views: the checker's look at FalkorDB.

use std::collections::{BTreeMap, BTreeSet};

use super::Dbs;

impl Dbs {
    /// The graph agrees with the projection's view of every order (status,
    /// total, refunds) and with the orders service's lines (a CONTAINS
    /// edge per sku, with the quantity its lines add up to); it has no
    /// order the orders service does not (ADR 0030).
    pub(super) async fn graph_agrees(
        &self,
        graph: &graph::store::Store,
        tenant: i64,
        orders: &[(i64, String)],
    ) -> anyhow::Result<Vec<String>> {
        const ORDERS: graph::store::Cypher = graph::store::Cypher(
            "MATCH (o:Order {tenant: $tenant})
             RETURN o.id AS id, coalesce(o.status, 'placed') AS status, o.total_cents AS total,
                    reduce(s = 0, x IN [(o)-[:PAID_BY]->(pp:Payment {tenant: $tenant})-[:REFUNDED]->(rf:Refund {tenant: $tenant}) | rf.amount_cents] | s + x) AS refunded,
                    [(o)-[r:CONTAINS]->(p:Product {tenant: $tenant}) | p.sku + ' x' + toString(r.quantity)] AS lines",
        );
        type Order = (String, Option<i64>, i64, BTreeSet<String>);
        let rows = graph
            .run(
                reliability::TenantId::new(tenant)?,
                ORDERS,
                graph::store::Params::new(),
            )
            .await?;
        let mut nodes: BTreeMap<i64, Order> = BTreeMap::new();
        for row in rows {
            let status = row["status"].as_str().unwrap_or_default();
            nodes.insert(
                row["id"].as_i64().unwrap_or(-1),
                (
                    if status == "placed" {
                        "pending"
                    } else {
                        status
                    }
                    .to_owned(),
                    row["total"].as_i64(),
                    row["refunded"].as_i64().unwrap_or(-1),
                    serde_json::from_value(row["lines"].clone()).unwrap_or_default(),
                ),
            );
        }
        let mut want: BTreeMap<i64, Order> = BTreeMap::new();
        for (id, status, total, refunded) in sqlx::query_as::<_, (i64, String, Option<i64>, i64)>(
            "SELECT order_id, status, total_cents, refunded_cents FROM order_views WHERE tenant_id = $1",
        )
        .bind(tenant)
        .fetch_all(&self.projection)
        .await?
        {
            want.insert(id, (status, total, refunded, BTreeSet::new()));
        }
        for (id, sku, quantity) in sqlx::query_as::<_, (i64, String, i64)>(
            "SELECT order_id, sku, sum(quantity)::bigint FROM order_lines WHERE tenant_id = $1
             GROUP BY 1, 2",
        )
        .bind(tenant)
        .fetch_all(&self.orders)
        .await?
        {
            if let Some(order) = want.get_mut(&id) {
                order.3.insert(format!("{sku} x{quantity}"));
            }
        }
        let mut violations = Vec::new();
        for (id, _) in orders {
            match (nodes.remove(id), want.get(id)) {
                (None, _) => violations.push(format!("graph: no node for order {id}")),
                (Some(node), Some(view)) if node != *view => violations.push(format!(
                    "graph: order {id} is {node:?} (status, total, refunded, lines); the projection and orders say {view:?}"
                )),
                _ => {}
            }
        }
        for id in nodes.keys() {
            violations.push(format!(
                "graph: order {id}, which the orders service does not have"
            ));
        }
        Ok(violations)
    }
}
