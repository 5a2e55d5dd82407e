//! The facts an order's current rows state, as the view reads them
//! (docs/adr/0035, amended): what lets an order whose events are gone
//! (past the archive's retention) keep, or get back, its view.
//!
//! A fact stands for the event that said the same, with the fields the
//! view reads. Each is a statement that stays true once the rows make it:
//! the order was placed for its total, it ended confirmed or cancelled,
//! stock was held or refused, a payment ended captured or failed, a
//! refund succeeded. So facts read at any moment never take a view back,
//! and a fact counts once beside its event: the view takes the set of
//! event types, and the refunds by their id (`views::recompute`).

use contracts::event;
use reliability::TenantTx;
use serde_json::{Value, json};
use sources::Order;

/// One fact: the event type it stands for, what makes it one of its kind
/// (0, or the payment's or the refund's id), and its fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Fact {
    pub event_type: &'static str,
    pub reference: i64,
    pub payload: Value,
}

/// What `order`'s rows state.
pub fn of(order: &Order) -> Vec<Fact> {
    let id = order.key.order_id;
    let fact = |event_type, reference, payload| Fact {
        event_type,
        reference,
        payload,
    };
    let mut facts = vec![fact(
        event::ORDER_PLACED,
        0,
        json!({"order_id": id, "total_cents": order.total_cents, "currency": order.currency}),
    )];
    match order.status.as_str() {
        "confirmed" => facts.push(fact(event::ORDER_CONFIRMED, 0, json!({"order_id": id}))),
        "cancelled" => facts.push(fact(event::ORDER_CANCELLED, 0, json!({"order_id": id}))),
        _ => {}
    }
    match &order.reservation {
        Some(r) if r.held() => {
            facts.push(fact(event::INVENTORY_RESERVED, 0, json!({"order_id": id})))
        }
        Some(r) if r.status == "rejected" => {
            facts.push(fact(event::INVENTORY_REJECTED, 0, json!({"order_id": id})))
        }
        _ => {}
    }
    for p in &order.payments {
        let ended = match p.status.as_str() {
            "captured" => event::PAYMENT_CAPTURED,
            "failed" => event::PAYMENT_FAILED,
            _ => continue,
        };
        facts.push(fact(
            ended,
            p.payment_id,
            json!({"order_id": id, "payment_id": p.payment_id}),
        ));
        for r in &p.refunds {
            facts.push(fact(
                event::REFUND_ISSUED,
                r.refund_id,
                json!({"order_id": id, "payment_id": p.payment_id, "refund_id": r.refund_id,
                       "amount_cents": r.amount_cents}),
            ));
        }
    }
    facts
}

/// The order's facts become what its rows state now, inside the caller's
/// transaction (which holds the order's lock). The rows are the truth: a
/// fact they no longer state (written by hand, say) goes.
pub(crate) async fn replace(tx: &mut TenantTx, order: &Order) -> Result<(), sqlx::Error> {
    // The tenant named: a re-projection runs as the owner, whom row-level
    // security does not filter.
    sqlx::query("DELETE FROM order_view_facts WHERE tenant_id = $1 AND order_id = $2")
        .bind(order.key.tenant_id)
        .bind(order.key.order_id)
        .execute(&mut **tx)
        .await?;
    let (mut types, mut refs, mut payloads) = (Vec::new(), Vec::new(), Vec::new());
    for fact in of(order) {
        types.push(fact.event_type);
        refs.push(fact.reference);
        payloads.push(fact.payload);
    }
    sqlx::query(
        "INSERT INTO order_view_facts (tenant_id, order_id, event_type, ref, payload)
         SELECT $1, $2, t, r, p FROM unnest($3::text[], $4::bigint[], $5::jsonb[]) AS f(t, r, p)",
    )
    .bind(order.key.tenant_id)
    .bind(order.key.order_id)
    .bind(&types)
    .bind(&refs)
    .bind(&payloads)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
