//! Work accepted and not yet decided past the admission's `stuck_after`:
//! the console's list of stuck orders, oldest first, each with its age.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::Estate;

/// Where a service keeps work it has accepted and not yet decided: the
/// table, the condition of a row undecided, and the column of its time of
/// acceptance (an index serves both): undecided past the admission's
/// `stuck_after`, it is stuck, not in flight.
pub struct WorkInFlight {
    pub service: &'static str,
    pub table: &'static str,
    pub in_flight: &'static str,
    pub since: &'static str,
    /// The work's id column (with `tenant_id`, its key): what the console
    /// links each stuck item by.
    pub key: &'static str,
}

/// One stuck item of work.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StuckLine {
    #[sqlx(skip)]
    pub service: String,
    pub tenant_id: i64,
    pub id: i64,
    pub since: DateTime<Utc>,
    pub age_seconds: f64,
}

/// The oldest `limit` items of each of `work` undecided for longer than
/// `stuck_after_secs`; a service that cannot answer is an error line.
pub async fn stuck(
    estate: &Estate,
    work: &[WorkInFlight],
    stuck_after_secs: f64,
    limit: i64,
) -> (Vec<StuckLine>, Vec<String>) {
    let (mut lines, mut errors) = (Vec::new(), Vec::new());
    for w in work {
        let Some(pool) = estate.database(w.service) else {
            continue;
        };
        // Table and columns come from the caller's constant list; the
        // index that serves admission's count serves this order.
        let (table, in_flight, since, key) = (w.table, w.in_flight, w.since, w.key);
        let sql = format!(
            "SELECT tenant_id, {key} AS id, {since} AS since,
                    extract(epoch FROM now() - {since})::float8 AS age_seconds
             FROM {table}
             WHERE {in_flight} AND {since} <= now() - make_interval(secs => $1)
             ORDER BY {since} LIMIT $2"
        );
        let found: sqlx::Result<Vec<StuckLine>> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(stuck_after_secs)
            .bind(limit)
            .fetch_all(pool)
            .await;
        match found {
            Ok(found) => lines.extend(found.into_iter().map(|l| StuckLine {
                service: w.service.to_owned(),
                ..l
            })),
            Err(e) => errors.push(format!("{}: {e}", w.service)),
        }
    }
    (lines, errors)
}
