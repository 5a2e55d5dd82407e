//! `reliability status`: per service the outbox, per consumer its queue,
//! DLQ and last apply, per maintenance step its last run; and the problems
//! among them, named.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::connections::{connections, connections_problem};
use super::problems::Problem;
use super::{Estate, outbox};
use reliability::{TenantId, broker};
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
    /// Payments and refunds whose latest request's outcome is unknown
    /// (payments' database).
    pub in_doubt: Option<sources::InDoubt>,
    /// What needs an operator, one sentence each; empty when all is well.
    pub problems: Vec<Problem>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OutboxLine {
    pub service: String,
    #[serde(flatten)]
    pub status: Option<outbox::OutboxStatus>,
    pub error: Option<String>,
}

pub use super::connections::ConnectionsLine;
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
                    count(*) FILTER (WHERE {since} <= now() - make_interval(secs => $1)),
                    min({since}) FILTER (WHERE {since} <= now() - make_interval(secs => $1))
             FROM {table} WHERE {in_flight} GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT {ADMISSION_TOP}"
        );
        let rows: Vec<(i64, i64, i64, Option<DateTime<Utc>>)> =
            match sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(limits.stuck_after.as_secs_f64())
                .fetch_all(pool)
                .await
            {
                Ok(rows) => rows,
                Err(e) => {
                    let problem = format!("{}: work in flight not counted: {e}", w.service);
                    status.problems.push(problem.into());
                    continue;
                }
            };
        for (tenant_id, in_flight, stuck, stuck_since) in rows {
            let bound = TenantId::new(tenant_id).map_or(limits.default, |t| limits.bound(t));
            if stuck > 0 {
                let problem = format!(
                    "{}: tenant {tenant_id} has {stuck} order(s) undecided for over {} s: stuck, no longer counted against its bound (`reliability explain order`; runbook: \"Orders stay pending\")",
                    w.service,
                    limits.stuck_after.as_secs()
                );
                status
                    .problems
                    .push(Problem::new(problem).since(stuck_since));
            }
            if bound > 0 && in_flight >= i64::from(bound) {
                status.problems.push(Problem::new(format!(
                    "{}: tenant {tenant_id} is at its admission bound ({in_flight} in flight of {bound}): its new work gets 429 until the pipeline decides some",
                    w.service
                )));
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
    /// When the oldest of its recorded dead letters and parked aggregates
    /// was set aside.
    pub dlq_since: Option<DateTime<Utc>>,
    pub parked_since: Option<DateTime<Utc>>,
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
/// Past this age, a payment or refund in doubt is a problem: the worker's
/// look-ups by key settle one within the provider's grace (minutes).
const IN_DOUBT_PROBLEM_SECS: f64 = 600.0;

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
            (_, Some(e)) => problems.push(format!("{service}: database unreachable: {e}").into()),
            (Some(s), None) => {
                if s.dlq > 0 {
                    let problem = format!(
                        "{service}: {} outbox row(s) in the DLQ table (reliability outbox dlq list --service {service})",
                        s.dlq
                    );
                    problems.push(Problem::new(problem).since(s.dlq_oldest_at));
                }
                if s.oldest_pending_seconds.unwrap_or(0.0) > OUTBOX_LAG_PROBLEM_SECS {
                    let problem = format!(
                        "{service}: {} row(s) pending, the oldest {:.0} s: is its relay running?",
                        s.pending,
                        s.oldest_pending_seconds.unwrap_or(0.0)
                    );
                    problems.push(Problem::new(problem).for_seconds(s.oldest_pending_seconds));
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
                    let problem = format!(
                        "{service}: maintenance step {} failed last: {}",
                        run.step,
                        run.last_error.as_deref().unwrap_or("?")
                    );
                    problems.push(Problem::new(problem).since(run.last_failure_at));
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
            problems.push(format!("{}: {e}", line.consumer).into());
        }
        if line.dlq.unwrap_or(0) > 0 {
            let problem = format!(
                "{}: {} dead-lettered message(s) (reliability queue dlq list {})",
                line.consumer,
                line.dlq.unwrap_or(0),
                line.queue
            );
            problems.push(Problem::new(problem).since(line.dlq_since));
        }
        if let Some(parked) = line.parked.filter(|n| *n > 0) {
            let problem = format!(
                "{}: {parked} aggregate(s) parked (reliability park list --consumer {})",
                line.consumer, line.consumer
            );
            problems.push(Problem::new(problem).since(line.parked_since));
        }
        if line.consumers == Some(0) && line.ready.unwrap_or(0) > 0 {
            problems.push(Problem::new(format!(
                "{}: {} message(s) waiting and no consumer attached",
                line.consumer,
                line.ready.unwrap_or(0)
            )));
        }
        consumers.push(line);
    }
    let missing = super::management::missing(estate).await;
    let bindings_checked = missing.is_some();
    problems.extend(missing.unwrap_or_default().into_iter().map(Problem::from));
    problems.extend(connections_problem(&conns).map(Problem::from));
    let refunds_failed = match estate.database(contracts::source::PAYMENTS) {
        Some(pool) => sources::failed_refunds(pool, REFUNDS_FAILED_WINDOW_SECS)
            .await
            .ok(),
        None => None,
    };
    if let Some(failed) = refunds_failed.as_ref().filter(|f| f.count > 0) {
        let problem = format!(
            "payments: {} refund(s) ended failed in the last 24 h, the latest: {} (runbook: \"A payment or refund is stuck pending\")",
            failed.count,
            failed.latest_error.as_deref().unwrap_or("?")
        );
        problems.push(Problem::new(problem).for_seconds(failed.first_seconds_ago));
    }
    let in_doubt = match estate.database(contracts::source::PAYMENTS) {
        Some(pool) => sources::in_doubt(pool).await.ok(),
        None => None,
    };
    if let Some(d) = in_doubt
        .as_ref()
        .filter(|d| d.oldest_seconds_ago.unwrap_or(0.0) > IN_DOUBT_PROBLEM_SECS)
    {
        let problem = format!(
            "payments: {} payment(s) and {} refund(s) in doubt, the oldest request sent {:.0} s ago: the provider's look-ups by key have not settled them (runbook: \"A payment or refund is stuck pending\")",
            d.payments,
            d.refunds,
            d.oldest_seconds_ago.unwrap_or(0.0)
        );
        problems.push(Problem::new(problem).for_seconds(d.oldest_seconds_ago));
    }
    Status {
        outbox,
        connections: conns,
        consumers,
        maintenance: runs,
        admission: Vec::new(),
        refunds_failed,
        in_doubt,
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
        // A cause outlives its letter once the letter is re-driven and
        // applied: the oldest cause of an event not applied is the DLQ's age.
        let since = sqlx::query_scalar(
            "SELECT min(c.dead_lettered_at) FROM dead_letter_causes c
             WHERE c.consumer = $1 AND NOT EXISTS (
               SELECT 1 FROM processed_messages p
               WHERE (p.tenant_id, p.consumer, p.source, p.message_id)
                   = (c.tenant_id, c.consumer, c.source, c.message_id))",
        );
        line.dlq_since = since.bind(consumer).fetch_one(pool).await.ok().flatten();
        if sub.is_ordered() {
            let parked: Option<(i64, Option<DateTime<Utc>>)> = sqlx::query_as(
                // A held aggregate waits for its event, not for an operator (ADR 0040).
                "SELECT count(*), min(parked_at) FROM parked_aggregates WHERE consumer = $1 AND held_until IS NULL",
            )
            .bind(consumer)
            .fetch_one(pool)
            .await
            .ok();
            (line.parked, line.parked_since) = (parked.map(|p| p.0), parked.and_then(|p| p.1));
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
