use std::time::Duration;

/// Errors of the reliability library. Structured so that a caller can tell a
/// broker outage from a database one, or an injected crash from either.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("broker error: {0}")]
    Broker(#[from] lapin::Error),
    #[error("broker did not answer within {0:?}")]
    BrokerTimeout(Duration),
    #[error("message could not be encoded or decoded: {0}")]
    Json(#[from] serde_json::Error),
    /// A fail point configured to crash fired; the caller must stop as a
    /// crashed process would, without cleaning up.
    #[error("fail point {0} fired")]
    FailPoint(&'static str),
    /// A queue a publisher relies on is missing and could not be declared:
    /// nothing is published until it exists (docs/adr/0012).
    #[error("broker topology incomplete: {0}")]
    Topology(String),
    #[error("invalid configuration: {0}")]
    Config(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
