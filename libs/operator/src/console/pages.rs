//! What the console's pages share: rendering, refusals, the CSRF check
//! and the redirect after an action. Each page reads through `crate::ops`,
//! as the CLI does, and renders one template.

use std::fmt::Display;

use askama::Template;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use serde::Deserialize;

use super::Console;

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

/// What an action said it did, shown on the page it redirects to.
#[derive(Deserialize)]
pub struct Said {
    pub said: Option<String>,
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
