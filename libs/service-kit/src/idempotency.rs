//! `Idempotency-Key` for axum handlers (invariant I3).
//!
//! [`Idempotent<T>`] is an extractor. Before the handler runs it verifies the
//! caller, validates the key, hashes the canonical body (RFC 8785, SHA-256)
//! and claims `(tenant, scope, key)` by inserting its row in a transaction
//! that it hands to the handler's work in [`Idempotent::answer`]. The work
//! returns its result; `answer` turns it into the response and stores that
//! in the same commit. So:
//!
//! - a concurrent request with the same key waits for its twin, at most
//!   [`IdempotencyConfig::wait`], then replays the stored response or
//!   answers 425 with `Retry-After`. Twins in one process wait without a
//!   database connection (only one of them holds one, blocked on the row
//!   under PostgreSQL's `lock_timeout`), and the wait is well below the
//!   pool's acquire timeout: a burst of one key cannot starve others;
//! - over the tenant's rate limit ([`crate::rate_limit`]): 429 with
//!   `Retry-After` before anything is claimed or run;
//! - the database down: 503 with `Retry-After`; nothing was claimed;
//! - a crash or a 5xx rolls the claim back with everything else: no stuck key;
//! - a 4xx is stored (the handler's writes rolled back to a savepoint first);
//! - the same key with a different body: 409 (docs/adr/0004 maps these to
//!   the IETF draft).
//!
//! The scope is the method and matched route (`POST /orders`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::Notify;

use crate::http::ApiError;
use crate::rate_limit::RateLimiter;
use reliability::{Result, TenantId, TenantTx};

mod claim;
mod extract;
mod keys;

pub use extract::request_hash;
pub use keys::{KeyRecord, lookup};

pub const HEADER: &str = "idempotency-key";
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
const SAVEPOINT: &str = "SAVEPOINT idempotent_handler";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idempotent_handler";

/// Shared by every idempotent route of a service (put it in the app state).
#[derive(Debug, Clone)]
pub struct IdempotencyConfig {
    /// The runtime role's pool.
    pub pool: PgPool,
    /// How long a request waits for an in-flight twin before answering
    /// 425. Keep it well below the pool's acquire timeout (5 s).
    pub wait: Duration,
    /// How long a completed key is remembered.
    pub ttl: Duration,
    /// Per-tenant admission of the writes (unlimited unless set).
    pub rate_limit: RateLimiter,
    /// Keys being handled in this process, so that their twins wait here
    /// rather than on a pooled connection.
    in_flight: Arc<Mutex<HashMap<KeyId, Arc<Notify>>>>,
}

type KeyId = (TenantId, String, String);

impl IdempotencyConfig {
    /// Waits 1 s for an in-flight twin; remembers keys 24 h; no rate limit.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            wait: Duration::from_secs(1),
            ttl: Duration::from_secs(24 * 3600),
            rate_limit: RateLimiter::unlimited(),
            in_flight: Arc::default(),
        }
    }

    /// Marks `id` in flight here, or waits (up to `wait`, holding no
    /// connection) for the twin that is. `None`: the twin is still running.
    async fn enter(&self, id: KeyId) -> Option<InFlight> {
        let deadline = tokio::time::Instant::now() + self.wait;
        loop {
            let notify = {
                let mut map = self
                    .in_flight
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match map.get(&id) {
                    Some(n) => n.clone(),
                    None => {
                        map.insert(id.clone(), Arc::new(Notify::new()));
                        return Some(InFlight {
                            map: self.in_flight.clone(),
                            id,
                        });
                    }
                }
            };
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // The twin may have left between the look-up and `enable`.
            if !self
                .in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(&id)
                .is_some_and(|n| Arc::ptr_eq(n, &notify))
            {
                continue;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

/// A key this process is handling; its twins here wake when it is dropped.
struct InFlight {
    map: Arc<Mutex<HashMap<KeyId, Arc<Notify>>>>,
    id: KeyId,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut map = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(notify) = map.remove(&self.id) {
            notify.notify_waiters();
        }
    }
}

/// A claimed key, the request body, and the transaction to do the work in.
///
/// The transaction is reachable only inside [`Idempotent::answer`], which
/// commits the work only with its stored answer: a handler cannot commit
/// around the key, or leave it claimed without an answer.
///
/// ```compile_fail
/// async fn handler(req: reliability::idempotency::Idempotent<()>) {
///     req.tx.commit().await.unwrap(); // private: commit only with a stored response
/// }
/// ```
pub struct Idempotent<T> {
    pub body: T,
    tx: TenantTx,
    scope: String,
    key: String,
    _in_flight: InFlight,
}

impl<T> Idempotent<T> {
    pub fn tenant(&self) -> TenantId {
        self.tx.tenant()
    }

    /// Runs the handler's `work` in the claimed transaction and answers for
    /// it; the policy is here, not in each handler:
    ///
    /// - `Ok(body)`: `status` with `body`, stored with the key and committed
    ///   with the work;
    /// - `Err(e)` that maps to a 4xx: stored, so the same request gets it
    ///   again, without the work (rolled back to a savepoint first);
    /// - `Err(e)` that maps to a 5xx, or a failure to store the answer:
    ///   everything rolls back and no key is kept, so a retry runs afresh.
    pub async fn answer<R, E>(
        self,
        status: StatusCode,
        work: impl AsyncFnOnce(&T, &mut TenantTx) -> Result<R, E>,
    ) -> Response
    where
        R: Serialize,
        E: Into<ApiError>,
    {
        let Self {
            body,
            mut tx,
            scope,
            key,
            _in_flight,
        } = self;
        let (status, bytes, retry_after) = match work(&body, &mut tx).await {
            Ok(answer) => match serde_json::to_vec(&answer) {
                Ok(bytes) => (status, bytes, None),
                Err(e) => return ApiError::failure(&e.into()).into_response(),
            },
            Err(e) => {
                let error: ApiError = e.into();
                let bytes = serde_json::to_vec(&error.body()).expect("an error body serializes");
                (error.status, bytes, error.retry_after)
            }
        };
        if status.is_server_error() {
            // Claim and work alike, before the answer goes out: a twin
            // blocked on the key row runs afresh at once. (If the database
            // is gone, dropping the transaction rolls it back the same.)
            let _ = tx.rollback().await;
            let mut response = json_response(status, bytes);
            if let Some(secs) = retry_after {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            }
            return response;
        }
        match store(tx, &scope, &key, status, &bytes).await {
            Ok(()) => json_response(status, bytes),
            Err(e) => ApiError::failure(&e).into_response(),
        }
    }
}

/// Stores the answer with the key and commits (a 4xx without the work).
async fn store(
    mut tx: TenantTx,
    scope: &str,
    key: &str,
    status: StatusCode,
    bytes: &[u8],
) -> Result<()> {
    if status.is_client_error() {
        sqlx::query(ROLLBACK_TO_SAVEPOINT).execute(&mut *tx).await?;
    }
    sqlx::query(
        "UPDATE idempotency_keys
         SET response_status = $4, response_content_type = 'application/json',
             response_body = $5, completed_at = now()
         WHERE tenant_id = $1 AND scope = $2 AND key = $3",
    )
    .bind(tx.tenant().get())
    .bind(scope)
    .bind(key)
    .bind(status.as_u16() as i16)
    .bind(bytes)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}
