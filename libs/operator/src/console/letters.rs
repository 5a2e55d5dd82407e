//! Each consumer's dead letters, grouped by the handler's error its
//! consumer recorded (`ops::dead_letters`): re-drive a group, one letter,
//! or a whole queue, after the fix. The others keep their order.

use std::collections::BTreeSet;
use std::sync::Arc;

use askama::Template;
use axum::extract::{Form, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

use super::Console;
use super::pages::{Said, done, forged, html, refused};
use crate::ops::dead_letters;

struct GroupRow {
    class: String,
    cause: String,
    count: usize,
    event_types: String,
    since: String,
    /// The group's message ids, comma-separated: what its button re-drives.
    ids: String,
    letters: Vec<(String, String, String)>,
}

struct Queue {
    consumer: String,
    groups: Vec<GroupRow>,
    error: String,
}

#[derive(Template)]
#[template(path = "letters.html")]
struct LettersPage {
    title: &'static str,
    said: Option<String>,
    queues: Vec<Queue>,
    csrf: String,
    read_only: bool,
}

fn row(g: dead_letters::Group) -> GroupRow {
    let types: BTreeSet<&str> = g.letters.iter().map(|l| l.event_type.as_str()).collect();
    let since = g.letters.iter().filter_map(|l| l.dead_lettered_at).min();
    GroupRow {
        event_types: types.into_iter().collect::<Vec<_>>().join(", "),
        since: since.map_or_else(|| "—".into(), |t| t.format("%F %T UTC").to_string()),
        count: g.letters.len(),
        ids: g
            .letters
            .iter()
            .map(|l| l.message_id.as_str())
            .collect::<Vec<_>>()
            .join(","),
        letters: g
            .letters
            .into_iter()
            .map(|l| {
                let tenant = l.tenant_id.map_or_else(|| "—".into(), |t| t.to_string());
                (l.message_id, l.event_type, tenant)
            })
            .collect(),
        class: g.class,
        cause: g.cause,
    }
}

pub async fn list(State(console): State<Arc<Console>>, Query(q): Query<Said>) -> Response {
    let mut queues = Vec::new();
    for sub in console.estate.subscriptions {
        let (groups, error) = match dead_letters::grouped(&console.estate, sub.consumer).await {
            Ok(groups) => (groups.into_iter().map(row).collect(), String::new()),
            Err(e) => (Vec::new(), format!("{e:#}")),
        };
        if !groups.is_empty() || !error.is_empty() {
            queues.push(Queue {
                consumer: sub.consumer.to_owned(),
                groups,
                error,
            });
        }
    }
    html(&LettersPage {
        title: "Dead letters",
        said: q.said,
        queues,
        csrf: console.auth.csrf(),
        read_only: console.read_only,
    })
}

#[derive(Deserialize)]
pub struct Redrive {
    consumer: String,
    /// Message ids, comma-separated; empty: the whole queue.
    #[serde(default)]
    ids: String,
    #[serde(default)]
    csrf: String,
}

pub async fn redrive(State(console): State<Arc<Console>>, Form(r): Form<Redrive>) -> Response {
    if let Some(refusal) = forged(&console, &r.csrf) {
        return refusal;
    }
    let known = console
        .estate
        .subscriptions
        .iter()
        .any(|s| s.consumer == r.consumer);
    if !known {
        return refused(
            StatusCode::NOT_FOUND,
            &format!("no consumer {}", r.consumer),
        );
    }
    let ids: Vec<String> = r
        .ids
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let asked = (!ids.is_empty()).then_some(ids.len());
    match dead_letters::redrive(&console.estate, &r.consumer, asked.map(|_| ids)).await {
        Ok(0) => refused(
            StatusCode::CONFLICT,
            &format!(
                "nothing moved: those letters have left {}'s DLQ (re-driven by someone else?)",
                r.consumer
            ),
        ),
        Ok(moved) => {
            let of = asked.filter(|&n| n > moved).map_or_else(String::new, |n| {
                format!(" of {n} (the others had left the DLQ)")
            });
            done(
                "/dead-letters",
                &format!("{moved}{of} letter(s) back on {}'s queue", r.consumer),
            )
        }
        Err(e) => refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

#[derive(Deserialize)]
pub struct Which {
    consumer: String,
    id: String,
    #[serde(default)]
    csrf: String,
}

#[derive(Template)]
#[template(path = "drop.html")]
struct DropPage {
    title: &'static str,
    consumer: String,
    id: String,
    event_type: String,
    reason: String,
    body: String,
    csrf: String,
}

/// The page that asks before a letter is dropped: the letter itself.
pub async fn ask_drop(State(console): State<Arc<Console>>, Query(w): Query<Which>) -> Response {
    match dead_letters::letter(&console.estate, &w.consumer, &w.id).await {
        Ok(Some(letter)) => html(&DropPage {
            title: "Drop a dead letter for good?",
            event_type: letter.event_type.unwrap_or_default(),
            reason: letter.reason.unwrap_or_default(),
            body: letter.body,
            csrf: console.auth.csrf(),
            consumer: w.consumer,
            id: w.id,
        }),
        Ok(None) => gone(&w),
        Err(e) => refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

fn gone(w: &Which) -> Response {
    let why = format!(
        "{} is not in {}'s DLQ (any more): re-driven or dropped meanwhile",
        w.id, w.consumer
    );
    refused(StatusCode::CONFLICT, &why)
}

/// Drops the letter the operator was shown, never to be applied.
pub async fn drop(State(console): State<Arc<Console>>, Form(w): Form<Which>) -> Response {
    if let Some(refusal) = forged(&console, &w.csrf) {
        return refusal;
    }
    match dead_letters::drop(&console.estate, &w.consumer, &w.id).await {
        Ok(0) => gone(&w),
        Ok(_) => done(
            "/dead-letters",
            &format!("{} dropped from {}'s DLQ, never applied", w.id, w.consumer),
        ),
        Err(e) => refused(StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}
