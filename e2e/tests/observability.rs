//! The dashboard, the alerts and the README ask only for metrics that exist,
//! and every metric the services export is documented.

use std::collections::BTreeSet;
use std::path::Path;

use reliability::metrics::{CATALOGUE, Kind, Metric};

/// Series that are not ours: RabbitMQ's own (scraped from its
/// `/metrics/per-object` in compose) and Prometheus's `up` per target.
const BROKER: &[&str] = &[
    "rabbitmq_queue_messages_ready",
    "rabbitmq_queue_messages_unacked",
    "rabbitmq_queue_consumers",
    "up",
];

/// PromQL words that are not metric names.
const PROMQL: &[&str] = &[
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "topk",
    "bottomk",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "rate",
    "irate",
    "increase",
    "delta",
    "deriv",
    "histogram_quantile",
    "time",
    "vector",
    "scalar",
    "abs",
    "clamp_min",
    "clamp_max",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
];

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn exported() -> Vec<Metric> {
    CATALOGUE
        .iter()
        .chain(service_kit::metrics::CATALOGUE)
        .chain(payments::worker::METRICS)
        .chain(projection::verify::METRICS)
        .chain(graph::verify::METRICS)
        .chain(log_relay::METRICS)
        .copied()
        .collect()
}

/// Every series name a metric makes (a histogram adds `_bucket`, `_sum`, `_count`).
fn series_names() -> BTreeSet<String> {
    let mut names: BTreeSet<String> = BROKER.iter().map(|s| (*s).to_owned()).collect();
    for m in exported() {
        names.insert(m.name.to_owned());
        if m.kind == Kind::Histogram {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{}{suffix}", m.name));
            }
        }
    }
    names
}

/// The metric names a PromQL expression reads: identifiers outside label
/// matchers, grouping clauses, ranges and strings that are not PromQL words.
fn metrics_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth_braces = 0;
    let mut in_range = false;
    let mut in_string = false;
    let mut after_grouping = false;
    let mut grouping_parens = 0;
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut Vec<String>, skip: bool| {
        if !word.is_empty() && !skip && !word.chars().next().unwrap().is_ascii_digit() {
            out.push(std::mem::take(word));
        }
        word.clear();
    };
    for c in expr.chars() {
        if in_string {
            in_string = c != '"';
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
            continue;
        }
        let skip = depth_braces > 0 || in_range || grouping_parens > 0;
        if matches!(word.as_str(), "by" | "without" | "on" | "ignoring") {
            after_grouping = true;
        }
        flush(&mut word, &mut out, skip);
        match c {
            '"' => in_string = true,
            '{' => depth_braces += 1,
            '}' => depth_braces -= 1,
            '[' => in_range = true,
            ']' => in_range = false,
            '(' if after_grouping => {
                grouping_parens += 1;
                after_grouping = false;
            }
            ')' if grouping_parens > 0 => grouping_parens -= 1,
            c if c.is_whitespace() => {}
            _ => after_grouping = false,
        }
    }
    let skip = depth_braces > 0 || in_range || grouping_parens > 0;
    flush(&mut word, &mut out, skip);
    out.retain(|w| !PROMQL.contains(&w.as_str()));
    out
}

fn check(what: &str, expr: &str, known: &BTreeSet<String>, problems: &mut Vec<String>) {
    let names = metrics_in(expr);
    if names.is_empty() {
        problems.push(format!("{what}: `{expr}` names no metric"));
    }
    for name in names {
        if !known.contains(&name) {
            problems.push(format!(
                "{what}: `{expr}` reads {name}, which nothing exports"
            ));
        }
    }
}

#[test]
fn the_parser_finds_metric_names_and_only_them() {
    assert_eq!(
        metrics_in(
            r#"histogram_quantile(0.99, sum by (le, route) (rate(http_request_duration_seconds_bucket{route="/x"}[5m])))"#
        ),
        vec!["http_request_duration_seconds_bucket"]
    );
    assert_eq!(
        metrics_in("time() - max by (step) (maintenance_last_success_timestamp_seconds) > 60"),
        vec!["maintenance_last_success_timestamp_seconds"]
    );
    assert_eq!(metrics_in("outbox_dlq_depth > 0"), vec!["outbox_dlq_depth"]);
}

#[test]
fn every_dashboard_query_reads_an_exported_metric() {
    let known = series_names();
    let text = std::fs::read_to_string(root().join("compose/grafana/dashboards/commerce.json"))
        .expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let mut problems = Vec::new();
    let mut queries = 0;
    let mut read = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("every target has an expr");
            let title = panel["title"].as_str().unwrap_or("?");
            check(&format!("panel {title:?}"), expr, &known, &mut problems);
            read.extend(metrics_in(expr));
            queries += 1;
        }
    }
    assert!(queries > 20, "only {queries} queries");
    // And every exported metric has a panel.
    for m in exported() {
        let shown = read
            .iter()
            .any(|r| r == m.name || r.strip_suffix("_bucket") == Some(m.name));
        if !shown {
            problems.push(format!("{} has no panel", m.name));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_alert_reads_an_exported_metric() {
    let known = series_names();
    let text = std::fs::read_to_string(root().join("compose/prometheus/alerts.yml")).unwrap();
    let mut problems = Vec::new();
    let exprs: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .collect();
    assert!(!exprs.is_empty());
    for expr in exprs {
        check("alert", expr.trim(), &known, &mut problems);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_metrics_catalogue_documents_every_metric() {
    let catalogue = std::fs::read_to_string(root().join("docs/metrics.md")).unwrap();
    let missing: Vec<&str> = exported()
        .iter()
        .map(|m| m.name)
        .filter(|name| !catalogue.contains(&format!("`{name}`")))
        .collect();
    assert!(missing.is_empty(), "docs/metrics.md lacks {missing:?}");
}
