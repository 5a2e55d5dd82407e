//! Orders accepted and undecided past the admission's `stuck_after`
//! (`ADMISSION_STUCK_AFTER_SECS`), per tenant, oldest first: each links to
//! its story; the oldest say here where each waits.

use std::sync::Arc;

use askama::Template;
use axum::extract::State;
use axum::response::Response;

use super::Console;
use super::pages::html;
use crate::ops::{commerce, explain, stuck};
use futures_util::future::join_all;
use reliability::TenantId;

/// Items shown per kind of work: the oldest, which is where an incident
/// began.
const SHOWN: i64 = 200;
/// The oldest this many say where each waits (an `explain` each, at once):
/// an incident's orders usually wait at one place.
const EXPLAINED: usize = 20;

struct Row {
    service: String,
    tenant: i64,
    id: i64,
    since: String,
    age: String,
    /// The first place its events stopped, or why nothing says.
    waits: String,
}

#[derive(Template)]
#[template(path = "stuck.html")]
struct StuckPage {
    title: &'static str,
    after_secs: u64,
    rows: Vec<Row>,
    errors: Vec<String>,
}

pub async fn list(State(console): State<Arc<Console>>) -> Response {
    let after = console.limits.stuck_after;
    let work = commerce::WORK_IN_FLIGHT;
    let (lines, errors) = stuck::stuck(&console.estate, work, after.as_secs_f64(), SHOWN).await;
    let waits = join_all(lines.iter().take(EXPLAINED).map(|l| async {
        let Ok(tenant) = TenantId::new(l.tenant_id) else {
            return String::new();
        };
        let key = work
            .iter()
            .find(|w| w.service == l.service)
            .map_or("order_id", |w| w.key);
        match explain::explain(&console.estate, tenant, key, l.id, commerce::ORDER_TABLES).await {
            Ok(e) => e.stuck.unwrap_or_else(|| {
                "every event reached every subscriber: no event decides it yet".into()
            }),
            Err(e) => format!("not explained: {e}"),
        }
    }))
    .await;
    let rows = lines
        .into_iter()
        .zip(waits.into_iter().chain(std::iter::repeat(String::new())))
        .map(|(l, waits)| Row {
            waits,
            since: l.since.format("%F %T UTC").to_string(),
            age: format!("{:.0} min", l.age_seconds / 60.0),
            service: l.service,
            tenant: l.tenant_id,
            id: l.id,
        })
        .collect();
    html(&StuckPage {
        title: "Stuck orders",
        after_secs: after.as_secs(),
        rows,
        errors,
    })
}
