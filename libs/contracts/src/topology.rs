//! Who takes which events: each consumer's queue and the routing keys bound
//! to it, declared once for both sides. Consumers bind their queue from it;
//! every relay and `reliability setup` declare every queue in it before
//! anything is published, so an event waits in each subscriber's queue even
//! when that subscriber has never run (docs/adr/0012).

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
