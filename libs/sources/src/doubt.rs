//! Payments and refunds in doubt: a request may have reached the provider
//! and nobody knows what it did (docs/adr/0011). The worker settles each by
//! a look-up under its key; one that stays in doubt is money an operator
//! should look at (issue 45: the console's overview).

use reliability::Result;
use serde::Serialize;
use sqlx::PgPool;

/// Pending payments and refunds whose latest request's outcome is unknown,
/// every tenant's.
#[derive(Debug, Clone, Default, Serialize, sqlx::FromRow)]
pub struct InDoubt {
    pub payments: i64,
    pub refunds: i64,
    /// How long ago the oldest request still in doubt was sent, in seconds.
    pub oldest_seconds_ago: Option<f64>,
}

/// The payments and refunds in doubt now, read as payments' owner role.
pub async fn in_doubt(payments: &PgPool) -> Result<InDoubt> {
    Ok(sqlx::query_as(
        "WITH doubt AS (
           SELECT 'payment' AS kind, doubt_sent_at FROM payments WHERE status = 'pending' AND outcome_unknown
           UNION ALL
           SELECT 'refund', doubt_sent_at FROM refunds WHERE status = 'pending' AND outcome_unknown)
         SELECT count(*) FILTER (WHERE kind = 'payment') AS payments,
                count(*) FILTER (WHERE kind = 'refund') AS refunds,
                extract(epoch FROM now() - min(doubt_sent_at))::float8 AS oldest_seconds_ago
         FROM doubt",
    )
    .fetch_one(payments)
    .await?)
}
