//! This platform's answers to the views' questions: where an order has
//! rows, what the provider holds of it, and which work admission counts.
//! The CLI and the console read the same ones.

use super::explain::{ProviderItems, Related};
use super::status::WorkInFlight;

/// Work accepted and not yet decided, which admission bounds (docs/adr/0027).
pub const WORK_IN_FLIGHT: &[WorkInFlight] = &[WorkInFlight {
    service: "orders",
    table: "orders",
    in_flight: "status = 'pending'",
    since: "created_at",
    key: "order_id",
}];

/// Where an order has rows: (service, table), each keyed by `order_id`.
pub const ORDER_TABLES: &[(&str, &str)] = &[
    ("orders", "orders"),
    ("inventory", "reservations"),
    ("payments", "payments"),
    ("projection", "order_views"),
];

/// Where an order has rows through another table: its refunds, through
/// its payment.
pub const ORDER_RELATED: &[Related<'static>] = &[Related {
    service: "payments",
    table: "refunds",
    sql: "SELECT to_jsonb(r) FROM refunds r JOIN payments p
          ON p.tenant_id = r.tenant_id AND p.payment_id = r.payment_id
          WHERE p.tenant_id = $1 AND p.order_id = $2 ORDER BY r.refund_id",
}];

/// An order's requests to the payment provider: each payment by its charge
/// key, each refund by its own (docs/adr/0011).
pub const ORDER_PROVIDER_ITEMS: &[ProviderItems<'static>] = &[
    ProviderItems {
        service: "payments",
        sql: "SELECT payment_id, status FROM payments WHERE tenant_id = $1 AND order_id = $2",
        path: "charges",
        key: contracts::provider::charge_key,
    },
    ProviderItems {
        service: "payments",
        sql: "SELECT r.refund_id, r.status FROM refunds r JOIN payments p
              ON p.tenant_id = r.tenant_id AND p.payment_id = r.payment_id
              WHERE p.tenant_id = $1 AND p.order_id = $2",
        path: "refunds",
        key: contracts::provider::refund_key,
    },
];

/// The events that decide an order, in the service that publishes them:
/// what the console counts as decided per second.
pub const DECIDED: (&str, &[&str]) = ("orders", &["OrderConfirmed", "OrderCancelled"]);
