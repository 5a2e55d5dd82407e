//! Stored keys as operators look them up (`reliability idempotency key`).

use sqlx::PgPool;

use reliability::{Result, TenantId};

/// A stored key as an operator sees it (a tenant reporting a duplicate).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct KeyRecord {
    pub tenant_id: i64,
    pub scope: String,
    pub key: String,
    pub request_hash: String,
    pub response_status: Option<i16>,
    pub response_body: Option<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub completed_at: Option<chrono::DateTime<chrono::Utc>>,
    pub expires_at: chrono::DateTime<chrono::Utc>,
}

/// The records of `key` for `tenant` in every scope (as the owner role).
pub async fn lookup(owner: &PgPool, tenant: TenantId, key: &str) -> Result<Vec<KeyRecord>> {
    Ok(sqlx::query_as(
        "SELECT tenant_id, scope, key, encode(request_hash, 'hex') AS request_hash, response_status,
                convert_from(response_body, 'UTF8') AS response_body, created_at, completed_at, expires_at
         FROM idempotency_keys WHERE tenant_id = $1 AND key = $2 ORDER BY scope",
    )
    .bind(tenant.get())
    .bind(key)
    .fetch_all(owner)
    .await?)
}
