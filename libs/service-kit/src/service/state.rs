//! The shared HTTP state every service's routes get ([`ApiState`]).

use axum::extract::FromRef;
use sqlx::PgPool;

use crate::admission::{AdmissionLimits, Backlog};
use crate::auth::JwtKeys;
use crate::idempotency::IdempotencyConfig;
use crate::rate_limit::{RateLimit, RateLimiter};

/// idempotency settings and the token keys. Use it as the router state, or
/// embed it and delegate `FromRef`.
#[derive(Debug, Clone)]
pub struct ApiState {
    pub pool: PgPool,
    pub idempotency: IdempotencyConfig,
    pub jwt: JwtKeys,
    /// Bounds for the routes a service gates with a [`Backlog`].
    pub admission: AdmissionLimits,
    own: Own,
}

/// A service's own settings (its `Settings<X>`'s `X`), kept for its routes.
#[derive(Clone, Default)]
struct Own(Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>);

impl std::fmt::Debug for Own {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Own(..)"
        } else {
            "Own(None)"
        })
    }
}

impl ApiState {
    pub fn new(pool: PgPool, jwt: JwtKeys) -> Self {
        Self {
            idempotency: IdempotencyConfig::new(pool.clone()),
            pool,
            jwt,
            admission: AdmissionLimits::default(),
            own: Own::default(),
        }
    }

    /// Keeps the service's own settings for its routes ([`Self::own`]).
    #[must_use]
    pub fn with_own(mut self, own: std::sync::Arc<dyn std::any::Any + Send + Sync>) -> Self {
        self.own = Own(Some(own));
        self
    }

    /// The service's own settings (a route's server address, say): absent
    /// where only the OpenAPI document is built, so a router builds without
    /// them and connects nowhere as it is built.
    pub fn own<X: std::any::Any>(&self) -> Option<&X> {
        self.own.0.as_deref()?.downcast_ref()
    }

    #[must_use]
    pub fn with_admission(mut self, limits: AdmissionLimits) -> Self {
        self.admission = limits;
        self
    }

    /// The gate of a route whose work the pipeline decides later, counted
    /// by the service's `sql` (see [`Backlog`]); layer it on that route.
    pub fn backlog(&self, sql: &'static str) -> axum::Extension<Backlog> {
        axum::Extension(Backlog::new(self.pool.clone(), self.admission.clone(), sql))
    }

    #[must_use]
    pub fn with_rate_limit(mut self, limit: RateLimit) -> Self {
        self.idempotency.rate_limit = RateLimiter::new(limit);
        self
    }
}

impl FromRef<ApiState> for IdempotencyConfig {
    fn from_ref(s: &ApiState) -> Self {
        s.idempotency.clone()
    }
}

impl FromRef<ApiState> for JwtKeys {
    fn from_ref(s: &ApiState) -> Self {
        s.jwt.clone()
    }
}

impl FromRef<ApiState> for PgPool {
    fn from_ref(s: &ApiState) -> Self {
        s.pool.clone()
    }
}
