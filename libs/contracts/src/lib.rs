#![doc = include_str!("../README.md")]

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

pub mod topology;

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

/// Aggregate types, as written in the outbox.
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

pub mod roster;

#[cfg(test)]
mod tests;
