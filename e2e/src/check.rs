//! The checker: after the system has gone quiet, the invariants of
//! ARCHITECTURE.md ("Invariants") read from the databases, the queues and the provider.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use sqlx::PgPool;

/// The provider's money per charge key (`/control/ledger`).
pub type Ledger = HashMap<String, psp_sim::KeyMoney>;

/// The owner pools of the four service databases, and the graph.
#[derive(Clone)]
pub struct Dbs {
    pub orders: PgPool,
    pub inventory: PgPool,
    pub payments: PgPool,
    pub projection: PgPool,
    /// None where the stack runs no graph service (another build).
    pub graph: Option<std::sync::Arc<graph::store::Store>>,
    /// The stack was rolled from a release whose relays do not number
    /// (`make e2e-upgrade`): an event without a number is that release's,
    /// published before any ordered subscription existed. The ordered
    /// subscription must hold none of them, and needs none.
    pub rolled_from_unnumbered: bool,
}

/// What one scenario's orders came to; `violations` empty means it held.
#[derive(Debug, Default)]
pub struct Verdict {
    pub orders: usize,
    pub confirmed: usize,
    pub cancelled: usize,
    pub events: usize,
    /// Duplicate deliveries the consumers absorbed (I2 at work, not a failure).
    pub duplicates: i64,
    /// Messages in the consumer DLQs plus rows in the outbox DLQ tables.
    pub dead_letters: u32,
    pub violations: Vec<String>,
}

/// Which consumer (in which database) must apply each (source, event type).
fn subscribers(source: &str, event_type: &str) -> &'static [(&'static str, Db)] {
    use Db::*;
    match (source, event_type) {
        ("orders", "OrderPlaced" | "OrderConfirmed" | "OrderCancelled") => &[
            ("inventory.stock", Inventory),
            ("projection.views", Projection),
            ("projection.history", Projection),
        ],
        ("inventory", "StockAdjusted") => &[
            ("projection.views", Projection),
            ("projection.history", Projection),
        ],
        ("inventory", "InventoryReserved") => &[
            ("payments.charges", Payments),
            ("projection.views", Projection),
        ],
        ("inventory", "InventoryRejected") => {
            &[("orders.saga", Orders), ("projection.views", Projection)]
        }
        ("payments", "PaymentCaptured" | "PaymentFailed") => {
            &[("orders.saga", Orders), ("projection.views", Projection)]
        }
        ("payments", "RefundIssued") => &[("projection.views", Projection)],
        // An event type with no subscriber would be returned as unroutable.
        _ => &[("(no subscriber)", Projection)],
    }
}

#[derive(Clone, Copy)]
enum Db {
    Orders,
    Inventory,
    Payments,
    Projection,
}

impl Dbs {
    /// Duplicate deliveries the tenant's consumers absorbed so far (I2).
    pub async fn duplicates(&self, tenant: i64) -> anyhow::Result<i64> {
        let mut total = 0;
        for pool in [
            &self.orders,
            &self.inventory,
            &self.payments,
            &self.projection,
        ] {
            let n: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(duplicate_count), 0)::bigint FROM consumer_offsets WHERE tenant_id = $1",
            )
            .bind(tenant)
            .fetch_one(pool)
            .await?;
            total += n;
        }
        Ok(total)
    }

    fn pool(&self, db: Db) -> &PgPool {
        match db {
            Db::Orders => &self.orders,
            Db::Inventory => &self.inventory,
            Db::Payments => &self.payments,
            Db::Projection => &self.projection,
        }
    }

    /// Nothing left to do for `tenant`: its outbox rows relayed, its
    /// payments and refunds settled, its orders decided. Per tenant, so one
    /// scenario's lost event does not hold up the next (each has its own).
    pub async fn quiet(&self, tenant: i64) -> anyhow::Result<bool> {
        for pool in [&self.orders, &self.inventory, &self.payments] {
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL AND tenant_id = $1",
            )
            .bind(tenant)
            .fetch_one(pool)
            .await?;
            if pending > 0 {
                return Ok(false);
            }
        }
        let open: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM payments WHERE status = 'pending' AND tenant_id = $1)
                  + (SELECT count(*) FROM refunds WHERE status = 'pending' AND tenant_id = $1)",
        )
        .bind(tenant)
        .fetch_one(&self.payments)
        .await?;
        let undecided: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM orders WHERE status = 'pending' AND tenant_id = $1",
        )
        .bind(tenant)
        .fetch_one(&self.orders)
        .await?;
        Ok(open == 0 && undecided == 0)
    }

    /// Checks every invariant for `tenant`'s data. `ledger` is the
    /// provider's money per charge key.
    pub async fn check(&self, tenant: i64, ledger: &Ledger) -> anyhow::Result<Verdict> {
        let mut v = Verdict::default();
        // I6: every accepted order terminal.
        let orders: Vec<(i64, String)> =
            sqlx::query_as("SELECT order_id, status FROM orders WHERE tenant_id = $1")
                .bind(tenant)
                .fetch_all(&self.orders)
                .await?;
        v.orders = orders.len();
        for (id, status) in &orders {
            match status.as_str() {
                "confirmed" => v.confirmed += 1,
                "cancelled" => v.cancelled += 1,
                other => v.violations.push(format!("I6: order {id} is {other}")),
            }
        }
        let fate: HashMap<i64, &str> = orders.iter().map(|(id, s)| (*id, s.as_str())).collect();
        // I4, per order from the provider's own ledger: charged − refunded
        // is the total less our refunds if the order is confirmed, else 0;
        // at most one charge per key, no refund beyond its charge.
        let payments: Vec<(i64, i64, String, i64, i64)> = sqlx::query_as(
            "SELECT payment_id, order_id, status, amount_cents,
                    (SELECT coalesce(sum(r.amount_cents), 0)::bigint FROM refunds r
                     WHERE r.tenant_id = p.tenant_id AND r.payment_id = p.payment_id AND r.status = 'succeeded')
             FROM payments p WHERE tenant_id = $1",
        )
        .bind(tenant)
        .fetch_all(&self.payments)
        .await?;
        let captured: BTreeSet<i64> = payments
            .iter()
            .filter(|p| p.2 == "captured")
            .map(|p| p.1)
            .collect();
        for (payment_id, order_id, status, amount, refunded) in &payments {
            let key = contracts::provider::charge_key(tenant, *payment_id);
            let (times, charged, back) = ledger.get(&key).map_or((0, 0, 0), |m| {
                (m.times_charged, m.charged_cents, m.refunded_cents)
            });
            if times > 1 {
                v.violations.push(format!(
                    "I4: payment {payment_id} (order {order_id}) charged {times} times"
                ));
            }
            if back > charged {
                v.violations
                    .push(format!("I4: {key}: {back} refunded of {charged} charged"));
            }
            let order = fate.get(order_id).copied().unwrap_or("missing");
            let expected = if order == "confirmed" {
                amount - refunded
            } else {
                0
            };
            if charged - back != expected {
                v.violations.push(format!(
                    "I4: order {order_id} is {order} (payment {status}): the provider holds {} under {key} (charged {charged}, refunded {back}), expected {expected}",
                    charged - back
                ));
            }
        }
        for (id, status) in &orders {
            if status == "confirmed" && !captured.contains(id) {
                v.violations.push(format!(
                    "I4: order {id} confirmed without a captured payment"
                ));
            }
            if status == "cancelled" && captured.contains(id) {
                v.violations.push(format!(
                    "I4: order {id} cancelled but its payment was captured"
                ));
            }
        }
        // I5: stock never negative, nothing left reserved once all is decided.
        let stock: Vec<(String, i64, i64)> =
            sqlx::query_as("SELECT sku, on_hand, reserved FROM products WHERE tenant_id = $1")
                .bind(tenant)
                .fetch_all(&self.inventory)
                .await?;
        for (sku, on_hand, reserved) in &stock {
            if on_hand - reserved < 0 || *reserved != 0 {
                v.violations
                    .push(format!("I5: {sku} on_hand {on_hand} reserved {reserved}"));
            }
        }
        // I1/I2: every committed event applied by every subscriber (the
        // dedup record is the proof of application, at most once by key).
        for (source, pool) in [
            ("orders", &self.orders),
            ("inventory", &self.inventory),
            ("payments", &self.payments),
        ] {
            let events: Vec<(i64, String, bool)> = sqlx::query_as(
                "SELECT id, event_type, aggregate_seq IS NULL FROM outbox_messages WHERE tenant_id = $1",
            )
            .bind(tenant)
            .fetch_all(pool)
            .await?;
            v.events += events.len();
            let mut applied: HashMap<&str, BTreeSet<i64>> = HashMap::new();
            for (id, event_type, unnumbered) in &events {
                for (consumer, db) in subscribers(source, event_type) {
                    if *unnumbered && self.rolled_from_unnumbered && *consumer == ORDERED.consumer {
                        continue;
                    }
                    if !applied.contains_key(consumer) {
                        let ids: Vec<i64> = sqlx::query_scalar(
                            "SELECT message_id FROM processed_messages WHERE tenant_id = $1 AND consumer = $2 AND source = $3",
                        )
                        .bind(tenant)
                        .bind(*consumer)
                        .bind(source)
                        .fetch_all(self.pool(*db))
                        .await?;
                        applied.insert(consumer, ids.into_iter().collect());
                    }
                    if !applied[consumer].contains(id) {
                        v.violations.push(format!(
                            "I1: {source} event {id} ({event_type}) never applied by {consumer}"
                        ));
                    }
                }
            }
        }
        v.violations.extend(self.order(tenant).await?);
        v.duplicates = self.duplicates(tenant).await?;
        // The projection agrees with the orders service.
        let views: BTreeMap<i64, String> = sqlx::query_as::<_, (i64, String)>(
            "SELECT order_id, status FROM order_views WHERE tenant_id = $1",
        )
        .bind(tenant)
        .fetch_all(&self.projection)
        .await?
        .into_iter()
        .collect();
        for (id, status) in &orders {
            if views.get(id) != Some(status) {
                v.violations.push(format!(
                    "projection: order {id} is {:?}, orders says {status}",
                    views.get(id)
                ));
            }
        }
        // Last, and only once everything else holds: the settle loop runs
        // this check every 200 ms while the stack drains, and the graph's
        // verification reads every order of the tenant.
        if let Some(graph) = &self.graph
            && v.violations.is_empty()
        {
            v.violations
                .extend(self.graph_verified(graph, tenant).await?);
        }
        Ok(v)
    }
}

/// The ordered subscription the checker holds to outbox order.
const ORDERED: contracts::topology::Subscription = contracts::topology::PROJECTION_HISTORY;

type Aggregate = (String, String, String);

impl Dbs {
    /// Order per aggregate (docs/adr/0028): for every aggregate whose events
    /// the ordered subscription takes, the events it applied, in the order
    /// it applied them, are the source's in the relay's numbering
    /// (`aggregate_seq`); every such event carries a number; nothing is
    /// left parked.
    pub async fn order(&self, tenant: i64) -> anyhow::Result<Vec<String>> {
        let mut violations = Vec::new();
        let mut outbox: BTreeMap<Aggregate, Vec<(i64, i64)>> = BTreeMap::new();
        let mut unnumbered = BTreeSet::new();
        for (source, pool) in [("orders", &self.orders), ("inventory", &self.inventory)] {
            let rows: Vec<(i64, String, String, String, Option<i64>)> = sqlx::query_as(
                "SELECT id, event_type, aggregate_type, aggregate_id, aggregate_seq
                 FROM outbox_messages WHERE tenant_id = $1",
            )
            .bind(tenant)
            .fetch_all(pool)
            .await?;
            for (id, event_type, aggregate_type, aggregate_id, seq) in rows {
                let key = format!("{source}.{event_type}");
                if !ORDERED
                    .bindings
                    .iter()
                    .any(|b| contracts::topology::topic_matches(b, &key))
                {
                    continue;
                }
                let Some(seq) = seq else {
                    if self.rolled_from_unnumbered {
                        unnumbered.insert(id);
                        continue;
                    }
                    violations.push(format!(
                        "order: {source} event {id} ({event_type}) was published without its aggregate's number"
                    ));
                    continue;
                };
                outbox
                    .entry((source.to_owned(), aggregate_type, aggregate_id))
                    .or_default()
                    .push((seq, id));
            }
        }
        let applied: Vec<(String, String, String, i64)> = sqlx::query_as(
            "SELECT source, aggregate_type, aggregate_id, message_id FROM aggregate_history
             WHERE tenant_id = $1 ORDER BY source, aggregate_type, aggregate_id, position",
        )
        .bind(tenant)
        .fetch_all(&self.projection)
        .await?;
        let mut history: BTreeMap<Aggregate, Vec<i64>> = BTreeMap::new();
        for (source, aggregate_type, aggregate_id, id) in applied {
            if unnumbered.contains(&id) {
                violations.push(format!(
                    "order: {} applied {source} event {id}, which an older release's relay published without a number",
                    ORDERED.consumer
                ));
            }
            history
                .entry((source, aggregate_type, aggregate_id))
                .or_default()
                .push(id);
        }
        for (aggregate, mut events) in outbox {
            events.sort_unstable();
            let expected: Vec<i64> = events.iter().map(|(_, id)| *id).collect();
            let got = history.remove(&aggregate).unwrap_or_default();
            // What is missing altogether is I1's to report; a prefix is a
            // run still catching up, not a reordering.
            if got.len() == expected.len() && got != expected {
                let (source, t, id) = &aggregate;
                violations.push(format!(
                    "order: {} applied {source} {t}:{id}'s events as {got:?}; the outbox order is {expected:?}",
                    ORDERED.consumer
                ));
            }
        }
        let parked: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT aggregate_type, aggregate_id, error FROM parked_aggregates
             WHERE tenant_id = $1 AND consumer = $2",
        )
        .bind(tenant)
        .bind(ORDERED.consumer)
        .fetch_all(&self.projection)
        .await?;
        for (t, id, error) in parked {
            violations.push(format!("order: {t}:{id} is parked: {error}"));
        }
        Ok(violations)
    }
}
