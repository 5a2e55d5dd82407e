//! Each product's stock as inventory's rows hold it, with the adjustments
//! past a re-projection's floor that the row reflects.

use reliability::Result;

use crate::Sources;
use crate::snapshot::{Reflected, begin, events};

/// A product of a tenant, as of one snapshot.
#[derive(Debug, Clone)]
pub struct Stock {
    pub tenant_id: i64,
    pub sku: String,
    pub on_hand: i64,
    /// Its `StockAdjusted` events past the floor.
    pub reflected: Reflected,
}

/// The next `limit` products after `(tenant, sku)`, in key order.
pub async fn stock_after(
    sources: &Sources,
    after: (i64, &str),
    limit: i64,
    floor: i64,
) -> Result<Vec<Stock>> {
    let mut tx = begin(&sources.inventory).await?;
    let rows: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT tenant_id, sku, on_hand FROM products WHERE (tenant_id, sku) > ($1, $2)
         ORDER BY tenant_id, sku LIMIT $3",
    )
    .bind(after.0)
    .bind(after.1)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let keys: Vec<(i64, String)> = rows.iter().map(|r| (r.0, r.1.clone())).collect();
    let adjusted = events(&mut tx, contracts::aggregate::PRODUCT, &keys, floor).await?;
    tx.commit().await?;
    Ok(rows
        .into_iter()
        .map(|(tenant_id, sku, on_hand)| {
            let (ids, oldest) = adjusted.of(tenant_id, &sku);
            Stock {
                reflected: Reflected {
                    source: contracts::source::INVENTORY,
                    aggregate: format!("{}:{sku}", contracts::aggregate::PRODUCT),
                    ids,
                    upto: floor,
                    oldest,
                },
                tenant_id,
                sku,
                on_hand,
            }
        })
        .collect())
}
