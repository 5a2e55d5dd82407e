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
    /// A setting that cannot work (a weak secret, a bad fail point spec,
    /// an unreadable key set): the process should not start.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The broker closed a channel or a consumer's stream under a running
    /// part: a broker loss, reconnected like one.
    #[error("broker closed the {0}")]
    ChannelClosed(&'static str),
    /// The broker answered a publish with something other than an ack.
    #[error("broker refused: {0}")]
    Refused(String),
    /// A third party a service depends on (the payment provider) did not
    /// answer usefully: a dependency down, retried like one.
    #[error("{0}")]
    Upstream(String),
    /// A listener could not be bound (or its address read).
    #[error("cannot bind {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    /// A task of the process panicked.
    #[error("task {task} panicked: {source}")]
    Panicked {
        task: String,
        #[source]
        source: tokio::task::JoinError,
    },
    /// A tenant id that is not positive (a corrupt row or message).
    #[error(transparent)]
    InvalidTenant(#[from] crate::tenant::InvalidTenantId),
    /// Replaying an event into a consumer failed (a projection rebuild).
    #[error("replaying {message_id}: {source}")]
    Replay {
        message_id: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether the failure is a dependency being down or overloaded (the
    /// database unreachable, restarting, out of connections; the pool
    /// exhausted), as opposed to a bug or bad data: the caller may retry.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Database(e) => crate::db::is_unavailable(e),
            Self::Broker(_)
            | Self::BrokerTimeout(_)
            | Self::ChannelClosed(_)
            | Self::Upstream(_) => true,
            _ => false,
        }
    }

    /// Unavailable, or a conflict the database settled by ending one side
    /// (`db::is_retryable_at_no_cost`): a consumer retries it without
    /// spending one of the message's attempts.
    pub fn is_retryable_at_no_cost(&self) -> bool {
        match self {
            Self::Database(e) => crate::db::is_retryable_at_no_cost(e),
            other => other.is_unavailable(),
        }
    }
}
