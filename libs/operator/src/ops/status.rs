//! `reliability status`: per service the outbox, per consumer its queue,
//! DLQ and last apply, per maintenance step its last run; and the problems
//! among them, named.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::{Estate, outbox};
use reliability::{TenantId, broker, maintenance};
use service_kit::admission::AdmissionLimits;

#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub outbox: Vec<OutboxLine>,
    /// Connections per service database against the server's limit: the
    /// limit nobody counts until a pool times out.
    pub connections: Vec<ConnectionsLine>,
    pub consumers: Vec<ConsumerLine>,
    pub maintenance: Vec<MaintenanceLine>,
    /// The tenants with the most work in flight, against their admission
    /// bound ([`admission`]; empty until it is asked for).
    pub admission: Vec<AdmissionLine>,
    /// Refunds that ended failed in the last day (payments' database).
    pub refunds_failed: Option<sources::FailedRefunds>,
    /// Whether every subscription's bindings were held to the broker's
    /// (its management API answered).
    pub bindings_checked: bool,
    /// What needs an operator, one sentence each; empty when all is well.
    pub problems: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OutboxLine {
    pub service: String,
    #[serde(flatten)]
    pub status: Option<outbox::OutboxStatus>,
    pub error: Option<String>,
}

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

pub use super::stuck::WorkInFlight;

#[derive(Debug, Clone, Serialize)]
pub struct AdmissionLine {
    pub service: String,
    pub tenant_id: i64,
    pub in_flight: i64,
    /// Undecided past the bound's `stuck_after`: not counted in flight.
    pub stuck: i64,
    /// 0: no bound.
    pub bound: u32,
}

/// Tenants shown per service: the ones with the most in flight.
const ADMISSION_TOP: i64 = 5;

/// Adds the tenants with the most work in flight per service to `status`,
/// each against its bound (the services' `ADMISSION_*` settings), and a
/// problem for each tenant at its bound: its new work is being refused.
pub async fn admission(
    estate: &Estate,
    work: &[WorkInFlight],
    limits: &AdmissionLimits,
    status: &mut Status,
) {
    for w in work {
        let Some(pool) = estate.database(w.service) else {
            continue;
        };
        // Table and columns come from the caller's constant list.
        let (table, in_flight, since) = (w.table, w.in_flight, w.since);
        let sql = format!(
            "SELECT tenant_id, count(*) FILTER (WHERE {since} > now() - make_interval(secs => $1)),
                    count(*) FILTER (WHERE {since} <= now() - make_interval(secs => $1))
             FROM {table} WHERE {in_flight} GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT {ADMISSION_TOP}"
        );
        let rows: Vec<(i64, i64, i64)> = match sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(limits.stuck_after.as_secs_f64())
            .fetch_all(pool)
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                let problem = format!("{}: work in flight not counted: {e}", w.service);
                status.problems.push(problem);
                continue;
            }
        };
        for (tenant_id, in_flight, stuck) in rows {
            let bound = TenantId::new(tenant_id).map_or(limits.default, |t| limits.bound(t));
            if stuck > 0 {
                status.problems.push(format!(
                    "{}: tenant {tenant_id} has {stuck} order(s) undecided for over {} s: stuck, no longer counted against its bound (`reliability explain order`; runbook: \"Orders stay pending\")",
                    w.service,
                    limits.stuck_after.as_secs()
                ));
            }
            if bound > 0 && in_flight >= i64::from(bound) {
                status.problems.push(format!(
                    "{}: tenant {tenant_id} is at its admission bound ({in_flight} in flight of {bound}): its new work gets 429 until the pipeline decides some",
                    w.service
                ));
            }
            status.admission.push(AdmissionLine {
                service: w.service.to_owned(),
                tenant_id,
                in_flight,
                stuck,
                bound,
            });
        }
    }
}

/// Past this share of the server's connections, new pools will wait.
const CONNECTIONS_PROBLEM_SHARE: f64 = 0.8;

async fn connections(pool: &sqlx::PgPool) -> sqlx::Result<ConnectionsLine> {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()) AS database,
                (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend') AS server,
                current_setting('max_connections')::bigint
                  - current_setting('superuser_reserved_connections')::bigint AS server_max",
    )
    .fetch_one(pool)
    .await
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ConsumerLine {
    pub consumer: String,
    pub queue: String,
    /// Messages ready: the consumer's lag.
    pub ready: Option<u32>,
    pub unacked: Option<u64>,
    /// Processes (lanes) attached.
    pub consumers: Option<u32>,
    pub dlq: Option<u32>,
    /// Ordered subscriptions: aggregates parked, waiting for an operator.
    pub parked: Option<i64>,
    pub last_applied_at: Option<DateTime<Utc>>,
    pub applied: Option<i64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MaintenanceLine {
    pub service: String,
    #[serde(flatten)]
    pub run: maintenance::StepRun,
}

/// Past this age, pending outbox rows are a problem.
const OUTBOX_LAG_PROBLEM_SECS: f64 = 60.0;
/// How far back a failed refund is a problem: a day, so the morning's
/// look sees the night's.
const REFUNDS_FAILED_WINDOW_SECS: f64 = 24.0 * 3600.0;

pub async fn status(estate: &Estate) -> Status {
    let mut problems = Vec::new();
    let mut outbox = Vec::new();
    let mut runs = Vec::new();
    let mut conns = Vec::new();
    for (service, pool) in &estate.databases {
        if let Ok(mut line) = connections(pool).await {
            line.service = service.clone();
            conns.push(line);
        }
        let (status, error) = match outbox::outbox_status(pool).await {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(e.to_string())),
        };
        match (&status, &error) {
            (_, Some(e)) => problems.push(format!("{service}: database unreachable: {e}")),
            (Some(s), None) => {
                if s.dlq > 0 {
                    problems.push(format!(
                        "{service}: {} outbox row(s) in the DLQ table (reliability outbox dlq list --service {service})",
                        s.dlq
                    ));
                }
                if s.oldest_pending_seconds.unwrap_or(0.0) > OUTBOX_LAG_PROBLEM_SECS {
                    problems.push(format!(
                        "{service}: {} row(s) pending, the oldest {:.0} s: is its relay running?",
                        s.pending,
                        s.oldest_pending_seconds.unwrap_or(0.0)
                    ));
                }
            }
            (None, None) => {}
        }
        outbox.push(OutboxLine {
            service: service.clone(),
            status,
            error,
        });
        if let Ok(steps) = maintenance::last_runs(pool).await {
            for run in steps {
                if run.last_failure_at > run.last_success_at {
                    problems.push(format!(
                        "{service}: maintenance step {} failed last: {}",
                        run.step,
                        run.last_error.as_deref().unwrap_or("?")
                    ));
                }
                runs.push(MaintenanceLine {
                    service: service.clone(),
                    run,
                });
            }
        }
    }
    let mut consumers = Vec::new();
    for sub in estate.subscriptions {
        let line = consumer_line(estate, sub).await;
        if let Some(e) = &line.error {
            problems.push(format!("{}: {e}", line.consumer));
        }
        if line.dlq.unwrap_or(0) > 0 {
            problems.push(format!(
                "{}: {} dead-lettered message(s) (reliability queue dlq list {})",
                line.consumer,
                line.dlq.unwrap_or(0),
                line.queue
            ));
        }
        if let Some(parked) = line.parked.filter(|n| *n > 0) {
            problems.push(format!(
                "{}: {parked} aggregate(s) parked (reliability park list --consumer {})",
                line.consumer, line.consumer
            ));
        }
        if line.consumers == Some(0) && line.ready.unwrap_or(0) > 0 {
            problems.push(format!(
                "{}: {} message(s) waiting and no consumer attached",
                line.consumer,
                line.ready.unwrap_or(0)
            ));
        }
        consumers.push(line);
    }
    let missing = super::management::missing(estate).await;
    let bindings_checked = missing.is_some();
    problems.extend(missing.unwrap_or_default());
    problems.extend(connections_problem(&conns));
    let refunds_failed = match estate.database(contracts::source::PAYMENTS) {
        Some(pool) => sources::failed_refunds(pool, REFUNDS_FAILED_WINDOW_SECS)
            .await
            .ok(),
        None => None,
    };
    if let Some(failed) = refunds_failed.as_ref().filter(|f| f.count > 0) {
        problems.push(format!(
            "payments: {} refund(s) ended failed in the last 24 h, the latest: {} (runbook: \"A payment or refund is stuck pending\")",
            failed.count,
            failed.latest_error.as_deref().unwrap_or("?")
        ));
    }
    Status {
        outbox,
        connections: conns,
        consumers,
        maintenance: runs,
        admission: Vec::new(),
        refunds_failed,
        bindings_checked,
        problems,
    }
}

/// A consumer's line. An ordered subscription's queue is its partitions:
/// their ready and unacked messages added up, and the fewest consumers any
/// of them has (a partition with none is what stalls).
async fn consumer_line(estate: &Estate, sub: &broker::Subscription) -> ConsumerLine {
    let consumer = sub.consumer;
    let mut line = ConsumerLine {
        consumer: consumer.to_owned(),
        queue: estate.queue(consumer),
        ..ConsumerLine::default()
    };
    let mut spec = broker::QueueSpec::for_subscription(sub, "", &estate.queue_prefix);
    // Checked when the estate was opened.
    if let Ok(Some(k)) = broker::partitions_override(&estate.ordered_partitions, sub) {
        spec.partitions = k;
    }
    let queues = spec.queues();
    if let Some(pool) = estate.consumer_db(consumer) {
        let progress: std::result::Result<(Option<DateTime<Utc>>, Option<i64>), _> =
            sqlx::query_as(
                "SELECT max(updated_at), sum(applied_count)::bigint FROM consumer_offsets WHERE consumer = $1",
            )
            .bind(consumer)
            .fetch_one(pool)
            .await;
        if let Ok((at, applied)) = progress {
            (line.last_applied_at, line.applied) = (at, applied);
        }
        if sub.is_ordered() {
            line.parked =
                sqlx::query_scalar("SELECT count(*) FROM parked_aggregates WHERE consumer = $1")
                    .bind(consumer)
                    .fetch_one(pool)
                    .await
                    .ok();
        }
    }
    if let Some(conn) = &estate.broker {
        for queue in &queues {
            match broker::inspect_queue(conn, queue).await {
                Ok((ready, consumers)) => {
                    line.ready = Some(line.ready.unwrap_or(0) + ready);
                    line.consumers = Some(line.consumers.map_or(consumers, |c| c.min(consumers)));
                }
                Err(e) => {
                    line.error = Some(format!("queue {queue}: {e}"));
                    break;
                }
            }
        }
        let dlq = broker::dead_letter_queue(&line.queue);
        line.dlq = broker::inspect_queue(conn, &dlq)
            .await
            .ok()
            .map(|(ready, _)| ready);
    }
    if let Some(url) = &estate.management_url {
        for queue in &queues {
            let Some(n) = super::management::unacked(url, queue).await else {
                line.unacked = None;
                break;
            };
            line.unacked = Some(line.unacked.unwrap_or(0) + n);
        }
    }
    line
}

/// The server's connections near its limit, said once: the services
/// usually share one server.
fn connections_problem(lines: &[ConnectionsLine]) -> Option<String> {
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
