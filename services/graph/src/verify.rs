//! Verification (docs/adr/0035): the graph against the sources' current
//! rows, as the projection's is, at any age (the rows outlive the
//! outbox's archive).
//!
//! - Each order's node and edges against what its facts say they should
//!   be (status, total, customer, lines, stock held and released,
//!   payments, refunds), for every order whose rows have been still for
//!   the grace period. A difference is looked at twice, the graph read
//!   before the sources, so an order that moved between reads is not one.
//! - Each customer's order count and each product's units ordered, a
//!   tenant at a time.
//!
//! The orders are walked in key order, a chunk at a time, so a pass holds
//! no more than a chunk in memory. The reads are read-only on the engine.
//! With `repair`, each difference is re-derived from the sources
//! (`repair`) and looked at again. A product's `on_hand` is not verified:
//! it is the figure of the last stock adjustment event, and inventory's
//! rows move it without one as reservations are committed.

pub(crate) mod repair;
mod shape;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use reliability::Result;
use reliability::metrics::{Kind, Metric};
use serde::Serialize;
use service_kit::service::ShutdownToken;
use sources::{Difference, Key, Sources};

use crate::store::Store;

pub use shape::Shape;

pub const DIFFERENCES: &str = "graph_verify_differences";
pub const REPAIRS: &str = "graph_verify_repairs_total";
pub const LAST_SUCCESS: &str = "graph_verify_last_success_timestamp_seconds";

/// The scheduled pass's metrics.
const SCHEDULE: sources::verify::Schedule = sources::verify::Schedule {
    view: "graph",
    parts: &["orders", "customers", "products"],
    metrics: METRICS,
    differences: DIFFERENCES,
    repairs: REPAIRS,
    last_success: LAST_SUCCESS,
};

/// The metrics of the scheduled pass, for the catalogue.
pub const METRICS: &[Metric] = &[
    Metric {
        name: DIFFERENCES,
        kind: Kind::Gauge,
        labels: &["view"],
        help: "Entities whose graph differed from the sources at the last verification pass (view=\"orders\"|\"customers\"|\"products\").",
    },
    Metric {
        name: REPAIRS,
        kind: Kind::Counter,
        labels: &["view"],
        help: "Graph entities re-derived from the sources by verification.",
    },
    Metric {
        name: LAST_SUCCESS,
        kind: Kind::Gauge,
        labels: &[],
        help: "When the graph's last verification pass ended without an error (unix seconds).",
    },
];

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub orders_checked: usize,
    /// Orders whose source rows moved within the grace period.
    pub orders_settling: usize,
    pub tenants_checked: usize,
    pub differences: Vec<Difference>,
}

impl Report {
    pub fn remaining(&self) -> usize {
        self.differences.iter().filter(|d| !d.repaired).count()
    }
}

pub struct Verifier {
    store: Arc<Store>,
    sources: Sources,
    grace: Duration,
    chunk: i64,
}

impl Verifier {
    pub fn new(store: Arc<Store>, sources: Sources, grace: Duration, chunk: i64) -> Self {
        Self {
            store,
            sources,
            grace,
            chunk: chunk.max(1),
        }
    }

    pub async fn run_once(&self, repair: bool) -> Result<Report> {
        let mut report = Report::default();
        self.orders(None, repair, &mut report).await?;
        for tenant in sources::tenants(&self.sources).await? {
            self.tenant_counts(tenant, repair, &mut report).await?;
        }
        Ok(report)
    }

    /// One tenant's part of a pass (the e2e checker's, a scenario's tenant).
    pub async fn run_tenant(&self, tenant: i64, repair: bool) -> Result<Report> {
        let mut report = Report::default();
        self.orders(Some(tenant), repair, &mut report).await?;
        self.tenant_counts(tenant, repair, &mut report).await?;
        Ok(report)
    }

    async fn tenant_counts(&self, tenant: i64, repair: bool, report: &mut Report) -> Result<()> {
        report.tenants_checked += 1;
        for view in ["customers", "products"] {
            self.counts(tenant, view, repair, report).await?;
        }
        Ok(())
    }

    /// Every order in key order, or `only` one tenant's.
    async fn orders(&self, only: Option<i64>, repair: bool, report: &mut Report) -> Result<()> {
        let grace = self.grace.as_secs_f64();
        let mut after = only.map_or(Key::default(), |t| Key::new(t, i64::MIN));
        loop {
            let mut facts = sources::orders_after(&self.sources, after, self.chunk, grace).await?;
            let mut full = facts.len() as i64 == self.chunk;
            if let Some(t) = only
                && facts.iter().any(|o| o.key.tenant_id != t)
            {
                facts.retain(|o| o.key.tenant_id == t);
                full = false;
            }
            let last = facts.last().map(|o| o.key);
            let mut by_tenant: BTreeMap<i64, Vec<&sources::Order>> = BTreeMap::new();
            for o in &facts {
                by_tenant.entry(o.key.tenant_id).or_default().push(o);
            }
            let mut suspects = Vec::new();
            for (tenant, orders) in by_tenant {
                // The graph's orders of this tenant in the chunk's range:
                // the last tenant of a full chunk goes on in the next.
                let lower = if tenant == after.tenant_id {
                    after.order_id
                } else {
                    i64::MIN
                };
                let upper = match last {
                    Some(l) if full && l.tenant_id == tenant => l.order_id,
                    _ => i64::MAX,
                };
                let mut drawn =
                    shape::between(&self.store, repair::tenant_of(tenant)?, lower, upper)
                        .await
                        .map_err(repair::upstream)?;
                for o in orders {
                    report.orders_checked += 1;
                    let shape = drawn.remove(&o.key.order_id);
                    if !o.settled {
                        report.orders_settling += 1;
                    } else if shape.as_ref() != Some(&shape::expected(o)) {
                        suspects.push(o.key);
                    }
                }
                suspects.extend(drawn.into_keys().map(|id| Key::new(tenant, id)));
            }
            for key in suspects {
                if let Some(d) = self.order(key, repair).await? {
                    report.differences.push(d);
                }
            }
            match last {
                Some(l) if full => after = l,
                _ => return Ok(()),
            }
        }
    }

    /// The graph's order `key`, if it has one.
    async fn drawn(&self, key: Key) -> Result<Option<Shape>> {
        Ok(shape::between(
            &self.store,
            repair::tenant_of(key.tenant_id)?,
            key.before().order_id,
            key.order_id,
        )
        .await
        .map_err(repair::upstream)?
        .remove(&key.order_id))
    }

    /// The second look at an order that differed, the graph read first.
    async fn order(&self, key: Key, repair: bool) -> Result<Option<Difference>> {
        let grace = self.grace.as_secs_f64();
        let drawn = self.drawn(key).await?;
        let facts = sources::order(&self.sources, key, grace).await?;
        let expected = facts.as_ref().map(shape::expected);
        let detail = match (&drawn, &facts, &expected) {
            (_, Some(f), _) if !f.settled => return Ok(None),
            (d, _, e) if d == e => return Ok(None),
            (Some(d), _, Some(e)) => format!("graph {d:?}; the sources say {e:?}"),
            (None, _, Some(e)) => format!("no node; the sources say {e:?}"),
            (Some(d), _, None) => format!("graph {d:?} of an order no source has"),
            (None, _, None) => return Ok(None),
        };
        let mut repaired = false;
        if repair {
            repair::order(&self.store, &self.sources, key).await?;
            let now = self.drawn(key).await?;
            let facts = sources::order(&self.sources, key, 0.0).await?;
            repaired = now == facts.as_ref().map(shape::expected);
        }
        Ok(Some(Difference {
            view: "orders",
            tenant_id: key.tenant_id,
            entity: key.order_id.to_string(),
            detail,
            repaired,
        }))
    }

    /// A tenant's customers' order counts or products' units ordered.
    async fn counts(
        &self,
        tenant: i64,
        view: &'static str,
        repair: bool,
        report: &mut Report,
    ) -> Result<()> {
        let grace = self.grace.as_secs_f64();
        let want = |tallies: BTreeMap<String, sources::Tally>| -> BTreeMap<String, Option<i64>> {
            tallies
                .into_iter()
                .map(|(name, t)| (name, t.settled.then_some(t.count)))
                .collect()
        };
        let load = || async {
            let drawn = shape::counts(&self.store, repair::tenant_of(tenant)?, view)
                .await
                .map_err(repair::upstream)?;
            let tallies = if view == "customers" {
                sources::customers(&self.sources, tenant, grace).await?
            } else {
                sources::units_ordered(&self.sources, tenant, grace).await?
            };
            Ok::<_, reliability::Error>((drawn, want(tallies)))
        };
        let differing = |(drawn, want): &(BTreeMap<String, i64>, BTreeMap<String, Option<i64>>)| {
            let mut names: Vec<String> = Vec::new();
            for (name, n) in want {
                match n {
                    Some(n) if drawn.get(name).copied().unwrap_or(0) != *n => {
                        names.push(name.clone())
                    }
                    _ => {}
                }
            }
            names.extend(drawn.keys().filter(|k| !want.contains_key(*k)).cloned());
            names
        };
        let first = load().await?;
        let names = differing(&first);
        if names.is_empty() {
            return Ok(());
        }
        let left = if repair {
            repair::names(&self.store, repair::tenant_of(tenant)?, view, names.clone()).await?;
            differing(&load().await?)
        } else {
            names.clone()
        };
        for name in names {
            let (drawn, want) = &first;
            report.differences.push(Difference {
                view,
                tenant_id: tenant,
                detail: format!(
                    "graph {}; the sources say {}",
                    drawn.get(&name).copied().unwrap_or(0),
                    want.get(&name).copied().flatten().unwrap_or(0)
                ),
                repaired: repair && !left.contains(&name),
                entity: name,
            });
        }
        Ok(())
    }

    /// A pass every `every` until `stop`, each one's outcome in the metrics.
    pub async fn run(self, every: Duration, repair: bool, stop: ShutdownToken) {
        SCHEDULE
            .run(every, stop, || async {
                Ok(self.run_once(repair).await?.differences)
            })
            .await
    }
}
