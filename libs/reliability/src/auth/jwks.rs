//! An identity provider's key set (JWKS): fetched from a file or URL, and\n//! fetched again (at most every 30 s) when a token names an unknown key.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey};
use tokio::sync::{Mutex, RwLock};

use crate::{Error, Result};

use super::{JWKS_REFETCH_EVERY, TokenError};

/// An identity provider's public keys by `kid`, each bound to the one
/// algorithm it verifies.
pub(super) struct KeySet {
    pub(super) source: String,
    keys: RwLock<HashMap<String, (Algorithm, DecodingKey)>>,
    last_fetch: Mutex<Option<Instant>>,
}

impl KeySet {
    pub(super) fn new(source: String) -> Self {
        Self {
            source,
            keys: RwLock::new(HashMap::new()),
            last_fetch: Mutex::new(None),
        }
    }

    pub(super) async fn find(
        &self,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Result<DecodingKey, TokenError> {
        let kid = kid.ok_or(TokenError::UnknownKey(None))?;
        if let Some(key) = self.get(kid, alg).await {
            return Ok(key);
        }
        // A rotated key: fetch again, unless that was done a moment ago.
        {
            let mut last = self.last_fetch.lock().await;
            if last.is_none_or(|t| t.elapsed() >= JWKS_REFETCH_EVERY) {
                *last = Some(Instant::now());
                drop(last);
                if let Err(e) = self.refresh().await {
                    tracing::warn!(jwks = %self.source, error = %e, "could not fetch the key set again");
                }
            }
        }
        self.get(kid, alg)
            .await
            .ok_or_else(|| TokenError::UnknownKey(Some(kid.to_owned())))
    }

    async fn get(&self, kid: &str, alg: Algorithm) -> Option<DecodingKey> {
        match self.keys.read().await.get(kid) {
            Some((a, key)) if *a == alg => Some(key.clone()),
            _ => None,
        }
    }

    /// Loads the set; returns how many usable keys it has.
    pub(super) async fn refresh(&self) -> Result<usize> {
        let text = if self.source.starts_with("http://") || self.source.starts_with("https://") {
            let fetch = async {
                reqwest::Client::builder()
                    .timeout(Duration::from_secs(10))
                    .build()?
                    .get(&self.source)
                    .send()
                    .await?
                    .error_for_status()?
                    .text()
                    .await
            };
            fetch
                .await
                .map_err(|e| Error::Config(format!("JWT_JWKS {}: {e}", self.source)))?
        } else {
            tokio::fs::read_to_string(&self.source)
                .await
                .map_err(|e| Error::Config(format!("JWT_JWKS {}: {e}", self.source)))?
        };
        let set: JwkSet = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("JWT_JWKS {}: not a JWK set: {e}", self.source)))?;
        let mut keys = HashMap::new();
        for jwk in &set.keys {
            let Some(kid) = &jwk.common.key_id else {
                tracing::warn!(jwks = %self.source, "skipping a key without kid");
                continue;
            };
            let alg = match (&jwk.algorithm, jwk.common.key_algorithm) {
                (AlgorithmParameters::RSA(_), None | Some(KeyAlgorithm::RS256)) => Algorithm::RS256,
                (AlgorithmParameters::EllipticCurve(ec), None | Some(KeyAlgorithm::ES256))
                    if ec.curve == EllipticCurve::P256 =>
                {
                    Algorithm::ES256
                }
                _ => {
                    tracing::warn!(jwks = %self.source, kid, "skipping a key that is not RS256 or ES256");
                    continue;
                }
            };
            match DecodingKey::from_jwk(jwk) {
                Ok(key) => {
                    keys.insert(kid.clone(), (alg, key));
                }
                Err(e) => {
                    tracing::warn!(jwks = %self.source, kid, error = %e, "skipping an unreadable key");
                }
            }
        }
        let n = keys.len();
        *self.keys.write().await = keys;
        Ok(n)
    }
}
