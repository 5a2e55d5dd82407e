//! Claiming a key: the first request runs, a finished one is answered from
//! the stored response, one in flight is waited for (or told to retry).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::http::ApiError;
use reliability::{Result, TenantId, TenantTx};

use super::{IdempotencyConfig, REPLAYED_HEADER, SAVEPOINT};

#[derive(sqlx::FromRow)]
struct Stored {
    request_hash: Vec<u8>,
    response_status: Option<i16>,
    response_content_type: Option<String>,
    response_body: Option<Vec<u8>>,
}

/// What the key's row says; only `Fresh` lets the handler run.
pub(super) enum Claim {
    Fresh(TenantTx),
    Replayed(Response),
    /// The same key with another body: 409.
    Conflict(Response),
    /// A twin holds the key past the wait: 425.
    InFlight,
}

pub(super) async fn claim(
    config: &IdempotencyConfig,
    tenant: TenantId,
    scope: &str,
    key: &str,
    hash: &[u8],
) -> Result<Claim> {
    let mut tx = TenantTx::begin(&config.pool, tenant).await?;
    // Bounds the wait on an in-flight twin's uncommitted row.
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(format!("{}ms", config.wait.as_millis().max(1)))
        .execute(&mut *tx)
        .await?;
    // An expired row is taken over as if absent; a live one is left alone.
    let claimed = sqlx::query_scalar::<_, bool>(
        "INSERT INTO idempotency_keys (tenant_id, scope, key, request_hash, expires_at)
         VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5))
         ON CONFLICT (tenant_id, scope, key) DO UPDATE
         SET request_hash = EXCLUDED.request_hash, expires_at = EXCLUDED.expires_at, created_at = now(),
             response_status = NULL, response_content_type = NULL, response_body = NULL, completed_at = NULL
         WHERE idempotency_keys.expires_at <= now()
         RETURNING true",
    )
    .bind(tenant.get())
    .bind(scope)
    .bind(key)
    .bind(hash)
    .bind(config.ttl.as_secs_f64())
    .fetch_optional(&mut *tx)
    .await;
    match claimed {
        Ok(Some(_)) => {
            // Back to the role's bound (db::ROLE_BOUNDS) for the handler.
            sqlx::query("SET LOCAL lock_timeout TO DEFAULT")
                .execute(&mut *tx)
                .await?;
            sqlx::query(SAVEPOINT).execute(&mut *tx).await?;
            return Ok(Claim::Fresh(tx));
        }
        Ok(None) => {}
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
            return Ok(Claim::InFlight);
        }
        Err(e) => return Err(e.into()),
    }
    let stored: Option<Stored> = sqlx::query_as(
        "SELECT request_hash, response_status, response_content_type, response_body
         FROM idempotency_keys WHERE tenant_id = $1 AND scope = $2 AND key = $3",
    )
    .bind(tenant.get())
    .bind(scope)
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    tx.rollback().await?;
    Ok(match stored {
        Some(stored) if stored.request_hash != hash => Claim::Conflict(
            ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_reused",
                "this Idempotency-Key was used with a different request body",
            )
            .into_response(),
        ),
        Some(Stored {
            response_status: Some(status),
            response_content_type: content_type,
            response_body: Some(body),
            ..
        }) => {
            let status = StatusCode::from_u16(status as u16).unwrap_or(StatusCode::OK);
            let content_type = content_type.unwrap_or_else(|| "application/json".to_owned());
            let mut response = (status, body).into_response();
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_str(&content_type)
                    .unwrap_or(HeaderValue::from_static("application/json")),
            );
            headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
            Claim::Replayed(response)
        }
        // Deleted by the cleanup between our insert and read: try again.
        _ => Claim::InFlight,
    })
}

pub(super) fn still_in_flight() -> Response {
    ApiError::new(
        StatusCode::TOO_EARLY,
        "idempotency_key_in_flight",
        "a request with this Idempotency-Key is still being processed; retry later",
    )
    .with_retry_after(1)
    .into_response()
}
