//! The overview: what needs an operator, oldest first, each linked to its
//! page; each process role's health; the last hour; the money in doubt or
//! disputed; each outbox and each consumer.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Form, Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::Utc;

use super::Console;
use super::pages::{Action, Said, done, html, no_service, or_dash, refused};
use crate::ops::problems::{self, Problem};
use crate::ops::scrape::{self, Sample};
use crate::ops::{self, commerce};

struct OutboxRow {
    service: String,
    pending: String,
    oldest: String,
    dlq: i64,
    error: String,
}

struct ConsumerRow {
    consumer: String,
    ready: String,
    unacked: String,
    dlq: String,
    parked: String,
    event_age: String,
    last_applied: String,
    error: String,
}

struct ProblemRow {
    text: String,
    /// The page or table that shows it; empty: none.
    page: &'static str,
    age: String,
    since: String,
}

#[derive(Template)]
#[template(path = "overview.html")]
struct Overview {
    title: &'static str,
    said: Option<String>,
    problems: Vec<ProblemRow>,
    roles: Vec<ops::roles::RoleLine>,
    /// The last hour: (what, inline SVG).
    charts: Vec<(String, String)>,
    /// Money an operator should know of: (what, how much, since when).
    money: Vec<(String, String, String)>,
    outbox: Vec<OutboxRow>,
    consumers: Vec<ConsumerRow>,
    csrf: String,
    read_only: bool,
}

/// What needs an operator, then each service's outbox and each consumer.
pub async fn overview(State(console): State<Arc<Console>>, Query(q): Query<Said>) -> Response {
    let (mut status, roles) = tokio::join!(
        ops::status::status(&console.estate),
        ops::roles::probe("127.0.0.1", &console.roles)
    );
    let work = commerce::WORK_IN_FLIGHT;
    ops::status::admission(&console.estate, work, &console.limits, &mut status).await;
    for r in roles.iter().filter(|r| !r.ready) {
        let problem = format!(
            "{} {} (ops port {}): {}",
            r.service, r.role, r.port, r.state
        );
        status.problems.push(Problem::new(problem));
    }
    // A console just started has not read the roles yet: it does now.
    let latest = match console.samples.latest() {
        Some(sample) => sample,
        None => scrape::scrape("127.0.0.1", &console.roles).await,
    };
    status.problems.extend(findings_problems(&latest));
    problems::by_age(&mut status.problems);
    let money = money(&status, &latest);
    let outbox = status
        .outbox
        .into_iter()
        .map(|line| OutboxRow {
            pending: or_dash(line.status.as_ref().map(|s| s.pending)),
            oldest: or_dash(
                line.status
                    .as_ref()
                    .and_then(|s| s.oldest_pending_seconds)
                    .map(|s| format!("{s:.0} s")),
            ),
            dlq: line.status.as_ref().map_or(0, |s| s.dlq),
            error: line.error.unwrap_or_default(),
            service: line.service,
        })
        .collect();
    let ages = console.samples.event_ages();
    let consumers = status
        .consumers
        .into_iter()
        .map(|c| ConsumerRow {
            ready: or_dash(c.ready),
            unacked: or_dash(c.unacked),
            dlq: or_dash(c.dlq),
            parked: or_dash(c.parked),
            event_age: or_dash(ages.get(&c.consumer).map(|s| format!("{s:.2} s"))),
            last_applied: or_dash(c.last_applied_at.map(|t| t.format("%F %T UTC"))),
            error: c.error.unwrap_or_default(),
            consumer: c.consumer,
        })
        .collect();
    let now = Utc::now();
    html(&Overview {
        title: "Overview",
        said: q.said,
        problems: status
            .problems
            .into_iter()
            .map(|p| ProblemRow {
                page: page_of(&p),
                age: or_dash(p.since.map(|t| problems::age(t, now))),
                since: or_dash(p.since.map(|t| t.format("%F %T UTC"))),
                text: p.text,
            })
            .collect(),
        roles,
        charts: charts(&console).await,
        money,
        outbox,
        consumers,
        csrf: console.auth.csrf(),
        read_only: console.read_only,
    })
}

/// What reconciliation found and could not repair, and each view that
/// differed from its sources at its last verification pass: read from
/// the processes that run them.
fn findings_problems(latest: &Sample) -> Vec<Problem> {
    let mut found = Vec::new();
    for (name, kind, n) in latest.values(scrape::FINDINGS_SUFFIX, true, "kind") {
        let service = name.split('_').next().unwrap_or(name);
        let repairs_name = name.replace(scrape::FINDINGS_SUFFIX, scrape::REPAIRS_SUFFIX);
        let repaired: f64 = latest
            .values(&repairs_name, false, "kind")
            .filter(|(_, k, _)| *k == kind)
            .map(|(_, _, v)| v)
            .sum();
        if n > repaired {
            found.push(Problem::new(format!(
                "{service}: reconciliation found {:.0} {kind} it could not repair, since its process started: for a person (runbook: \"Reconciliation found a mismatch\")",
                n - repaired
            )));
        }
    }
    for (name, view, n) in latest.values(scrape::DRIFT_SUFFIX, true, "view") {
        let service = name.split('_').next().unwrap_or(name);
        if n > 0.0 {
            found.push(Problem::new(format!(
                "{service}: its {view} view differed from the sources in {n:.0} entities at the last verification pass (`{service} verify`)"
            )));
        }
    }
    found
}

/// The money lines: payments and refunds in doubt, refunds failed, and
/// reconciliation's findings per kind.
fn money(status: &ops::status::Status, latest: &Sample) -> Vec<(String, String, String)> {
    let mut lines = Vec::new();
    if let Some(d) = &status.in_doubt {
        let oldest = or_dash(d.oldest_seconds_ago.map(|s| format!("{s:.0} s ago")));
        let what = format!("{} payment(s), {} refund(s)", d.payments, d.refunds);
        lines.push(("In doubt at the provider".into(), what, oldest));
    }
    if let Some(f) = &status.refunds_failed {
        let latest_at = or_dash(f.latest_seconds_ago.map(|s| format!("{s:.0} s ago")));
        let what = "Refunds ended failed, last 24 h".to_owned();
        lines.push((what, f.count.to_string(), latest_at));
    }
    for (name, kind, n) in latest.values(scrape::FINDINGS_SUFFIX, true, "kind") {
        let what = format!("Reconciliation: {kind}");
        let service = name.split('_').next().unwrap_or(name);
        lines.push((what, format!("{n:.0}"), format!("since {service} started")));
    }
    lines
}

/// Orders decided per second, each outbox that published in the last
/// hour, its lag, and each consumer's event age: a minute a bar.
async fn charts(console: &Console) -> Vec<(String, String)> {
    let mut charts = Vec::new();
    let (service, events) = commerce::DECIDED;
    if let Some(pool) = console.estate.database(service)
        && let Ok(points) = ops::charts::rate(pool, events).await
    {
        let chart = ops::charts::svg(&points, "/s");
        charts.push(("Orders decided per second".into(), chart));
    }
    for (service, pool) in &console.estate.databases {
        match ops::charts::lag(pool).await {
            Ok(points) if points.iter().any(|p| *p > 0.0) => {
                let what = format!("{service}: outbox lag, the longest per minute");
                charts.push((what, ops::charts::svg(&points, "s")));
            }
            _ => {}
        }
    }
    for (consumer, points) in console.samples.event_age_chart() {
        let what = format!("{consumer}: event age at apply");
        charts.push((what, ops::charts::svg(&points, "s")));
    }
    charts
}

/// Where a problem is shown, by what it says (its wording is
/// `ops::status`'s and this page's, tested there).
fn page_of(problem: &str) -> &'static str {
    const PAGES: &[(&str, &str)] = &[
        ("dead-lettered", "/dead-letters"),
        ("parked", "/parked"),
        ("undecided", "/stuck"),
        ("(ops port", "#roles"),
        ("outbox row(s) in the DLQ table", "#outbox"),
        ("pending, the oldest", "#outbox"),
        ("no consumer attached", "#consumers"),
        ("in doubt", "#money"),
        ("refund(s) ended failed", "#money"),
        ("reconciliation found", "#money"),
    ];
    PAGES
        .iter()
        .find(|(says, _)| problem.contains(says))
        .map_or("", |(_, page)| page)
}

/// Publishes a service's outbox DLQ table rows again. Nothing there (a
/// second click, or another operator first) is said, not done twice.
pub async fn redrive_outbox(
    State(console): State<Arc<Console>>,
    Path(service): Path<String>,
    Form(action): Form<Action>,
) -> Response {
    if !console.auth.csrf_ok(&action.csrf) {
        return refused(
            StatusCode::FORBIDDEN,
            "this form did not come from this console",
        );
    }
    let Some(pool) = console.estate.database(&service) else {
        return no_service(&service);
    };
    match ops::outbox::redrive_dlq(pool, None).await {
        Ok(0) => refused(
            StatusCode::CONFLICT,
            &format!("{service}'s outbox DLQ is empty: re-driven already, or by someone else"),
        ),
        Ok(n) => {
            let said = format!("{n} row(s) of {service}'s outbox DLQ are pending again");
            done("/", &said)
        }
        Err(e) => refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}
