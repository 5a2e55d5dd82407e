//! The console's pages and actions: each reads through `crate::ops`, as the
//! CLI does, and renders one template.

use std::fmt::Display;
use std::sync::Arc;

use askama::Template;
use axum::extract::{Form, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use reliability::TenantId;
use serde::Deserialize;

use super::Console;
use crate::ops::{self, commerce};

/// A template rendered, or a 500 that says which.
pub(super) fn html(page: &impl Template) -> Response {
    match page.render() {
        Ok(body) => Html(body).into_response(),
        Err(e) => refused(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("rendering: {e}"),
        ),
    }
}

#[derive(Template)]
#[template(path = "message.html")]
struct Message<'a> {
    title: &'a str,
    text: &'a str,
}

/// A plain page that says why, with `status`.
pub fn refused(status: StatusCode, why: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Refused");
    (status, html(&Message { title, text: why })).into_response()
}

#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage<'a> {
    title: &'a str,
    error: Option<&'a str>,
}

pub fn login_page(error: Option<&str>) -> Response {
    html(&LoginPage {
        title: "Sign in",
        error,
    })
}

pub(super) fn or_dash<T: Display>(value: Option<T>) -> String {
    value.map_or_else(|| "—".to_owned(), |v| v.to_string())
}

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
    last_applied: String,
    error: String,
}

#[derive(Template)]
#[template(path = "overview.html")]
struct Overview {
    title: &'static str,
    said: Option<String>,
    /// Each problem, and the page or table that shows it.
    problems: Vec<(String, &'static str)>,
    roles: Vec<ops::roles::RoleLine>,
    /// The last hour: (what, inline SVG).
    charts: Vec<(String, String)>,
    outbox: Vec<OutboxRow>,
    consumers: Vec<ConsumerRow>,
    csrf: String,
    read_only: bool,
}

#[derive(Deserialize)]
pub struct Said {
    pub said: Option<String>,
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
        status.problems.insert(0, problem);
    }
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
    let consumers = status
        .consumers
        .into_iter()
        .map(|c| ConsumerRow {
            ready: or_dash(c.ready),
            unacked: or_dash(c.unacked),
            dlq: or_dash(c.dlq),
            parked: or_dash(c.parked),
            last_applied: or_dash(c.last_applied_at.map(|t| t.format("%F %T UTC"))),
            error: c.error.unwrap_or_default(),
            consumer: c.consumer,
        })
        .collect();
    html(&Overview {
        title: "Overview",
        said: q.said,
        problems: status
            .problems
            .into_iter()
            .map(|p| {
                let page = page_of(&p);
                (p, page)
            })
            .collect(),
        roles,
        charts: charts(&console).await,
        outbox,
        consumers,
        csrf: console.auth.csrf(),
        read_only: console.read_only,
    })
}

/// Orders decided per second, and each outbox that published in the
/// last hour, its lag: a minute a bar.
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
    charts
}

/// Where a problem `status` names is shown, by what it says (its wording
/// is `ops::status`'s, tested there).
fn page_of(problem: &str) -> &'static str {
    const PAGES: &[(&str, &str)] = &[
        ("dead-lettered", "/dead-letters"),
        ("parked", "/parked"),
        ("undecided", "/stuck"),
        ("(ops port", "#roles"),
        ("outbox row(s) in the DLQ table", "#outbox"),
        ("pending, the oldest", "#outbox"),
        ("no consumer attached", "#consumers"),
    ];
    PAGES
        .iter()
        .find(|(says, _)| problem.contains(says))
        .map_or("", |(_, page)| page)
}

#[derive(Deserialize)]
pub struct OrderQuery {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    id: String,
}

struct EventRow {
    source: String,
    id: i64,
    event_type: String,
    occurred_at: String,
    at: String,
    attempts: i32,
    last_error: String,
    deliveries: Vec<(String, String)>,
}

#[derive(Template)]
#[template(path = "order.html")]
struct OrderPage {
    title: String,
    stuck: Option<String>,
    rows: Vec<(String, String, String)>,
    events: Vec<EventRow>,
    provider: Vec<(String, String, String)>,
}

/// An order's story: its rows in every service, each event that names it
/// and where each subscriber has it, and the provider's record of its
/// payments and refunds beside ours.
pub async fn order(State(console): State<Arc<Console>>, Query(q): Query<OrderQuery>) -> Response {
    let (Ok(tenant), Ok(id)) = (q.tenant.trim().parse::<i64>(), q.id.trim().parse::<i64>()) else {
        return refused(
            StatusCode::BAD_REQUEST,
            "a tenant and an order id are numbers",
        );
    };
    let Ok(tenant) = TenantId::new(tenant) else {
        return refused(StatusCode::BAD_REQUEST, "a tenant id is positive");
    };
    let estate = &console.estate;
    let explained = ops::explain::explain(estate, tenant, "order_id", id, commerce::ORDER_TABLES);
    let mut e = match explained.await {
        Ok(e) => e,
        Err(err) => return refused(StatusCode::BAD_GATEWAY, &format!("{err:#}")),
    };
    if e.rows.is_empty() && e.events.is_empty() {
        let why = format!("tenant {tenant} has no order {id} in any service");
        return refused(StatusCode::NOT_FOUND, &why);
    }
    let items = commerce::ORDER_PROVIDER_ITEMS;
    if let Err(err) = ops::explain::provider_view(estate, &console.psp_url, items, &mut e).await {
        e.provider.push(ops::explain::ProviderView {
            key: "—".into(),
            ours: "—".into(),
            provider: None,
            error: Some(format!("{err:#}")),
        });
    }
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    html(&OrderPage {
        title: format!("Order {id} of tenant {tenant}"),
        stuck: e.stuck,
        rows: e
            .rows
            .iter()
            .map(|r| (r.service.clone(), r.table.clone(), pretty(&r.row)))
            .collect(),
        events: e
            .events
            .into_iter()
            .map(|ev| EventRow {
                deliveries: ev
                    .deliveries
                    .into_iter()
                    .map(|d| (d.consumer, d.state))
                    .collect(),
                source: ev.source,
                id: ev.id,
                event_type: ev.event_type,
                occurred_at: ev.occurred_at.format("%F %T%.3f UTC").to_string(),
                at: ev.at,
                attempts: ev.attempts,
                last_error: ev.last_error.unwrap_or_default(),
            })
            .collect(),
        provider: e
            .provider
            .iter()
            .map(|p| {
                let theirs = p.provider.as_ref().map_or_else(
                    || {
                        p.error
                            .clone()
                            .unwrap_or_else(|| "nothing under this key".into())
                    },
                    pretty,
                );
                (p.key.clone(), p.ours.clone(), theirs)
            })
            .collect(),
    })
}

/// What every action's form carries.
#[derive(Deserialize)]
pub struct Action {
    #[serde(default)]
    pub csrf: String,
}

/// The CSRF check every action makes first: `None` when the form came
/// from this console, else the refusal to send back.
pub(super) fn forged(console: &Console, csrf: &str) -> Option<Response> {
    (!console.auth.csrf_ok(csrf)).then(|| {
        refused(
            StatusCode::FORBIDDEN,
            "this form did not come from this console",
        )
    })
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

/// The 404 of a service the console has no database of.
pub(super) fn no_service(service: &str) -> Response {
    refused(StatusCode::NOT_FOUND, &format!("no service {service}"))
}

/// Post/redirect/get: back to `page`, which says what was done; a reload
/// does not act again.
pub(super) fn done(page: &str, said: &str) -> Response {
    Redirect::to(&format!("{page}?said={}", urlencode(said))).into_response()
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
