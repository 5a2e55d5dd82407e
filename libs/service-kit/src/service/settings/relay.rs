//! How a service's outbox reaches the broker: the relay's settings.

use std::time::Duration;

use reliability::{Result, db};

/// How the relay learns which rows committed (docs/adr/0038).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RelayMode {
    /// It claims due rows, woken by the outbox's commit notifications.
    Poll,
    /// It reads the commits from a logical replication slot; a polling
    /// relay sweeps beside it every [`LOG_MODE_SWEEP`].
    Log,
}

/// In log mode, how often the polling relay looks for the rows the log
/// does not show: committed before the slot existed, backed off after a
/// failed publish, or held behind an earlier row of their aggregate.
pub const LOG_MODE_SWEEP: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, clap::Args)]
pub struct RelaySettings {
    /// `poll` (the default) or `log`: read the outbox's commits from a
    /// logical replication slot (needs `wal_level = logical`).
    #[arg(
        id = "relay_mode",
        long = "relay-mode",
        env = "RELAY_MODE",
        value_enum,
        default_value = "poll"
    )]
    pub mode: RelayMode,
    /// In log mode, the replication connection's URL (a role with
    /// REPLICATION); default: the service's database URL as `commerce_wal`.
    #[arg(
        id = "relay_replication_url",
        long = "relay-replication-url",
        env = "RELAY_REPLICATION_URL"
    )]
    pub replication_url: Option<String>,
    /// Full URL for the relay role; default: the service's database URL as `commerce_relay`.
    #[arg(
        id = "relay_database_url",
        long = "relay-database-url",
        env = "RELAY_DATABASE_URL"
    )]
    pub database_url: Option<String>,
    /// Relay backoff step in ms: a failed publish waits `min(attempts+1, 8)` steps.
    #[arg(
        id = "relay_backoff_ms",
        long = "relay-backoff-ms",
        env = "RELAY_BACKOFF_MS",
        default_value_t = 30_000
    )]
    pub backoff_ms: u64,
    /// How long the relay waits for the broker's confirms of a batch (and
    /// so holds its claim), in ms. Unconfirmed rows stay pending and cost no
    /// attempt.
    #[arg(
        id = "relay_confirm_timeout_ms",
        long = "relay-confirm-timeout-ms",
        env = "RELAY_CONFIRM_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub confirm_timeout_ms: u64,
    /// Failed publishes after which an outbox row moves to the DLQ table.
    #[arg(
        id = "relay_max_attempts",
        long = "relay-max-attempts",
        env = "RELAY_MAX_ATTEMPTS",
        default_value_t = 10
    )]
    pub max_attempts: i32,
}

impl RelaySettings {
    /// The log relay's replication URL: the setting, else `database_url`
    /// as the WAL role (with `DB_ROLE_PASSWORD` where set).
    pub fn replication_url(&self, database_url: &str) -> Result<String> {
        match &self.replication_url {
            Some(url) => Ok(url.clone()),
            None => as_user(database_url, db::WAL_ROLE, db::role_password().as_deref()),
        }
    }
}

/// `url` with its user (and password) replaced.
fn as_user(url: &str, user: &str, password: Option<&str>) -> Result<String> {
    let bad = || reliability::Error::Config(format!("not a postgres:// URL: {url:?}"));
    let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let auth = match password {
        Some(p) => format!("{user}:{}", urlencode(p)),
        None => user.to_owned(),
    };
    Ok(format!(
        "{scheme}://{auth}@{host}{}",
        &rest[authority_end..]
    ))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::as_user;
    use clap::CommandFactory;

    #[derive(Debug, Clone, Default, clap::Args)]
    struct Own {}

    /// Clap checks its arguments only when a command parses them: a name
    /// two settings share fails every binary at start (an e2e run did).
    #[test]
    fn every_setting_of_a_service_has_a_name_of_its_own() {
        crate::service::Settings::<Own>::command().debug_assert();
    }

    #[test]
    fn the_wal_role_takes_the_urls_place_of_its_user() {
        let url = "postgres://postgres:secret@db.local:5432/orders?sslmode=require";
        assert_eq!(
            as_user(url, "commerce_wal", None).unwrap(),
            "postgres://commerce_wal@db.local:5432/orders?sslmode=require"
        );
        assert_eq!(
            as_user(
                "postgresql://127.0.0.1/orders",
                "commerce_wal",
                Some("p@ss")
            )
            .unwrap(),
            "postgresql://commerce_wal:p%40ss@127.0.0.1/orders"
        );
        assert!(as_user("orders", "commerce_wal", None).is_err());
    }
}
