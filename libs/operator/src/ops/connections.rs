//! Connections per service database against the server's limit: the
//! limit nobody counts until a pool times out.

use serde::Serialize;

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ConnectionsLine {
    #[sqlx(skip)]
    pub service: String,
    /// Sessions on this service's database (every role, every replica).
    pub database: i64,
    /// Client sessions on the whole server.
    pub server: i64,
    /// What the server lets non-superusers open.
    pub server_max: i64,
}

/// Past this share of the server's connections, new pools will wait.
const CONNECTIONS_PROBLEM_SHARE: f64 = 0.8;

pub(super) async fn connections(pool: &sqlx::PgPool) -> sqlx::Result<ConnectionsLine> {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()) AS database,
                (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend') AS server,
                current_setting('max_connections')::bigint
                  - current_setting('superuser_reserved_connections')::bigint AS server_max",
    )
    .fetch_one(pool)
    .await
}

/// The server's connections near its limit, said once: the services
/// usually share one server.
pub(super) fn connections_problem(lines: &[ConnectionsLine]) -> Option<String> {
    let busiest = lines.iter().max_by_key(|c| c.server)?;
    (busiest.server_max > 0
        && busiest.server as f64 >= CONNECTIONS_PROBLEM_SHARE * busiest.server_max as f64)
        .then(|| {
            format!(
                "PostgreSQL: {} of {} connections in use: new pools will time out (runbook: pool exhaustion)",
                busiest.server, busiest.server_max
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(service: &str, server: i64) -> ConnectionsLine {
        ConnectionsLine {
            service: service.into(),
            database: 1,
            server,
            server_max: 97,
        }
    }

    #[test]
    fn a_server_near_its_connection_limit_is_named_once() {
        assert_eq!(
            connections_problem(&[line("orders", 10), line("payments", 77)]),
            None
        );
        let at_80 = connections_problem(&[line("orders", 78), line("payments", 78)]);
        assert_eq!(
            at_80.as_deref(),
            Some(
                "PostgreSQL: 78 of 97 connections in use: new pools will time out (runbook: pool exhaustion)"
            )
        );
        assert_eq!(connections_problem(&[]), None);
    }
}
