//! The payment provider's HTTP API, as the worker sees it: every answer
//! sorted into done, refused (asking again will not help) or unknown (money
//! may have moved; ask again with the same key, or look the key up).

use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;

/// A client of the provider. Cheap to clone: one connection pool.
#[derive(Clone)]
pub struct Psp {
    http: reqwest::Client,
    base_url: String,
}

/// What a provider call came to.
pub(crate) enum Reply<T> {
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

fn succeeded() -> String {
    "succeeded".to_owned()
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

/// The payment's trace carried to the provider: a `traceparent` for a new
/// span of the worker's current trace (the order's), if it has one.
fn trace_headers() -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(ctx) = reliability::trace::current()
        && let Ok(value) = ctx.child().to_header().parse()
    {
        headers.insert(reliability::trace::HEADER, value);
    }
    headers
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

    /// `POST path` with the idempotency key; the same key on every try.
    pub(crate) async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        key: &str,
        body: serde_json::Value,
    ) -> Reply<T> {
        let sent = self
            .http
            .post(format!("{}{path}", self.base_url))
            .header("X-Idempotency-Key", key)
            .headers(trace_headers())
            .json(&body)
            .send()
            .await;
        Self::sort(sent).await
    }

    /// What the provider holds under `key` at `path` (`/charges` or
    /// `/refunds`): `Done(None)` when it has nothing under that key, which
    /// is final: no money moved under it.
    pub(crate) async fn lookup<T: DeserializeOwned>(
        &self,
        path: &str,
        key: &str,
    ) -> Reply<Option<T>> {
        let sent = self
            .http
            .get(format!("{}{path}/{key}", self.base_url))
            .headers(trace_headers())
            .send()
            .await;
        if let Ok(resp) = &sent
            && resp.status() == reqwest::StatusCode::NOT_FOUND
        {
            return Reply::Done(None);
        }
        match Self::sort(sent).await {
            Reply::Done(t) => Reply::Done(Some(t)),
            Reply::Refused(e) => Reply::Refused(e),
            Reply::Retry(e) => Reply::Retry(e),
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
                    Reply::Refused(format!("provider answered {status}"))
                }
            }
        }
    }
}
