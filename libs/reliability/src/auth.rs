//! Who is calling: `Authorization: Bearer <JWT>` (HS256) with an integer
//! `tenant_id` claim and `exp`. The tenant comes from the verified token
//! only; a client never names it in a header or a body.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{FromRef, FromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::TenantId;
use crate::http::ApiError;

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    tenant_id: i64,
    exp: u64,
}

/// Signing and verification keys from the stack's secret. Its `Debug` does
/// not print the secret.
#[derive(Clone)]
pub struct JwtKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
}

impl fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JwtKeys { .. }")
    }
}

impl JwtKeys {
    pub fn from_secret(secret: &[u8]) -> Self {
        let mut validation = Validation::new(Algorithm::HS256);
        // "Expired" means expired: the stack's clocks are one machine's.
        validation.leeway = 0;
        validation.set_required_spec_claims(&["exp"]);
        Self {
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
            validation,
        }
    }

    /// A token for `tenant`, valid for `ttl`.
    pub fn mint(&self, tenant: TenantId, ttl: Duration) -> String {
        let exp = (SystemTime::now() + ttl)
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &Claims {
                tenant_id: tenant.get(),
                exp,
            },
            &self.encoding,
        )
        .expect("HS256 signing with an HMAC key cannot fail")
    }

    /// The tenant of a valid token.
    pub fn verify(&self, token: &str) -> Option<TenantId> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation).ok()?;
        TenantId::new(data.claims.tenant_id).ok()
    }
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
}

impl<S> FromRequestParts<S> for TenantId
where
    S: Send + Sync,
    JwtKeys: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        if let Some(tenant) = parts.extensions.get::<TenantId>() {
            return Ok(*tenant);
        }
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(|| unauthorized("missing bearer token"))?;
        let token = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer "))
            .ok_or_else(|| unauthorized("expected `Authorization: Bearer <token>`"))?;
        let tenant = JwtKeys::from_ref(state)
            .verify(token.trim())
            .ok_or_else(|| unauthorized("invalid or expired token"))?;
        parts.extensions.insert(tenant);
        tracing::Span::current().record("tenant_id", tenant.get());
        Ok(tenant)
    }
}
