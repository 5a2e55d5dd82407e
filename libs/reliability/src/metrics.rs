//! The Prometheus recorder, `/metrics`, and the catalogue of every metric
//! the library records: one list that gives each its HELP text, documents it
//! (README, runbook) and lets CI check that the dashboard asks only for
//! metrics that exist.
//!
//! Names follow Prometheus conventions: counters end in `_total`, durations
//! in `_seconds`. Views whose label set changes from one scrape to the next
//! (the top tenants of an outbox) are [`Family`]s: replaced whole at each
//! refresh and rendered after the recorder's output, so a tenant that left
//! the top N leaves no stale series behind.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric: its name, kind, labels and what it means.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

impl Metric {
    /// A catalogue entry; `const`, so that each catalogue is a static list.
    pub const fn new(
        name: &'static str,
        kind: Kind,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Self {
        Self {
            name,
            kind,
            labels,
            help,
        }
    }
}

pub mod process;

pub const BUILD_INFO: &str = "build_info";
pub const PROCESS_CPU: &str = "process_cpu_seconds";
pub const PROCESS_RESIDENT_MEMORY: &str = "process_resident_memory_bytes";
pub const PROCESS_OPEN_FDS: &str = "process_open_fds";
pub const PROCESS_START_TIME: &str = "process_start_time_seconds";
pub const DB_POOL_CONNECTIONS: &str = "db_pool_connections";
pub const DB_POOL_MAX: &str = "db_pool_max_connections";
pub const OUTBOX_PUBLISHED: &str = "outbox_published_total";
pub const OUTBOX_PUBLISH_FAILURES: &str = "outbox_publish_failures_total";
pub const OUTBOX_UNCONFIRMED: &str = "outbox_unconfirmed_total";
pub const OUTBOX_LAG: &str = "outbox_lag_seconds";
pub const OUTBOX_PENDING: &str = "outbox_pending";
pub const OUTBOX_DLQ_DEPTH: &str = "outbox_dlq_depth";
pub const OUTBOX_MAX_ATTEMPTS: &str = "outbox_max_attempts";
pub const OUTBOX_TENANT_PENDING: &str = "outbox_tenant_pending";
pub const OUTBOX_TENANT_LAG: &str = "outbox_tenant_lag_seconds";
pub const OUTBOX_BROKER_BLOCKED: &str = "outbox_broker_blocked";
pub const CONSUMER_MESSAGES: &str = "consumer_messages_total";
pub const CONSUMER_RETRIES: &str = "consumer_retries_total";
pub const CONSUMER_DEAD_LETTERED: &str = "consumer_dead_lettered_total";
pub const CONSUMER_GROUP_FALLBACKS: &str = "consumer_group_fallbacks_total";
pub const CONSUMER_GATHERED: &str = "consumer_gathered_total";
pub const CONSUMER_REDELIVERED: &str = "consumer_redelivered_total";
pub const CONSUMER_LANE_RESTARTS: &str = "consumer_lane_restarts_total";
pub const CONSUMER_QUEUE_DEPTH: &str = "consumer_queue_depth";
pub const CONSUMER_DLQ_DEPTH: &str = "consumer_dlq_depth";
pub const CONSUMER_LAST_APPLIED: &str = "consumer_last_applied_timestamp_seconds";
pub const CONSUMER_PARKED: &str = "consumer_parked_events_total";
pub const CONSUMER_PARKED_AGGREGATES: &str = "consumer_parked_aggregates";
pub const CONSUMER_PARKED_OLDEST: &str = "consumer_parked_oldest_seconds";
pub const CONSUMER_HELD: &str = "consumer_held_aggregates_total";
pub const CONSUMER_GAPS_SKIPPED: &str = "consumer_gaps_skipped_total";
pub const CONSUMER_EVENT_AGE: &str = "consumer_event_age_seconds";
pub const MAINTENANCE_LAST_SUCCESS: &str = "maintenance_last_success_timestamp_seconds";
pub const MAINTENANCE_ERRORS: &str = "maintenance_errors_total";

use Kind::{Counter, Gauge, Histogram};

/// The per-tenant outbox view ([`Family`]s: the top tenants change).
pub const OUTBOX_TENANT_PENDING_METRIC: Metric = Metric::new(
    OUTBOX_TENANT_PENDING,
    Gauge,
    &["source", "tenant"],
    "Unpublished outbox rows of the top tenants by backlog; the rest summed as tenant=\"other\".",
);
pub const OUTBOX_TENANT_LAG_METRIC: Metric = Metric::new(
    OUTBOX_TENANT_LAG,
    Gauge,
    &["source", "tenant"],
    "Age of the oldest unpublished row of each top tenant (\"other\": the oldest of the rest).",
);

/// Every metric this crate records, with its labels and HELP text.
#[rustfmt::skip]
pub const CATALOGUE: &[Metric] = &[
    Metric::new(BUILD_INFO, Gauge, &["service", "role", "version", "commit"], "Always 1; the labels say what runs."),
    Metric::new(PROCESS_CPU, Gauge, &[], "CPU time (user and system) the process has used since it started, in seconds (a gauge read from /proc; rate() it)."),
    Metric::new(PROCESS_RESIDENT_MEMORY, Gauge, &[], "Resident memory of the process."),
    Metric::new(PROCESS_OPEN_FDS, Gauge, &[], "File descriptors the process holds open (sockets included)."),
    Metric::new(PROCESS_START_TIME, Gauge, &[], "When the process started (Unix seconds)."),
    Metric::new(DB_POOL_CONNECTIONS, Gauge, &["pool", "state"], "Connections of each pool (app, relay, owner), idle or in use."),
    Metric::new(DB_POOL_MAX, Gauge, &["pool"], "The most connections each pool may open."),
    Metric::new(OUTBOX_PUBLISHED, Counter, &["source"], "Outbox rows published and confirmed by the broker."),
    Metric::new(OUTBOX_PUBLISH_FAILURES, Counter, &["source", "event_type"], "Outbox publishes that failed (the row is retried with backoff)."),
    Metric::new(OUTBOX_UNCONFIRMED, Counter, &["source"], "Publishes not confirmed: no confirm in time, or nacked by a queue that could not take them (the row is published again, no attempt spent)."),
    Metric::new(OUTBOX_LAG, Gauge, &["source"], "Age of the oldest unpublished outbox row."),
    Metric::new(OUTBOX_PENDING, Gauge, &["source"], "Outbox rows not yet published."),
    Metric::new(OUTBOX_DLQ_DEPTH, Gauge, &["source"], "Rows in outbox_messages_dlq (attempts exhausted)."),
    Metric::new(OUTBOX_MAX_ATTEMPTS, Gauge, &["source"], "Most failed attempts of a row still pending."),
    Metric::new(OUTBOX_BROKER_BLOCKED, Gauge, &["source"], "1 while the broker blocks the relay's connection (a memory or disk alarm): the relay waits on it, claiming nothing."),
    OUTBOX_TENANT_PENDING_METRIC,
    OUTBOX_TENANT_LAG_METRIC,
    Metric::new(CONSUMER_MESSAGES, Counter, &["consumer", "outcome"], "Deliveries finished: applied, or duplicate (already applied)."),
    Metric::new(CONSUMER_RETRIES, Counter, &["consumer"], "Failed tries that were retried."),
    Metric::new(CONSUMER_DEAD_LETTERED, Counter, &["consumer", "reason"], "Deliveries sent to the consumer's DLQ."),
    Metric::new(CONSUMER_GROUP_FALLBACKS, Counter, &["consumer"], "Grouped commits that failed and were applied one delivery at a time."),
    Metric::new(CONSUMER_GATHERED, Counter, &["consumer"], "Events committed in another lane's transaction: groups that waited for a lane's commit and went with the next."),
    Metric::new(CONSUMER_REDELIVERED, Counter, &["consumer"], "Deliveries that came back: a channel or connection closed before acking them (each counts toward the queue's delivery limit)."),
    Metric::new(CONSUMER_LANE_RESTARTS, Counter, &["consumer"], "Lanes that lost their connection or channel and reconnected on their own, the other lanes going on."),
    Metric::new(CONSUMER_QUEUE_DEPTH, Gauge, &["consumer"], "Messages ready in the consumer's queue (its lag, in messages)."),
    Metric::new(CONSUMER_DLQ_DEPTH, Gauge, &["consumer"], "Messages waiting in the consumer's DLQ."),
    Metric::new(CONSUMER_LAST_APPLIED, Gauge, &["consumer"], "When this process last finished a delivery (Unix seconds)."),
    Metric::new(CONSUMER_PARKED, Counter, &["consumer"], "Events of an ordered subscription parked: the one that failed for good, and each later event of its aggregate."),
    Metric::new(CONSUMER_PARKED_AGGREGATES, Gauge, &["consumer"], "Aggregates of an ordered subscription parked, waiting for an operator (reliability park)."),
    Metric::new(CONSUMER_PARKED_OLDEST, Gauge, &["consumer"], "Age of the oldest parked aggregate (0: none)."),
    Metric::new(CONSUMER_HELD, Counter, &["consumer"], "Aggregates of a whole ordered subscription held for a number skipped, their later events waiting for it (docs/adr/0040)."),
    Metric::new(CONSUMER_GAPS_SKIPPED, Counter, &["consumer"], "Gaps a held aggregate was replayed over: a number skipped that did not come within the bound."),
    Metric::new(CONSUMER_EVENT_AGE, Histogram, &["consumer"], "Age of each event this consumer applied, from its occurred_at to its apply (buckets to an hour)."),
    Metric::new(MAINTENANCE_LAST_SUCCESS, Gauge, &["step"], "When each maintenance step last succeeded (Unix seconds)."),
    Metric::new(MAINTENANCE_ERRORS, Counter, &["step"], "Maintenance step runs that failed."),
];

/// `consumer_event_age_seconds`'s buckets, in seconds.
pub const EVENT_AGE_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0, 3600.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once (later calls, e.g. from several
/// in-process test apps, get the same handle), gives every catalogued
/// metric its HELP text, and keeps the recorder tidy.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(&[
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0,
                ])
                .expect("bucket list is not empty")
                // An event's age spans milliseconds (flowing) to an hour
                // (an outage drained): the request buckets stop at 10 s.
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full(CONSUMER_EVENT_AGE.to_owned()),
                    EVENT_AGE_BUCKETS,
                )
                .expect("bucket list is not empty")
                .install_recorder()
                .expect("no other metrics recorder is installed in this process");
            describe(CATALOGUE);
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                })
                .expect("spawning a thread");
            handle
        })
        .clone()
}

/// Gives metrics their HELP text (a service calls it for its own).
pub fn describe(metrics: &[Metric]) {
    for metric in metrics {
        match metric.kind {
            Kind::Counter => metrics::describe_counter!(metric.name, metric.help),
            Kind::Gauge => metrics::describe_gauge!(metric.name, metric.help),
            Kind::Histogram => metrics::describe_histogram!(metric.name, metric.help),
        }
    }
}

/// `build_info{service, role, version} 1`.
pub fn build_info(service: &str, role: &str) {
    metrics::gauge!(BUILD_INFO, "service" => service.to_owned(), "role" => role.to_owned(),
                    "version" => env!("CARGO_PKG_VERSION"), "commit" => COMMIT)
    .set(1.0);
}

/// The commit a binary was built from: `GIT_COMMIT` at build time (the
/// image's build argument), else `unknown`. Read at build time, not from
/// `.git` by a build script, which would rebuild every crate on every
/// commit.
pub const COMMIT: &str = match option_env!("GIT_COMMIT") {
    Some(c) => c,
    None => "unknown",
};

/// A gauge whose series are replaced whole at each [`Family::set`].
pub struct Family {
    pub metric: &'static Metric,
}

type Series = BTreeMap<Vec<(&'static str, String)>, f64>;

fn families() -> &'static Mutex<BTreeMap<(&'static str, String), Series>> {
    static FAMILIES: OnceLock<Mutex<BTreeMap<(&'static str, String), Series>>> = OnceLock::new();
    FAMILIES.get_or_init(Default::default)
}

impl Family {
    pub const fn new(metric: &'static Metric) -> Self {
        Self { metric }
    }

    /// Replaces the series this `owner` (e.g. one source's relay) exported
    /// last time with `series`: label values in the order of the metric's labels.
    pub fn set(&self, owner: &str, series: impl IntoIterator<Item = (Vec<String>, f64)>) {
        let series = series
            .into_iter()
            .map(|(values, v)| (self.metric.labels.iter().copied().zip(values).collect(), v))
            .collect();
        families()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((self.metric.name, owner.to_owned()), series);
    }
}

fn escape(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('"', r#"\""#)
        .replace('\n', r"\n")
}

fn render_families() -> String {
    let families = families()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out = String::new();
    let mut last = "";
    for ((name, _owner), series) in families.iter() {
        if *name != last {
            let help = CATALOGUE
                .iter()
                .find(|m| m.name == *name)
                .map_or("", |m| m.help);
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            last = name;
        }
        for (labels, value) in series {
            let labels: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(out, "{name}{{{}}} {value}", labels.join(","));
        }
    }
    out
}

/// The recorder's output followed by the families.
pub fn render(handle: &PrometheusHandle) -> String {
    let mut text = handle.render();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&render_families());
    text
}

/// `GET /metrics` in Prometheus text format. Needs no token.
pub fn router<S: Clone + Send + Sync + 'static>(handle: PrometheusHandle) -> Router<S> {
    Router::new().route("/metrics", get(move || std::future::ready(render(&handle))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_prometheus_conventions() {
        let mut seen = std::collections::HashSet::new();
        for metric in CATALOGUE {
            assert!(seen.insert(metric.name), "{} listed twice", metric.name);
            assert!(!metric.help.is_empty(), "{} has no HELP", metric.name);
            match metric.kind {
                Kind::Counter => assert!(metric.name.ends_with("_total"), "{}", metric.name),
                _ => assert!(!metric.name.ends_with("_total"), "{}", metric.name),
            }
            if metric.kind == Kind::Histogram {
                assert!(metric.name.ends_with("_seconds"), "{}", metric.name);
            }
        }
    }

    #[test]
    fn a_family_replaces_its_series_whole() {
        static M: Metric = Metric::new("test_family", Kind::Gauge, &["source", "tenant"], "test");
        let family = Family::new(&M);
        family.set("a", [(vec!["a".into(), "1".into()], 3.0)]);
        family.set("a", [(vec!["a".into(), "2\"x".into()], 4.0)]);
        let text = render_families();
        assert!(
            text.contains(r#"test_family{source="a",tenant="2\"x"} 4"#),
            "{text}"
        );
        assert!(!text.contains(r#"tenant="1""#), "{text}");
        assert_eq!(text.matches("# TYPE test_family gauge").count(), 1);
    }
}
