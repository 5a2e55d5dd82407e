//! What the graph counts per tenant: each customer's orders and each
//! product's units ordered. One read per tenant, its cost that tenant's
//! rows (a tenant's orders are contiguous in the primary key).

use std::collections::BTreeMap;

use reliability::Result;

use crate::Sources;

/// A count, and whether every row behind it has been still for the grace
/// period (else its events may not have arrived yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub count: i64,
    pub settled: bool,
}

/// Every tenant that has an order, in order.
pub async fn tenants(sources: &Sources) -> Result<Vec<i64>> {
    Ok(
        sqlx::query_scalar("SELECT DISTINCT tenant_id FROM orders ORDER BY 1")
            .fetch_all(&sources.orders)
            .await?,
    )
}

/// Each customer of `tenant`'s orders.
pub async fn customers(
    sources: &Sources,
    tenant: i64,
    grace_secs: f64,
) -> Result<BTreeMap<String, Tally>> {
    let rows: Vec<(String, i64, bool)> = sqlx::query_as(
        "SELECT customer_id, count(*), bool_and(created_at < now() - make_interval(secs => $2))
         FROM orders WHERE tenant_id = $1 GROUP BY customer_id",
    )
    .bind(tenant)
    .bind(grace_secs)
    .fetch_all(&sources.orders)
    .await?;
    Ok(tally(rows))
}

/// The units of each product that `tenant`'s orders ordered.
pub async fn units_ordered(
    sources: &Sources,
    tenant: i64,
    grace_secs: f64,
) -> Result<BTreeMap<String, Tally>> {
    let rows: Vec<(String, i64, bool)> = sqlx::query_as(
        "SELECT l.sku, sum(l.quantity)::bigint,
                bool_and(o.created_at < now() - make_interval(secs => $2))
         FROM order_lines l JOIN orders o USING (tenant_id, order_id)
         WHERE l.tenant_id = $1 GROUP BY l.sku",
    )
    .bind(tenant)
    .bind(grace_secs)
    .fetch_all(&sources.orders)
    .await?;
    Ok(tally(rows))
}

fn tally(rows: Vec<(String, i64, bool)>) -> BTreeMap<String, Tally> {
    rows.into_iter()
        .map(|(name, count, settled)| (name, Tally { count, settled }))
        .collect()
}
