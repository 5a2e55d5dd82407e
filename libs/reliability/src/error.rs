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
        source: Box<crate::consumer::ApplyError>,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether the failure is a dependency being down or overloaded (the
    /// database unreachable, restarting, out of connections; the pool
    /// exhausted), as opposed to a bug or bad data: the caller may retry.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Database(e) => db_unavailable(e),
            Self::Broker(_) | Self::BrokerTimeout(_) | Self::ChannelClosed(_) => true,
            _ => false,
        }
    }
}

fn db_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        // A connection cut mid-handshake (e.g. the answer to TLS negotiation
        // never comes) surfaces as a protocol error.
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // 08: connection exception; 57P01-03: shutdown, crash,
            // cannot connect now (starting or in recovery); 53300: too many
            // connections.
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03" | "53300")
        }),
        _ => false,
    }
}
