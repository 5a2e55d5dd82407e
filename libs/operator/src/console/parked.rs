//! Parked aggregates (docs/adr/0028) in every service's database: why, the
//! first event, how many wait; unpark (the consumer replays them in order
//! through its fixed handler, then resumes), or skip the first event, the
//! one shown, after a page that asks.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Form, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::Utc;
use reliability::consumer::{self, ParkedAggregate};
use serde::Deserialize;

use super::Console;
use super::pages::{Said, done, forged, html, no_service, or_dash, refused};

/// One parked aggregate, named as every form of this page names it.
#[derive(Deserialize, Clone)]
pub struct Which {
    service: String,
    consumer: String,
    tenant: i64,
    aggregate_type: String,
    aggregate_id: String,
}

struct Row {
    which: Which,
    error: String,
    parked_for: String,
    waiting: i64,
    first: String,
    first_message_id: i64,
    release_requested: bool,
}

#[derive(Template)]
#[template(path = "parked.html")]
struct ParkedPage {
    title: &'static str,
    said: Option<String>,
    rows: Vec<Row>,
    errors: Vec<String>,
    csrf: String,
    read_only: bool,
}

fn age(seconds: i64) -> String {
    match seconds {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s => format!("{} h", s / 3600),
    }
}

pub async fn list(State(console): State<Arc<Console>>, Query(q): Query<Said>) -> Response {
    let (mut rows, mut errors) = (Vec::new(), Vec::new());
    for (service, pool) in &console.estate.databases {
        match consumer::parked(pool, None).await {
            Ok(parked) => rows.extend(parked.into_iter().map(|p| row(service, p))),
            Err(e) => errors.push(format!("{service}: {e}")),
        }
    }
    html(&ParkedPage {
        title: "Parked aggregates",
        said: q.said,
        rows,
        errors,
        csrf: console.auth.csrf(),
        read_only: console.read_only,
    })
}

fn row(service: &str, p: ParkedAggregate) -> Row {
    Row {
        parked_for: age((Utc::now() - p.parked_at).num_seconds()),
        first: format!(
            "{} (number {}, message {})",
            p.first_event_type.unwrap_or_default(),
            or_dash(p.first_seq),
            or_dash(p.first_message_id)
        ),
        first_message_id: p.first_message_id.unwrap_or_default(),
        waiting: p.waiting,
        error: p.error,
        release_requested: p.release_requested,
        which: Which {
            service: service.to_owned(),
            consumer: p.consumer,
            tenant: p.tenant_id,
            aggregate_type: p.aggregate_type,
            aggregate_id: p.aggregate_id,
        },
    }
}

/// The aggregate as it stands now in `pool`, if it is parked there.
async fn find(pool: &sqlx::PgPool, w: &Which) -> Result<Option<ParkedAggregate>, Response> {
    let parked = consumer::parked(pool, Some(&w.consumer))
        .await
        .map_err(|e| refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")))?;
    Ok(parked.into_iter().find(|p| {
        p.tenant_id == w.tenant
            && p.aggregate_type == w.aggregate_type
            && p.aggregate_id == w.aggregate_id
    }))
}

fn gone(w: &Which) -> Response {
    let why = format!(
        "{}:{} of tenant {} is not parked in {} (any more): unparked or skipped meanwhile",
        w.aggregate_type, w.aggregate_id, w.tenant, w.consumer
    );
    refused(StatusCode::CONFLICT, &why)
}

/// An action's form: the aggregate (fields, not a flattened `Which`: a
/// URL-encoded form cannot fill a flattened number), its CSRF token, and
/// for a skip the message shown.
#[derive(Deserialize)]
pub struct Act {
    service: String,
    consumer: String,
    tenant: i64,
    aggregate_type: String,
    aggregate_id: String,
    #[serde(default)]
    csrf: String,
    message_id: Option<i64>,
}

impl Act {
    fn which(&self) -> Which {
        Which {
            service: self.service.clone(),
            consumer: self.consumer.clone(),
            tenant: self.tenant,
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
        }
    }
}

/// Asks the consumer to replay the aggregate's parked events in order.
pub async fn unpark(State(console): State<Arc<Console>>, Form(act): Form<Act>) -> Response {
    if let Some(refusal) = forged(&console, &act.csrf) {
        return refusal;
    }
    let w = &act.which();
    let Some(pool) = console.estate.database(&w.service) else {
        return no_service(&w.service);
    };
    let parked = match find(pool, w).await {
        Ok(Some(p)) => p,
        Ok(None) => return gone(w),
        Err(refusal) => return refusal,
    };
    if parked.release_requested {
        let why = "an unpark of it is under way: the consumer replays its events within seconds";
        return refused(StatusCode::CONFLICT, why);
    }
    match consumer::unpark(
        pool,
        &w.consumer,
        w.tenant,
        &w.aggregate_type,
        &w.aggregate_id,
    )
    .await
    {
        Ok(true) => done(
            "/parked",
            &format!(
                "{}:{} of tenant {}: {} event(s) to replay in order through {}",
                w.aggregate_type, w.aggregate_id, w.tenant, parked.waiting, w.consumer
            ),
        ),
        Ok(false) => gone(w),
        Err(e) => refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

#[derive(Template)]
#[template(path = "skip.html")]
struct SkipPage {
    title: &'static str,
    which: Which,
    message_id: i64,
    event_type: String,
    seq: String,
    envelope: String,
    csrf: String,
}

/// The page that asks before a skip: the event that would be dropped.
pub async fn ask_skip(State(console): State<Arc<Console>>, Query(w): Query<Which>) -> Response {
    let Some(pool) = console.estate.database(&w.service) else {
        return no_service(&w.service);
    };
    let first = consumer::first_parked(
        pool,
        &w.consumer,
        w.tenant,
        &w.aggregate_type,
        &w.aggregate_id,
    );
    match first.await {
        Ok(Some(event)) => html(&SkipPage {
            title: "Drop a parked event for good?",
            message_id: event.message_id,
            event_type: event.event_type,
            seq: or_dash(event.aggregate_seq),
            envelope: serde_json::to_string_pretty(&event.envelope).unwrap_or_default(),
            csrf: console.auth.csrf(),
            which: w,
        }),
        Ok(None) => gone(&w),
        Err(e) => refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

/// Drops the event the operator was shown, if it is still the first.
pub async fn skip(State(console): State<Arc<Console>>, Form(act): Form<Act>) -> Response {
    if let Some(refusal) = forged(&console, &act.csrf) {
        return refusal;
    }
    let w = &act.which();
    let Some(message_id) = act.message_id else {
        return refused(StatusCode::BAD_REQUEST, "a skip names the message it drops");
    };
    let Some(pool) = console.estate.database(&w.service) else {
        return no_service(&w.service);
    };
    let skipped = consumer::skip(
        pool,
        &w.consumer,
        w.tenant,
        &w.aggregate_type,
        &w.aggregate_id,
        message_id,
    );
    match skipped.await {
        Ok(Some(event)) => done(
            "/parked",
            &format!(
                "message {message_id} ({}) of {}:{} dropped, never applied",
                event.event_type, w.aggregate_type, w.aggregate_id
            ),
        ),
        Ok(None) => refused(
            StatusCode::CONFLICT,
            &format!(
                "message {message_id} is no longer the first parked event (replayed or skipped meanwhile): nothing dropped"
            ),
        ),
        Err(e) => refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}
