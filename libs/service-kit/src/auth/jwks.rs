//! An identity provider's key set (JWKS): fetched from a file or URL;
//! fetched again (at most every 30 s) when a token names an unknown key,
//! and in the background once it is older than its `Cache-Control:
//! max-age`, bounded to [30 s, 1 h] (5 min when the answer says nothing),
//! so a key the provider withdrew stops verifying within the bound. A
//! fetch that fails, or brings no usable key, keeps the last good set.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey};
use tokio::sync::{Mutex, RwLock};

use reliability::{Error, Result};

use super::{JWKS_REFETCH_EVERY, TokenError};

/// How long a key set is used without asking again when its answer gives
/// no `max-age` (a file, or a server that says nothing); and the most any
/// answer may ask for.
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(300);
const LONGEST_MAX_AGE: Duration = Duration::from_secs(3600);

/// An identity provider's public keys by `kid`, each bound to the one
/// algorithm it verifies.
pub(super) struct KeySet {
    pub(super) source: String,
    keys: RwLock<Keys>,
    last_fetch: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct Keys {
    by_kid: HashMap<String, (Algorithm, DecodingKey)>,
    /// When the set was fetched, and for how long it may be used.
    fetched: Option<(Instant, Duration)>,
}

impl KeySet {
    pub(super) fn new(source: String) -> Self {
        Self {
            source,
            keys: RwLock::new(Keys::default()),
            last_fetch: Mutex::new(None),
        }
    }

    pub(super) async fn find(
        self: &Arc<Self>,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Result<DecodingKey, TokenError> {
        let kid = kid.ok_or(TokenError::UnknownKey(None))?;
        if let Some((key, stale)) = self.get(kid, alg).await {
            if stale {
                // Past its age: asked again in the background; this
                // request goes on with the set as it is.
                let set = Arc::clone(self);
                tokio::spawn(async move { set.fetch_at_most_every(JWKS_REFETCH_EVERY).await });
            }
            return Ok(key);
        }
        // A rotated key: fetch again, unless that was done a moment ago.
        self.fetch_at_most_every(JWKS_REFETCH_EVERY).await;
        self.get(kid, alg)
            .await
            .map(|(key, _)| key)
            .ok_or_else(|| TokenError::UnknownKey(Some(kid.to_owned())))
    }

    /// Fetches the set again unless a fetch began within `every`.
    async fn fetch_at_most_every(&self, every: Duration) {
        let mut last = self.last_fetch.lock().await;
        if last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        *last = Some(Instant::now());
        drop(last);
        if let Err(e) = self.refresh().await {
            tracing::warn!(jwks = %self.source, error = %e, "could not fetch the key set again; keeping the last good one");
        }
    }

    /// The key, and whether the set is past its age.
    async fn get(&self, kid: &str, alg: Algorithm) -> Option<(DecodingKey, bool)> {
        let keys = self.keys.read().await;
        let stale = keys.fetched.is_none_or(|(at, age)| at.elapsed() >= age);
        match keys.by_kid.get(kid) {
            Some((a, key)) if *a == alg => Some((key.clone(), stale)),
            _ => None,
        }
    }

    /// Loads the set; returns how many usable keys it has. A set with none
    /// replaces nothing: an answer emptied by mistake would refuse every
    /// token until the next good one.
    pub(super) async fn refresh(&self) -> Result<usize> {
        let config =
            |e: &dyn std::fmt::Display| Error::Config(format!("JWT_JWKS {}: {e}", self.source));
        let (text, max_age) =
            if self.source.starts_with("http://") || self.source.starts_with("https://") {
                let fetch = async {
                    let answer = reqwest::Client::builder()
                        .timeout(Duration::from_secs(10))
                        .build()?
                        .get(&self.source)
                        .send()
                        .await?
                        .error_for_status()?;
                    let max_age = max_age(
                        answer
                            .headers()
                            .get(reqwest::header::CACHE_CONTROL)
                            .and_then(|v| v.to_str().ok()),
                    );
                    Ok::<_, reqwest::Error>((answer.text().await?, max_age))
                };
                fetch.await.map_err(|e| config(&e))?
            } else {
                let text = tokio::fs::read_to_string(&self.source)
                    .await
                    .map_err(|e| config(&e))?;
                (text, DEFAULT_MAX_AGE)
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
        if n == 0 {
            return Err(config(
                &"the set has no usable key (RS256 or ES256 with a kid)",
            ));
        }
        *self.keys.write().await = Keys {
            by_kid: keys,
            fetched: Some((Instant::now(), max_age)),
        };
        Ok(n)
    }
}

/// How long an answer with this `Cache-Control` may be used: its
/// `max-age`, within [`JWKS_REFETCH_EVERY`, `LONGEST_MAX_AGE`]; `no-cache`
/// or `no-store`, the shortest; nothing said, [`DEFAULT_MAX_AGE`].
fn max_age(cache_control: Option<&str>) -> Duration {
    let Some(value) = cache_control else {
        return DEFAULT_MAX_AGE;
    };
    let mut age = None;
    for directive in value.split(',').map(str::trim) {
        let lower = directive.to_ascii_lowercase();
        if lower == "no-cache" || lower == "no-store" {
            return JWKS_REFETCH_EVERY;
        }
        if let Some(secs) = lower
            .strip_prefix("max-age=")
            .and_then(|s| s.trim_matches('"').parse().ok())
        {
            age = Some(Duration::from_secs(secs));
        }
    }
    age.map_or(DEFAULT_MAX_AGE, |a| {
        a.clamp(JWKS_REFETCH_EVERY, LONGEST_MAX_AGE)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answers_age_is_its_max_age_within_the_bounds() {
        for (header, secs) in [
            (None, 300),
            (Some("public, max-age=600"), 600),
            (Some("max-age=0"), 30),
            (Some("max-age=86400, must-revalidate"), 3600),
            (Some("no-store"), 30),
            (Some("private"), 300),
        ] {
            assert_eq!(max_age(header), Duration::from_secs(secs), "{header:?}");
        }
    }
}
