//! Refunds that ended failed: money a customer was promised and did not
//! get back, which only an operator can settle now (issue 43; the
//! runbook's "A payment or refund is stuck pending").

use reliability::Result;
use serde::Serialize;
use sqlx::PgPool;

/// Refunds that ended failed within a window, every tenant's.
#[derive(Debug, Clone, Default, Serialize, sqlx::FromRow)]
pub struct FailedRefunds {
    pub count: i64,
    /// Why the latest one failed, as the worker recorded it.
    pub latest_error: Option<String>,
    /// How long ago the latest one failed, in seconds.
    pub latest_seconds_ago: Option<f64>,
    /// How long ago the first one in the window failed, in seconds.
    pub first_seconds_ago: Option<f64>,
}

/// The refunds that ended failed in the last `window_secs`, read as
/// payments' owner role.
pub async fn failed_refunds(payments: &PgPool, window_secs: f64) -> Result<FailedRefunds> {
    Ok(sqlx::query_as(
        "SELECT count(*) AS count,
                (array_agg(last_error ORDER BY updated_at DESC))[1] AS latest_error,
                extract(epoch FROM now() - max(updated_at))::float8 AS latest_seconds_ago,
                extract(epoch FROM now() - min(updated_at))::float8 AS first_seconds_ago
         FROM refunds
         WHERE status = 'failed' AND updated_at > now() - make_interval(secs => $1)",
    )
    .bind(window_secs)
    .fetch_one(payments)
    .await?)
}
