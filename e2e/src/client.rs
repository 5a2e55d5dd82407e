//! The stack's client, as `make e2e` and `make bench` drive it: tokens of
//! the run's secret, and posts that retry like a real client's (the same
//! Idempotency-Key until an answer that is not a 5xx or a timeout).

use std::time::{Duration, Instant};

use reliability::TenantId;
use serde_json::{Value, json};
use service_kit::auth::JwtKeys;

use crate::cluster::{Layout, SECRET};

/// A client of the stack that retries like a real one.
pub struct Client {
    pub http: reqwest::Client,
    pub jwt: JwtKeys,
    orders: String,
    inventory: String,
    pub payments: String,
    /// Answers 500 and 503 seen by `post`: a dependency outage must be
    /// the one, never the other.
    pub answered_500: std::sync::atomic::AtomicU64,
    pub answered_503: std::sync::atomic::AtomicU64,
    /// Answers 429 seen by `post`: refusals by admission or rate limits.
    pub answered_429: std::sync::atomic::AtomicU64,
}

impl Client {
    pub fn new(layout: &Layout) -> anyhow::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
            jwt: JwtKeys::from_secret(SECRET.as_bytes()),
            orders: layout.url("orders"),
            inventory: layout.url("inventory"),
            payments: layout.url("payments"),
            answered_500: Default::default(),
            answered_503: Default::default(),
            answered_429: Default::default(),
        })
    }

    pub fn token(&self, tenant: i64) -> String {
        self.jwt.mint(
            TenantId::new(tenant).expect("positive"),
            Duration::from_secs(3600),
        )
    }

    /// POSTs with the same key until the answer is known (a client that
    /// retries timeouts, resets, 5xx, 425 and 429, the last two after their
    /// `Retry-After`, at most 1 s here): the operation's outcome.
    pub async fn post(
        &self,
        tenant: i64,
        url: &str,
        key: &str,
        body: &Value,
    ) -> anyhow::Result<(u16, Value)> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let sent = self
                .http
                .post(url)
                .bearer_auth(self.token(tenant))
                .header("Idempotency-Key", key)
                .json(body)
                .send()
                .await;
            if let Ok(resp) = sent {
                let status = resp.status().as_u16();
                let counter = match status {
                    500 => Some(&self.answered_500),
                    503 => Some(&self.answered_503),
                    429 => Some(&self.answered_429),
                    _ => None,
                };
                if let Some(c) = counter {
                    c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                if status < 500 && status != 425 && status != 429 {
                    return Ok((status, resp.json().await.unwrap_or(Value::Null)));
                }
                let wait = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                    .map_or(Duration::ZERO, |s| {
                        Duration::from_secs(s).min(Duration::from_secs(1))
                    });
                tokio::time::sleep(wait).await;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{url} with key {key} never answered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One stock adjustment of `delta` under the Idempotency-Key `key`.
    pub async fn adjust(
        &self,
        tenant: i64,
        sku: &str,
        delta: i64,
        key: &str,
    ) -> anyhow::Result<()> {
        let body = json!({"sku": sku, "delta": delta, "reason": "e2e"});
        let url = format!("{}/stock/adjustments", self.inventory);
        let (status, body) = self.post(tenant, &url, key, &body).await?;
        anyhow::ensure!(status == 201, "adjust {sku}: {status} {body}");
        Ok(())
    }

    pub async fn stock(&self, tenant: i64, sku: &str, units: i64) -> anyhow::Result<()> {
        let body = json!({"sku": sku, "delta": units, "reason": "e2e"});
        let url = format!("{}/stock/adjustments", self.inventory);
        let (status, body) = self
            .post(tenant, &url, &format!("stock-{tenant}-{sku}"), &body)
            .await?;
        anyhow::ensure!(status == 201, "stock: {status} {body}");
        Ok(())
    }

    pub async fn order(
        &self,
        tenant: i64,
        key: &str,
        customer: &str,
        sku: &str,
        quantity: i64,
    ) -> anyhow::Result<i64> {
        let body = json!({"customer_id": customer, "currency": "EUR", "lines": [{"sku": sku, "quantity": quantity, "unit_price_cents": 1250}]});
        let url = format!("{}/orders", self.orders);
        let (status, body) = self.post(tenant, &url, key, &body).await?;
        anyhow::ensure!(status == 201, "order: {status} {body}");
        body["order_id"]
            .as_i64()
            .ok_or_else(|| anyhow::anyhow!("no order id in {body}"))
    }

    /// `n` orders of one unit of `SKU-{tenant}` each, 16 at a time; about
    /// one in ten declined by the provider.
    pub async fn orders(&self, tenant: i64, n: usize) -> anyhow::Result<Vec<i64>> {
        self.orders_from(tenant, 0, n).await
    }

    /// Orders `first..first + n` of the tenant (their keys), 16 at a time.
    pub async fn orders_from(
        &self,
        tenant: i64,
        first: usize,
        n: usize,
    ) -> anyhow::Result<Vec<i64>> {
        use futures_util::StreamExt;
        let sku = format!("SKU-{tenant}");
        let all: Vec<_> = futures_util::stream::iter((first..first + n).map(|i| {
            let customer = if i % 10 == 9 {
                format!("decline-{i}")
            } else {
                format!("c-{i}")
            };
            let key = format!("order-{tenant}-{i}");
            let sku = sku.clone();
            async move { self.order(tenant, &key, &customer, &sku, 1).await }
        }))
        .buffered(16)
        .collect()
        .await;
        all.into_iter().collect()
    }

    /// A steady load: `per_second` orders each second until `done` is set,
    /// then one round more. It lasts as long as a fault takes, however fast
    /// the machine; paced, so that what waits out the fault stays a backlog
    /// the stack drains within the checker's deadline. Returns how many were
    /// placed.
    pub async fn orders_until(
        &self,
        tenant: i64,
        per_second: usize,
        done: &std::sync::atomic::AtomicBool,
    ) -> anyhow::Result<usize> {
        let mut placed = 0;
        loop {
            let round = Instant::now();
            let last = done.load(std::sync::atomic::Ordering::Acquire);
            placed += self.orders_from(tenant, placed, per_second).await?.len();
            if last {
                return Ok(placed);
            }
            tokio::time::sleep(Duration::from_secs(1).saturating_sub(round.elapsed())).await;
        }
    }
}
