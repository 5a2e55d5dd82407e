//! The inventory side of the saga: on `OrderPlaced` reserve every line or
//! none (invariant I5: available never below zero, also under concurrent
//! orders for the last units); on `OrderConfirmed` commit the reservation;
//! on `OrderCancelled` release it.

use std::collections::BTreeMap;

use contracts::{AnyEvent, OrderCancelled, OrderConfirmed, aggregate};
use reliability::TenantTx;
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::{self, Envelope, NewEvent};

pub const CONSUMER: &str = contracts::topology::INVENTORY_STOCK.consumer;

pub struct Stock;

impl Handler for Stock {
    /// Stock rows are shared by every order: lock all that this run of
    /// events will change, in sku order, before any of them is handled, so
    /// two appliers' groups cannot deadlock on them. (Each order's own rows
    /// are serialized by the runtime's lock on the order.)
    async fn prepare(&self, tx: &mut TenantTx, events: &[&Envelope]) -> Result<(), HandlerError> {
        let mut skus: Vec<String> = Vec::new();
        let mut settled: Vec<i64> = Vec::new();
        for e in events {
            // What does not decode is refused when it is handled.
            match e.event() {
                Ok(AnyEvent::OrderPlaced(o)) => skus.extend(o.lines.into_iter().map(|l| l.sku)),
                Ok(
                    AnyEvent::OrderConfirmed(OrderConfirmed { order_id })
                    | AnyEvent::OrderCancelled(OrderCancelled { order_id, .. }),
                ) => settled.push(order_id),
                _ => {}
            }
        }
        if skus.is_empty() && settled.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "SELECT 1 FROM products
             WHERE sku = ANY($1::text[] || ARRAY(SELECT sku FROM reservation_lines WHERE order_id = ANY($2)))
             ORDER BY sku FOR UPDATE",
        )
        .bind(&skus)
        .bind(&settled)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        match e.event()? {
            AnyEvent::OrderPlaced(order) => reserve(tx, order).await,
            AnyEvent::OrderConfirmed(c) => settle(tx, c.order_id, Settle::Commit).await,
            AnyEvent::OrderCancelled(c) => settle(tx, c.order_id, Settle::Release).await,
            _ => Ok(()),
        }
    }
}

async fn reserve(tx: &mut TenantTx, order: contracts::OrderPlaced) -> Result<(), HandlerError> {
    let tenant = tx.tenant().get();
    // One line per sku, in sku order: every reservation locks rows in the
    // same order, so concurrent orders cannot deadlock.
    let mut wanted: BTreeMap<&str, i64> = BTreeMap::new();
    for line in &order.lines {
        *wanted.entry(line.sku.as_str()).or_default() += line.quantity;
    }
    let skus: Vec<&str> = wanted.keys().copied().collect();
    let quantities: Vec<i64> = wanted.values().copied().collect();

    // A tombstone (an earlier cancel) or an earlier decision: nothing to do.
    let fresh = sqlx::query(
        "INSERT INTO reservations (tenant_id, order_id, status) VALUES ($1, $2, 'reserved') ON CONFLICT DO NOTHING",
    )
    .bind(tenant)
    .bind(order.order_id)
    .execute(&mut **tx)
    .await?
    .rows_affected()
        == 1;
    if !fresh {
        return Ok(());
    }
    let stock: Vec<(String, i64)> = sqlx::query_as(
        "SELECT sku, on_hand - reserved FROM products WHERE sku = ANY($1) ORDER BY sku FOR UPDATE",
    )
    .bind(&skus)
    .fetch_all(&mut **tx)
    .await?;
    let available: BTreeMap<&str, i64> = stock.iter().map(|(s, a)| (s.as_str(), *a)).collect();
    let shortfall = wanted
        .iter()
        .find_map(|(sku, qty)| match available.get(sku) {
            None => Some(format!("unknown_sku: {sku}")),
            Some(a) if a < qty => Some(format!("insufficient_stock: {sku}")),
            Some(_) => None,
        });
    let order_id = order.order_id;
    if let Some(reason) = shortfall {
        sqlx::query("UPDATE reservations SET status = 'rejected', reason = $2, updated_at = now() WHERE order_id = $1")
            .bind(order_id)
            .bind(&reason)
            .execute(&mut **tx)
            .await?;
        let rejected = contracts::InventoryRejected { order_id, reason };
        outbox::enqueue(tx, &NewEvent::of(aggregate::ORDER, order_id, &rejected)?).await?;
        tracing::info!(order_id, reason = %rejected.reason, "reservation rejected");
        return Ok(());
    }
    sqlx::query(
        "UPDATE products p SET reserved = p.reserved + w.quantity, updated_at = now()
         FROM unnest($1::text[], $2::bigint[]) AS w(sku, quantity) WHERE p.sku = w.sku",
    )
    .bind(&skus)
    .bind(&quantities)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO reservation_lines (tenant_id, order_id, sku, quantity)
         SELECT $1, $2, w.sku, w.quantity FROM unnest($3::text[], $4::bigint[]) AS w(sku, quantity)",
    )
    .bind(tenant)
    .bind(order_id)
    .bind(&skus)
    .bind(&quantities)
    .execute(&mut **tx)
    .await?;
    let reserved = contracts::InventoryReserved {
        order_id,
        customer_id: order.customer_id,
        currency: order.currency,
        total_cents: order.total_cents,
    };
    outbox::enqueue(tx, &NewEvent::of(aggregate::ORDER, order_id, &reserved)?).await?;
    tracing::info!(order_id, "stock reserved");
    Ok(())
}

#[derive(Clone, Copy)]
enum Settle {
    Commit,
    Release,
}

/// Turns a live reservation into a sale or gives it back. A cancel that
/// finds no reservation leaves a `released` tombstone, so an `OrderPlaced`
/// delivered after it reserves nothing.
async fn settle(tx: &mut TenantTx, order_id: i64, how: Settle) -> Result<(), HandlerError> {
    let status = match how {
        Settle::Commit => "committed",
        Settle::Release => "released",
    };
    let moved = sqlx::query(
        "UPDATE reservations SET status = $2, updated_at = now() WHERE order_id = $1 AND status = 'reserved'",
    )
    .bind(order_id)
    .bind(status)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if moved == 0 {
        if let Settle::Release = how {
            sqlx::query(
                "INSERT INTO reservations (tenant_id, order_id, status, reason) VALUES ($1, $2, 'released', 'cancelled before reservation')
                 ON CONFLICT DO NOTHING",
            )
            .bind(tx.tenant().get())
            .bind(order_id)
            .execute(&mut **tx)
            .await?;
        }
        return Ok(());
    }
    let sql = match how {
        Settle::Commit => {
            "UPDATE products p SET on_hand = p.on_hand - l.quantity, reserved = p.reserved - l.quantity, updated_at = now()
             FROM reservation_lines l WHERE l.order_id = $1 AND l.sku = p.sku"
        }
        Settle::Release => {
            "UPDATE products p SET reserved = p.reserved - l.quantity, updated_at = now()
             FROM reservation_lines l WHERE l.order_id = $1 AND l.sku = p.sku"
        }
    };
    sqlx::query(sql).bind(order_id).execute(&mut **tx).await?;
    tracing::info!(order_id, status, "reservation settled");
    Ok(())
}
