//! Who is calling: `Authorization: Bearer <JWT>` with an integer
//! `tenant_id` claim. The tenant comes from the verified token only; a
//! client never names it in a header or a body.
//!
//! Tokens are HS256 with the stack's secret, or RS256/ES256 signed by an
//! identity provider whose keys come from a JWKS (a file or a URL, looked up
//! by `kid`, fetched again when an unknown `kid` appears). Every token needs
//! `exp`, no further away than [`AuthSettings::jwt_max_lifetime_secs`];
//! `nbf` is honoured; `iss` and `aud` are required when configured. Each key
//! verifies only its own algorithm, so a public key can never be used as an
//! HMAC secret (algorithm confusion). docs/security.md lists the checks.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{FromRef, FromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::http::ApiError;
use crate::secret::Secret;
use reliability::{Error, Result, TenantId};

mod jwks;
use jwks::KeySet;

/// The secret a local stack uses when none is set. Anyone can mint tokens
/// with it (the README prints it), so a server refuses it unless it listens
/// on loopback only.
pub const DEV_SECRET: &str = "dev-secret-change-me";
/// Shortest HS256 secret accepted off loopback (RFC 7518 §3.2: at least
/// the hash size).
pub const MIN_SECRET_BYTES: usize = 32;
/// An unknown `kid` fetches the key set again at most this often, so junk
/// tokens cannot turn the service into a JWKS flooder.
const JWKS_REFETCH_EVERY: Duration = Duration::from_secs(30);

/// How tokens are checked, each from its environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct AuthSettings {
    /// HS256 secret of bearer tokens, at least 32 bytes. Unset: the
    /// development secret `dev-secret-change-me`, accepted only while the
    /// server binds loopback (or no HS256 at all when `JWT_JWKS` is set).
    #[arg(long, env = "JWT_SECRET")]
    pub jwt_secret: Option<Secret>,
    /// RS256/ES256 verification keys of an identity provider: a JWKS file
    /// path or an `http(s)://` URL.
    #[arg(long, env = "JWT_JWKS")]
    pub jwt_jwks: Option<String>,
    /// Required `iss` claim, when set.
    #[arg(long, env = "JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// Required `aud` claim (one of the token's audiences), when set.
    #[arg(long, env = "JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
    /// Longest accepted remaining lifetime of a token (`exp` - now), in seconds.
    #[arg(long, env = "JWT_MAX_LIFETIME_SECS", default_value_t = 86_400)]
    pub jwt_max_lifetime_secs: u64,
}

impl Default for AuthSettings {
    /// As with no environment: the defaults of the `#[arg]`s above.
    fn default() -> Self {
        crate::defaults::defaults()
    }
}

impl AuthSettings {
    /// The HS256 secret in force: the configured one, else the development
    /// one unless an identity provider's key set replaces it.
    fn hs256_secret(&self) -> Option<&str> {
        match (&self.jwt_secret, &self.jwt_jwks) {
            (Some(s), _) => Some(s.expose()),
            (None, Some(_)) => None,
            (None, None) => Some(DEV_SECRET),
        }
    }

    /// Refuses a secret anyone could guess on a server others can reach.
    pub fn check(&self, bind_address: &str) -> Result<()> {
        let Some(secret) = self.hs256_secret() else {
            return Ok(());
        };
        let weak = if secret == DEV_SECRET {
            Some("is the development default, which anyone can mint tokens with")
        } else if secret.len() < MIN_SECRET_BYTES {
            Some("is shorter than 32 bytes")
        } else {
            None
        };
        match weak {
            Some(why) if !is_loopback(bind_address) => Err(Error::Config(format!(
                "JWT_SECRET {why}, and the server binds {bind_address}, reachable from other hosts. \
                 Set JWT_SECRET to at least {MIN_SECRET_BYTES} random bytes (e.g. `openssl rand -hex 32`), \
                 or set JWT_JWKS to use an identity provider's keys, or bind loopback only (BIND_ADDRESS=127.0.0.1)"
            ))),
            _ => Ok(()),
        }
    }

    /// The HS256 keys and claim rules, without loading a key set (minting
    /// in tests and tools; a service uses [`AuthSettings::load`]).
    pub fn keys(&self) -> JwtKeys {
        let mut keys = JwtKeys::from_secret(self.hs256_secret().unwrap_or(DEV_SECRET).as_bytes());
        keys.hs256 = self.hs256_secret().is_some();
        keys.policy = Arc::new(Policy {
            issuer: self.jwt_issuer.clone(),
            audience: self.jwt_audience.clone(),
            max_lifetime: Duration::from_secs(self.jwt_max_lifetime_secs),
        });
        keys
    }

    /// Checks the secret, and loads the key set when one is configured.
    pub async fn load(&self, bind_address: &str) -> Result<JwtKeys> {
        self.check(bind_address)?;
        let mut keys = self.keys();
        if let Some(source) = &self.jwt_jwks {
            let set = KeySet::new(source.clone());
            let n = set.refresh().await?;
            tracing::info!(jwks = %source, keys = n, "identity provider keys loaded");
            keys.key_set = Some(Arc::new(set));
        }
        Ok(keys)
    }
}

fn is_loopback(bind_address: &str) -> bool {
    bind_address == "localhost"
        || bind_address
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// What the stack mints.
#[derive(Debug, Serialize)]
struct Claims {
    tenant_id: i64,
    exp: u64,
    iat: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    iss: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    aud: Option<String>,
}

/// What a verified token must carry beyond the claims jsonwebtoken checks
/// (`exp`, `nbf`, `iss`, `aud`, in whatever form the issuer uses).
#[derive(Debug, Deserialize)]
struct Verified {
    tenant_id: i64,
    exp: u64,
}

#[derive(Debug)]
struct Policy {
    issuer: Option<String>,
    audience: Option<String>,
    max_lifetime: Duration,
}

/// Signing and verification keys and the claim rules. Its `Debug` prints
/// no secret.
#[derive(Clone)]
pub struct JwtKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    /// Whether HS256 tokens are accepted at all.
    hs256: bool,
    key_set: Option<Arc<KeySet>>,
    policy: Arc<Policy>,
}

impl fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JwtKeys")
            .field("hs256", &self.hs256)
            .field("jwks", &self.key_set.as_ref().map(|s| &s.source))
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Why a token was refused (logged at debug; the client only hears 401).
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{0}")]
    Invalid(#[from] jsonwebtoken::errors::Error),
    #[error("algorithm {0:?} is not accepted")]
    Algorithm(Algorithm),
    #[error("no key with kid {0:?}")]
    UnknownKey(Option<String>),
    #[error("expires further away than the maximum token lifetime")]
    TooLong,
    #[error("tenant_id is not a positive integer")]
    Tenant,
}

impl JwtKeys {
    pub fn from_secret(secret: &[u8]) -> Self {
        Self {
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
            hs256: true,
            key_set: None,
            policy: Arc::new(Policy {
                issuer: None,
                audience: None,
                max_lifetime: Duration::from_secs(86_400),
            }),
        }
    }

    /// An HS256 token for `tenant`, valid for `ttl`, with the configured
    /// issuer and audience.
    pub fn mint(&self, tenant: TenantId, ttl: Duration) -> String {
        let now = now_secs();
        let claims = Claims {
            tenant_id: tenant.get(),
            exp: now + ttl.as_secs(),
            iat: now,
            iss: self.policy.issuer.clone(),
            aud: self.policy.audience.clone(),
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .expect("HS256 signing with an HMAC key cannot fail")
    }

    fn validation(&self, alg: Algorithm) -> Validation {
        let mut v = Validation::new(alg);
        // "Expired" means expired: clock skew is the identity provider's to
        // absorb in the lifetimes it issues.
        v.leeway = 0;
        v.validate_nbf = true;
        let mut required = vec!["exp"];
        if let Some(iss) = &self.policy.issuer {
            v.set_issuer(&[iss]);
            required.push("iss");
        }
        match &self.policy.audience {
            Some(aud) => {
                v.set_audience(&[aud]);
                required.push("aud");
            }
            None => v.validate_aud = false,
        }
        v.set_required_spec_claims(&required);
        v
    }

    /// The tenant of a valid token.
    pub async fn verify(&self, token: &str) -> Result<TenantId, TokenError> {
        let header = jsonwebtoken::decode_header(token)?;
        let data = match header.alg {
            Algorithm::HS256 if self.hs256 => jsonwebtoken::decode::<Verified>(
                token,
                &self.decoding,
                &self.validation(Algorithm::HS256),
            )?,
            Algorithm::RS256 | Algorithm::ES256 if self.key_set.is_some() => {
                let set = self.key_set.as_ref().expect("checked above");
                let key = set.find(header.kid.as_deref(), header.alg).await?;
                jsonwebtoken::decode::<Verified>(token, &key, &self.validation(header.alg))?
            }
            other => return Err(TokenError::Algorithm(other)),
        };
        if data.claims.exp > now_secs() + self.policy.max_lifetime.as_secs() {
            return Err(TokenError::TooLong);
        }
        TenantId::new(data.claims.tenant_id).map_err(|_| TokenError::Tenant)
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
}

/// The tenant a request's bearer token names, as a handler's argument:
/// `Tenant(tenant): Tenant`. Verified once per request (a later extractor
/// reads it from the request's extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenant(pub TenantId);

impl<S> FromRequestParts<S> for Tenant
where
    S: Send + Sync,
    JwtKeys: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        if let Some(tenant) = parts.extensions.get::<TenantId>() {
            return Ok(Tenant(*tenant));
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
            .await
            .map_err(|e| {
                tracing::debug!(error = %e, "token refused");
                unauthorized("invalid or expired token")
            })?;
        parts.extensions.insert(tenant);
        tracing::Span::current().record("tenant_id", tenant.get());
        Ok(Tenant(tenant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weak_secrets_are_refused_off_loopback_only() {
        let dev = AuthSettings::default();
        assert!(dev.check("127.0.0.1").is_ok());
        assert!(dev.check("::1").is_ok());
        let err = dev.check("0.0.0.0").unwrap_err().to_string();
        assert!(
            err.contains("JWT_SECRET") && err.contains("openssl rand"),
            "{err}"
        );
        let short = AuthSettings {
            jwt_secret: Some("short".into()),
            ..AuthSettings::default()
        };
        assert!(short.check("0.0.0.0").is_err());
        let empty = AuthSettings {
            jwt_secret: Some("".into()),
            ..AuthSettings::default()
        };
        assert!(empty.check("10.0.0.5").is_err());
        let strong = AuthSettings {
            jwt_secret: Some("k".repeat(32).as_str().into()),
            ..AuthSettings::default()
        };
        assert!(strong.check("0.0.0.0").is_ok());
        let idp_only = AuthSettings {
            jwt_jwks: Some("/etc/jwks.json".into()),
            ..AuthSettings::default()
        };
        assert!(idp_only.check("0.0.0.0").is_ok());
        assert!(!idp_only.keys().hs256);
    }
}
