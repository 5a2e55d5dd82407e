//! The events the commerce services exchange: their names, routing keys and
//! payloads. A service depends on this crate, never on another service.
//!
//! Each payload is version 1. A breaking change adds a new struct and a new
//! version number; consumers dead-letter versions they do not know, so a
//! rolling deploy surfaces in the DLQ instead of misreading data.
//!
//! Amounts are integer cents; ids are the owning service's numbers.

use serde::{Deserialize, Serialize};

/// The topic exchange every event is published to.
pub const EXCHANGE: &str = "commerce.events";

/// Publishing services: the first part of every routing key.
pub mod source {
    pub const ORDERS: &str = "orders";
    pub const INVENTORY: &str = "inventory";
    pub const PAYMENTS: &str = "payments";
}

/// Event type names: the second part of the routing key and the AMQP `type`.
pub mod event {
    pub const ORDER_PLACED: &str = "OrderPlaced";
    pub const ORDER_CONFIRMED: &str = "OrderConfirmed";
    pub const ORDER_CANCELLED: &str = "OrderCancelled";
    pub const INVENTORY_RESERVED: &str = "InventoryReserved";
    pub const INVENTORY_REJECTED: &str = "InventoryRejected";
    pub const STOCK_ADJUSTED: &str = "StockAdjusted";
    pub const PAYMENT_CAPTURED: &str = "PaymentCaptured";
    pub const PAYMENT_FAILED: &str = "PaymentFailed";
    pub const REFUND_ISSUED: &str = "RefundIssued";
}

/// Who takes which events: each consumer's queue and the routing keys bound
/// to it, declared once for both sides. Consumers bind their queue from it;
/// every relay and `reliability setup` declare every queue in it before
/// anything is published, so an event waits in each subscriber's queue even
/// when that subscriber has never run (docs/adr/0012).
pub mod topology {
    /// One consumer's queue (its name) and its bindings (`<source>.<EventType>`
    /// or `<source>.*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Subscription {
        pub consumer: &'static str,
        pub bindings: &'static [&'static str],
        /// 0: order-free, one queue that any number of appliers share (the
        /// commerce services' handlers are written so). K > 0: ordered:
        /// each aggregate's events reach the handler in outbox order,
        /// through K partition queues with one active consumer each
        /// (docs/adr/0028).
        pub partitions: u16,
    }

    impl Subscription {
        /// An order-free subscription.
        pub const fn new(consumer: &'static str, bindings: &'static [&'static str]) -> Self {
            Self {
                consumer,
                bindings,
                partitions: 0,
            }
        }

        /// The same subscription, ordered per aggregate over `partitions`
        /// partition queues.
        pub const fn ordered(mut self, partitions: u16) -> Self {
            self.partitions = partitions;
            self
        }

        pub const fn is_ordered(&self) -> bool {
            self.partitions > 0
        }
    }

    /// inventory reserves on placement and settles on the decision.
    pub const INVENTORY_STOCK: Subscription = Subscription {
        consumer: "inventory.stock",
        bindings: &[
            "orders.OrderPlaced",
            "orders.OrderConfirmed",
            "orders.OrderCancelled",
        ],
        partitions: 0,
    };
    /// payments records a payment once stock is reserved.
    pub const PAYMENTS_CHARGES: Subscription = Subscription {
        consumer: "payments.charges",
        bindings: &["inventory.InventoryReserved"],
        partitions: 0,
    };
    /// orders decides on the reservation's or the payment's outcome.
    pub const ORDERS_SAGA: Subscription = Subscription {
        consumer: "orders.saga",
        bindings: &[
            "inventory.InventoryRejected",
            "payments.PaymentCaptured",
            "payments.PaymentFailed",
        ],
        partitions: 0,
    };
    /// The projection takes every event (and ignores what is not an order's),
    /// so every event has at least one subscriber.
    pub const PROJECTION_VIEWS: Subscription = Subscription {
        consumer: "projection.views",
        bindings: &["orders.*", "inventory.*", "payments.*"],
        partitions: 0,
    };

    /// The projection's history: each order's and each product's events
    /// in the order they happened, so ordered per aggregate (docs/adr/0028).
    pub const PROJECTION_HISTORY: Subscription = Subscription::new(
        "projection.history",
        &["orders.*", "inventory.StockAdjusted"],
    )
    .ordered(4);

    /// The graph takes every event into its property graph (customers,
    /// orders, products, payments); order-free, like the views.
    pub const GRAPH_EDGES: Subscription =
        Subscription::new("graph.edges", &["orders.*", "inventory.*", "payments.*"]);

    /// Every subscription of the commerce services.
    pub const ALL: &[Subscription] = &[
        INVENTORY_STOCK,
        PAYMENTS_CHARGES,
        ORDERS_SAGA,
        PROJECTION_VIEWS,
        PROJECTION_HISTORY,
        GRAPH_EDGES,
    ];

    /// Whether a topic exchange routes `routing_key` through `binding`
    /// (`*`: exactly one word, `#`: zero or more).
    pub fn topic_matches(binding: &str, routing_key: &str) -> bool {
        fn go(pattern: &[&str], key: &[&str]) -> bool {
            match (pattern.first(), key.first()) {
                (None, None) => true,
                (Some(&"#"), _) => {
                    go(&pattern[1..], key) || (!key.is_empty() && go(pattern, &key[1..]))
                }
                (Some(&"*"), Some(_)) => go(&pattern[1..], &key[1..]),
                (Some(p), Some(k)) => p == k && go(&pattern[1..], &key[1..]),
                _ => false,
            }
        }
        let pattern: Vec<&str> = binding.split('.').collect();
        let key: Vec<&str> = routing_key.split('.').collect();
        go(&pattern, &key)
    }
}

/// Aggregate types, as written in the outbox.
/// The payment provider's idempotency keys: one per payment and one per
/// refund, the same on every try and for good (docs/adr/0011). Payments
/// sends them; reconciliation, the operator's `explain` and the e2e
/// checker read the provider's books by them.
pub mod provider {
    pub fn charge_key(tenant: i64, payment_id: i64) -> String {
        format!("pay-{tenant}-{payment_id}")
    }

    pub fn refund_key(tenant: i64, refund_id: i64) -> String {
        format!("refund-{tenant}-{refund_id}")
    }
}

pub mod aggregate {
    pub const ORDER: &str = "order";
    pub const PRODUCT: &str = "product";
    pub const PAYMENT: &str = "payment";
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Line {
    pub sku: String,
    pub quantity: i64,
    pub unit_price_cents: i64,
}

/// orders → inventory, projection. Everything later steps need to act.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OrderPlaced {
    pub order_id: i64,
    pub customer_id: String,
    pub currency: String,
    pub total_cents: i64,
    #[schema(inline)]
    pub lines: Vec<Line>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OrderConfirmed {
    pub order_id: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OrderCancelled {
    pub order_id: i64,
    pub reason: String,
}

/// inventory → payments, orders, projection. Carries the payment details of
/// the order so that payments needs no other event to charge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InventoryReserved {
    pub order_id: i64,
    pub customer_id: String,
    pub currency: String,
    pub total_cents: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InventoryRejected {
    pub order_id: i64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StockAdjusted {
    pub sku: String,
    pub delta: i64,
    pub on_hand: i64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PaymentCaptured {
    pub order_id: i64,
    pub payment_id: i64,
    pub amount_cents: i64,
    pub currency: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PaymentFailed {
    pub order_id: i64,
    pub payment_id: i64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RefundIssued {
    pub order_id: i64,
    pub payment_id: i64,
    pub refund_id: i64,
    pub amount_cents: i64,
}

/// What an event payload knows about itself: its type (the routing key's
/// second part and the AMQP `type`), its version and the service that
/// publishes it. Consumers decode by type ([`decode`], [`AnyEvent::decode`]),
/// so a message of another type or version is refused in one place.
pub trait Event: Serialize + for<'de> Deserialize<'de> {
    const TYPE: &'static str;
    const VERSION: i32;
    const SOURCE: &'static str;
}

/// Why a message is not the event a consumer can read. Every case is
/// permanent: the same bytes fail the same way on every try.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// No contract names this type. Consumers learn a new type before its
    /// publisher sends it (deploy them first); until then it is refused.
    #[error("unknown event type {0}")]
    UnknownType(String),
    #[error("expected {expected}, got {got}")]
    WrongType { expected: &'static str, got: String },
    #[error("unknown version {version} of {event_type} (this build reads {reads})")]
    UnknownVersion {
        event_type: String,
        version: i32,
        reads: i32,
    },
    #[error("bad {event_type} payload: {source}")]
    Payload {
        event_type: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// `payload` as a `T`, if the message is a `T` of the version this build
/// reads.
pub fn decode<T: Event>(
    event_type: &str,
    version: i32,
    payload: &serde_json::Value,
) -> Result<T, DecodeError> {
    if event_type != T::TYPE {
        return Err(DecodeError::WrongType {
            expected: T::TYPE,
            got: event_type.to_owned(),
        });
    }
    if version != T::VERSION {
        return Err(DecodeError::UnknownVersion {
            event_type: event_type.to_owned(),
            version,
            reads: T::VERSION,
        });
    }
    T::deserialize(payload).map_err(|source| DecodeError::Payload {
        event_type: T::TYPE,
        source,
    })
}

/// One event type as [`catalogue`] lists it.
pub struct Catalogued {
    pub name: &'static str,
    pub version: i32,
    pub source: &'static str,
    pub schema: utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
}

macro_rules! events {
    ($($payload:ident: $name:path, version $version:literal, from $source:expr;)*) => {
        $(impl Event for $payload {
            const TYPE: &'static str = $name;
            const VERSION: i32 = $version;
            const SOURCE: &'static str = $source;
        })*

        /// Every event: its type, version, publisher and payload's JSON Schema
        /// (what `asyncapi` documents).
        pub fn catalogue() -> Vec<Catalogued> {
            vec![$(Catalogued {
                name: $name,
                version: $version,
                source: $source,
                schema: <$payload as utoipa::PartialSchema>::schema(),
            },)*]
        }

        /// Any event of the catalogue, decoded: what a consumer's handler
        /// matches on.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum AnyEvent {
            $($payload($payload),)*
        }

        impl AnyEvent {
            /// The message as the event its type names, checked as [`decode`]
            /// checks it.
            pub fn decode(
                event_type: &str,
                version: i32,
                payload: &serde_json::Value,
            ) -> Result<Self, DecodeError> {
                $(if event_type == $name {
                    return decode::<$payload>(event_type, version, payload).map(Self::$payload);
                })*
                Err(DecodeError::UnknownType(event_type.to_owned()))
            }
        }
    };
}

events! {
    OrderPlaced: event::ORDER_PLACED, version 1, from source::ORDERS;
    OrderConfirmed: event::ORDER_CONFIRMED, version 1, from source::ORDERS;
    OrderCancelled: event::ORDER_CANCELLED, version 1, from source::ORDERS;
    InventoryReserved: event::INVENTORY_RESERVED, version 1, from source::INVENTORY;
    InventoryRejected: event::INVENTORY_REJECTED, version 1, from source::INVENTORY;
    StockAdjusted: event::STOCK_ADJUSTED, version 1, from source::INVENTORY;
    PaymentCaptured: event::PAYMENT_CAPTURED, version 1, from source::PAYMENTS;
    PaymentFailed: event::PAYMENT_FAILED, version 1, from source::PAYMENTS;
    RefundIssued: event::REFUND_ISSUED, version 1, from source::PAYMENTS;
}

/// An order's id as the events carry it and every service's routes take
/// it: opaque to clients, a number here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct OrderId(i64);

impl OrderId {
    pub fn new(id: i64) -> Self {
        Self(id)
    }

    pub fn get(self) -> i64 {
        self.0
    }

    /// A path segment as an id; None for anything else, which every
    /// service answers as not found.
    pub fn parse(s: &str) -> Option<Self> {
        s.parse().ok().map(Self)
    }
}

/// A stock-keeping unit as every service accepts it: 1 to 64 visible ASCII
/// characters. Orders checks it on each line, inventory on each adjustment.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Sku(String);

impl Sku {
    /// What a valid sku is, as a client is told.
    pub const RULE: &str = "sku must be 1 to 64 visible ASCII characters";

    /// `s` if it is a valid sku.
    pub fn parse(s: String) -> Option<Self> {
        ((1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic())).then_some(Self(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests;
