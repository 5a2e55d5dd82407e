//! Verification (docs/adr/0035): the projection against its sources, as
//! `payments reconcile` holds payments against the provider.
//!
//! - Each order view against what the sources' current rows say it should
//!   be (the order's status and total, its reservation, its payment and
//!   succeeded refunds), for every order whose source rows have been still
//!   for the grace period: a view may trail its sources by the consumer's
//!   lag, never for longer. A difference is looked at twice, the view
//!   read before the sources, so a view that moved between two reads is
//!   not one.
//! - Each ordered history against the order it must have (`history`).
//!
//! It walks both in key order, a chunk at a time, so one pass holds no
//! more than a chunk in memory and no long transaction anywhere. With
//! `repair`, each difference is re-derived from the sources (`repair`),
//! under the lock the live appliers take, and looked at again.

mod history;
mod repair;
mod sources;

use std::time::Duration;

use reliability::Result;
use reliability::metrics::{Kind, Metric};
use serde::Serialize;
use service_kit::service::ShutdownToken;
use sqlx::PgPool;

pub use ::sources::{Difference, Key, Sources};
pub use sources::OrderState;

pub const DIFFERENCES: &str = "projection_verify_differences";
pub const REPAIRS: &str = "projection_verify_repairs_total";
pub const LAST_SUCCESS: &str = "projection_verify_last_success_timestamp_seconds";

/// The scheduled pass's metrics.
const SCHEDULE: ::sources::verify::Schedule = ::sources::verify::Schedule {
    view: "projection",
    parts: &["orders", "history"],
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
        help: "Entities whose view differed from the sources at the last verification pass (view=\"orders\"|\"history\").",
    },
    Metric {
        name: REPAIRS,
        kind: Kind::Counter,
        labels: &["view"],
        help: "Entities re-derived from the sources by verification.",
    },
    Metric {
        name: LAST_SUCCESS,
        kind: Kind::Gauge,
        labels: &[],
        help: "When the last verification pass ended without an error (unix seconds).",
    },
];

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub orders_checked: usize,
    /// Orders whose source rows moved within the grace period.
    pub orders_settling: usize,
    pub histories_checked: usize,
    pub differences: Vec<Difference>,
}

pub struct Verifier {
    /// The projection as its owner: every tenant's views, and the repairs.
    projection: PgPool,
    sources: Sources,
    grace: Duration,
    chunk: i64,
}

impl Verifier {
    pub fn new(projection: PgPool, sources: Sources, grace: Duration, chunk: i64) -> Self {
        Self {
            projection,
            sources,
            grace,
            chunk: chunk.max(1),
        }
    }

    pub async fn run_once(&self, repair: bool) -> Result<Report> {
        let mut report = Report::default();
        self.orders(repair, &mut report).await?;
        self.histories(repair, &mut report).await?;
        Ok(report)
    }

    async fn orders(&self, repair: bool, report: &mut Report) -> Result<()> {
        let grace = self.grace.as_secs_f64();
        let mut after = Key::default();
        loop {
            let expected = sources::after(&self.sources, after, self.chunk, grace).await?;
            let last = expected.last().map(|e| e.key);
            // The last chunk reaches to the end: a view past every order too.
            let upto = last.filter(|_| expected.len() as i64 == self.chunk);
            let mut views = sources::views_between(&self.projection, after, upto).await?;
            let mut suspects = Vec::new();
            for e in &expected {
                let view = views.remove(&e.key);
                report.orders_checked += 1;
                if !e.settled {
                    report.orders_settling += 1;
                } else if view.as_ref() != Some(&e.state) {
                    suspects.push(e.key);
                }
            }
            suspects.extend(views.into_keys());
            for key in suspects {
                if let Some(d) = self.order(key, repair).await? {
                    report.differences.push(d);
                }
            }
            match upto {
                Some(last) => after = last,
                None => return Ok(()),
            }
        }
    }

    /// The second look at an order that differed, the view read first.
    async fn order(&self, key: Key, repair: bool) -> Result<Option<Difference>> {
        let grace = self.grace.as_secs_f64();
        let view = sources::view(&self.projection, key).await?;
        let expected = sources::expected(&self.sources, key, grace).await?;
        let detail = match (&view, &expected) {
            (_, Some(e)) if !e.settled => return Ok(None),
            (Some(v), Some(e)) if *v == e.state => return Ok(None),
            (None, None) => return Ok(None),
            (Some(v), Some(e)) => format!("view {v:?}; the sources say {:?}", e.state),
            (None, Some(e)) => format!("no view; the sources say {:?}", e.state),
            (Some(v), None) => format!("view {v:?} of an order no source has"),
        };
        let mut repaired = false;
        if repair {
            let whole = repair::order(&self.projection, &self.sources, key).await?;
            let now = sources::view(&self.projection, key).await?;
            repaired = match &expected {
                Some(e) => now.as_ref() == Some(&e.state),
                None => now.is_none(),
            };
            if !repaired && !whole {
                tracing::warn!(
                    tenant = key.tenant_id,
                    order = key.order_id,
                    "verify: not repaired: the order's history is past the sources' archive, and its rows alone did not give its view"
                );
            }
        }
        Ok(Some(Difference {
            view: "orders",
            tenant_id: key.tenant_id,
            entity: key.order_id.to_string(),
            detail,
            repaired,
        }))
    }

    async fn histories(&self, repair: bool, report: &mut Report) -> Result<()> {
        let mut after = history::Aggregate::default();
        loop {
            let (looked, last, findings) =
                history::after(&self.projection, &after, self.chunk).await?;
            report.histories_checked += looked;
            for f in findings {
                // A reorder mends the order; a gap waits for its event.
                let repaired = repair && !f.gap && {
                    history::reorder(&self.projection, &f.aggregate).await?;
                    true
                };
                let what = match (f.out_of_order, f.gap) {
                    (true, true) => "events out of order, and a number skipped",
                    (true, false) => "events out of order",
                    _ => "a number skipped: an event never applied (see `reliability park list`)",
                };
                report.differences.push(Difference {
                    view: "history",
                    tenant_id: f.aggregate.tenant_id,
                    entity: format!(
                        "{}:{}",
                        f.aggregate.aggregate_type, f.aggregate.aggregate_id
                    ),
                    detail: what.to_owned(),
                    repaired,
                });
            }
            match last {
                Some(last) if looked as i64 == self.chunk => after = last,
                _ => return Ok(()),
            }
        }
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
