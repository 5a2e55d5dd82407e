//! Orders accepted and undecided past the admission's `stuck_after`
//! (`ADMISSION_STUCK_AFTER_SECS`), per tenant, oldest first: each links to
//! its story, which says where it waits.

use std::sync::Arc;

use askama::Template;
use axum::extract::State;
use axum::response::Response;

use super::Console;
use super::pages::html;
use crate::ops::{commerce, stuck};

/// Items shown per kind of work: the oldest, which is where an incident
/// began.
const SHOWN: i64 = 200;

struct Row {
    service: String,
    tenant: i64,
    id: i64,
    since: String,
    age: String,
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
    let rows = lines
        .into_iter()
        .map(|l| Row {
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
