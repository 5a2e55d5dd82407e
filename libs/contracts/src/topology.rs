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
    /// An ordered subscription bound to every event its sources number in
    /// each of its aggregates: a number skipped is an event still on its
    /// way (a delivery the broker holds back, a relay's retry), never one
    /// the bindings leave out. Its gate waits for it, within a bound,
    /// before it applies a later one (docs/adr/0040).
    pub whole: bool,
}

impl Subscription {
    /// An order-free subscription.
    pub const fn new(consumer: &'static str, bindings: &'static [&'static str]) -> Self {
        Self {
            consumer,
            bindings,
            partitions: 0,
            whole: false,
        }
    }

    /// The same subscription, ordered per aggregate over `partitions`
    /// partition queues.
    pub const fn ordered(mut self, partitions: u16) -> Self {
        self.partitions = partitions;
        self
    }

    /// The same subscription, bound to every event of its aggregates
    /// that their sources number (see [`Subscription::whole`]).
    pub const fn whole(mut self) -> Self {
        self.whole = true;
        self
    }

    pub const fn is_ordered(&self) -> bool {
        self.partitions > 0
    }
}

/// inventory reserves on placement and settles on the decision.
pub const INVENTORY_STOCK: Subscription = Subscription::new(
    "inventory.stock",
    &[
        "orders.OrderPlaced",
        "orders.OrderConfirmed",
        "orders.OrderCancelled",
    ],
);
/// payments records a payment once stock is reserved.
pub const PAYMENTS_CHARGES: Subscription =
    Subscription::new("payments.charges", &["inventory.InventoryReserved"]);
/// orders decides on the reservation's or the payment's outcome.
pub const ORDERS_SAGA: Subscription = Subscription::new(
    "orders.saga",
    &[
        "inventory.InventoryRejected",
        "payments.PaymentCaptured",
        "payments.PaymentFailed",
    ],
);
/// The projection takes every event (and ignores what is not an order's),
/// so every event has at least one subscriber.
pub const PROJECTION_VIEWS: Subscription = Subscription::new(
    "projection.views",
    &["orders.*", "inventory.*", "payments.*"],
);

/// The projection's history: each order's and each product's events
/// in the order they happened, so ordered per aggregate (docs/adr/0028).
pub const PROJECTION_HISTORY: Subscription = Subscription::new(
    "projection.history",
    &["orders.*", "inventory.StockAdjusted"],
)
.ordered(4)
.whole();

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
