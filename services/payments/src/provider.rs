//! The payment provider's HTTP API, as the worker sees it: every answer
//! sorted into done, refused (asking again will not help) or unknown (money
//! may have moved; ask again with the same key, or look the key up).

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

use reliability::trace::{Kind, Span};
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// A client of the provider. Cheap to clone: one connection pool.
#[derive(Clone)]
pub struct Psp {
    http: reqwest::Client,
    base_url: String,
}

/// What a provider call came to.
pub enum Reply<T> {
    Done(T),
    /// A 4xx: this request will not succeed as it is.
    Refused(String),
    /// Timeout, connection error, 5xx, unreadable 2xx: the outcome is unknown.
    Retry(String),
}

#[derive(Debug, Deserialize)]
pub(crate) struct ChargeReply {
    pub charge_id: String,
    pub status: String,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RefundReply {
    pub refund_id: String,
    #[serde(default = "succeeded")]
    pub status: String,
}

/// A charge as the provider's list shows it.
#[derive(Debug, Clone, Deserialize)]
pub struct ChargeRecord {
    pub key: String,
    pub charge_id: String,
    pub status: String,
    pub amount_cents: i64,
    #[serde(default)]
    pub refunded_cents: i64,
}

/// A refund as the provider's list shows it.
#[derive(Debug, Clone, Deserialize)]
pub struct RefundRecord {
    pub key: String,
    pub refund_id: String,
    pub status: String,
    pub amount_cents: i64,
}

#[derive(Debug, Deserialize)]
struct Page<T> {
    data: Vec<T>,
    has_more: bool,
}

fn succeeded() -> String {
    "succeeded".to_owned()
}

/// An item of a provider list: its idempotency key is its cursor.
pub trait HasKey {
    fn key(&self) -> &str;
}
impl HasKey for ChargeRecord {
    fn key(&self) -> &str {
        &self.key
    }
}
impl HasKey for RefundRecord {
    fn key(&self) -> &str {
        &self.key
    }
}

/// A charge's status as the saga needs it.
pub(crate) enum ChargeState {
    Captured(String),
    /// Final: no money moved (declined).
    Failed(String),
    /// Not final (pending, processing): not a failure.
    Open(String),
}

impl ChargeReply {
    pub fn state(self) -> ChargeState {
        match self.status.as_str() {
            "succeeded" => ChargeState::Captured(self.charge_id),
            "declined" | "failed" | "canceled" | "cancelled" => ChargeState::Failed(self.status),
            other => ChargeState::Open(format!("provider says {other}")),
        }
    }
}

/// The call as a client step of the worker's trace (the order's), if it has
/// one, and the `traceparent` (and `tracestate`) that carry it to the
/// provider.
fn call_step(method: &str, path: &str) -> (Option<Span>, reqwest::header::HeaderMap) {
    let mut headers = reqwest::header::HeaderMap::new();
    let step = Span::child(format!("{method} {path}"), Kind::Client);
    if let Some(step) = &step {
        let ctx = step.context();
        if let Ok(value) = ctx.to_header().parse() {
            headers.insert(reliability::trace::HEADER, value);
        }
        if let Some(Ok(value)) = ctx.state().map(str::parse) {
            headers.insert(reliability::trace::STATE_HEADER, value);
        }
    }
    (step, headers)
}

/// Ends a call's step: failed unless the provider answered with a result.
fn end_step<T>(step: Option<Span>, reply: &Reply<T>) {
    if let (Some(mut step), Reply::Refused(why) | Reply::Retry(why)) = (step, reply) {
        step.fail(why);
    }
}

impl Psp {
    pub fn new(base_url: &str, timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .expect("an HTTP client with a timeout");
        Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
        }
    }

    /// `POST path` with the idempotency key, the same on every try, and
    /// the instant after which the provider may book nothing for this
    /// request: the attempt's lease end, the fence against a worker that
    /// stalls before its call lands (docs/adr/0011).
    pub(crate) async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        key: &str,
        not_after: DateTime<Utc>,
        body: serde_json::Value,
    ) -> Reply<T> {
        let (step, headers) = call_step("POST", path);
        let sent = self
            .http
            .post(format!("{}{path}", self.base_url))
            .header("X-Idempotency-Key", key)
            .header(
                "X-Not-After",
                not_after.to_rfc3339_opts(SecondsFormat::Micros, true),
            )
            .headers(headers)
            .json(&body)
            .send()
            .await;
        let reply = Self::sort(sent).await;
        end_step(step, &reply);
        reply
    }

    /// What the provider holds under `key` at `path` (`/charges` or
    /// `/refunds`): `Done(None)` when it has nothing under that key, which
    /// is final: no money moved under it.
    pub async fn lookup<T: DeserializeOwned>(&self, path: &str, key: &str) -> Reply<Option<T>> {
        let (step, headers) = call_step("GET", path);
        let sent = self
            .http
            .get(format!("{}{path}/{key}", self.base_url))
            .headers(headers)
            .send()
            .await;
        if let Ok(resp) = &sent
            && resp.status() == reqwest::StatusCode::NOT_FOUND
        {
            return Reply::Done(None);
        }
        let reply = match Self::sort(sent).await {
            Reply::Done(t) => Reply::Done(Some(t)),
            Reply::Refused(e) => Reply::Refused(e),
            Reply::Retry(e) => Reply::Retry(e),
        };
        end_step(step, &reply);
        reply
    }

    /// Everything at `path` (`/charges` or `/refunds`) created from `since`
    /// on, page by page, as real providers' list APIs give it.
    pub async fn list<T: DeserializeOwned + HasKey>(
        &self,
        path: &str,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<T>, String> {
        let mut all: Vec<T> = Vec::new();
        loop {
            let mut query = vec![
                ("created_gte", since.to_rfc3339()),
                ("limit", "500".to_owned()),
            ];
            if let Some(last) = all.last() {
                query.push(("starting_after", last.key().to_owned()));
            }
            let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.base_url), &query)
                .map_err(|e| format!("list {path}: {e}"))?;
            let sent = self.http.get(url).send().await;
            let page: Page<T> = match Self::sort(sent).await {
                Reply::Done(page) => page,
                Reply::Refused(e) | Reply::Retry(e) => {
                    return Err(format!("the provider's list {path}: {e}"));
                }
            };
            // A page with nothing on it ends the list whatever `has_more`
            // says: the cursor would not move.
            if !page.has_more || page.data.is_empty() {
                all.extend(page.data);
                return Ok(all);
            }
            all.extend(page.data);
        }
    }

    async fn sort<T: DeserializeOwned>(sent: reqwest::Result<reqwest::Response>) -> Reply<T> {
        match sent {
            Err(e) => Reply::Retry(format!("provider unreachable: {e}")),
            Ok(resp) => {
                let status = resp.status();
                if status.is_success() {
                    match resp.json().await {
                        Ok(reply) => Reply::Done(reply),
                        Err(e) => Reply::Retry(format!("provider reply unreadable: {e}")),
                    }
                } else if status.is_server_error() || matches!(status.as_u16(), 408 | 425 | 429) {
                    Reply::Retry(format!("provider answered {status}"))
                } else {
                    // The provider's reason, where its body names one: a
                    // refusal's rule may depend on it (`refused_because`).
                    let code = resp
                        .json::<serde_json::Value>()
                        .await
                        .ok()
                        .and_then(|b| b["error"]["code"].as_str().map(str::to_owned));
                    match code {
                        Some(code) => {
                            Reply::Refused(format!("provider answered {status} ({code})"))
                        }
                        None => Reply::Refused(format!("provider answered {status}")),
                    }
                }
            }
        }
    }
}

/// The provider's refusal of a request that arrived past its
/// `X-Not-After`: nothing was done, and the same key may be sent again.
pub(crate) const EXPIRED: &str = "request_expired";

/// Whether a refusal's text (from [`Reply::Refused`]) names the provider's
/// reason `code`.
pub fn refused_because(refusal: &str, code: &str) -> bool {
    refusal.ends_with(&format!("({code})"))
}
