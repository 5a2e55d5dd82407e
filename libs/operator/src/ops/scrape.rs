//! What only a process knows, read from its ops port's `/metrics`: each
//! consumer's event age (`consumer_event_age_seconds`), reconciliation's
//! findings and verification's drift. The console samples these (issue
//! 45); the names are the services' own, held to them by
//! `e2e/tests/operator.rs`.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::join_all;

use super::roles::RoleProbe;

/// The event age histogram's running sum and count, per `consumer`.
pub const EVENT_AGE_SUM: &str = "consumer_event_age_seconds_sum";
pub const EVENT_AGE_COUNT: &str = "consumer_event_age_seconds_count";
/// Differences a view had from its sources at its last verification pass
/// (`projection_verify_differences{view}`, the graph's alike).
pub const DRIFT_SUFFIX: &str = "_verify_differences";
/// Reconciliation's findings and repairs since its process started, per
/// `kind` (`payments_reconciliation_…`).
pub const FINDINGS_SUFFIX: &str = "_reconciliation_mismatches_total";
pub const REPAIRS_SUFFIX: &str = "_reconciliation_repairs_total";

/// How long a role has to answer: a frozen process is skipped.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// One reading of every role's series of interest, summed over roles:
/// `(name, labels as written)` → value.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub at: DateTime<Utc>,
    pub series: BTreeMap<(String, String), f64>,
}

fn wanted(name: &str) -> bool {
    name == EVENT_AGE_SUM
        || name == EVENT_AGE_COUNT
        || name.ends_with(DRIFT_SUFFIX)
        || name.ends_with(FINDINGS_SUFFIX)
        || name.ends_with(REPAIRS_SUFFIX)
}

/// Adds the wanted series of one `/metrics` text to `into`.
pub fn parse(text: &str, into: &mut BTreeMap<(String, String), f64>) {
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = match key.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (key, ""),
        };
        if !wanted(name) {
            continue;
        }
        if let Ok(v) = value.parse::<f64>() {
            *into
                .entry((name.to_owned(), labels.to_owned()))
                .or_default() += v;
        }
    }
}

/// The value of `label` in labels as `/metrics` writes them.
pub fn label<'a>(labels: &'a str, label: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == label).then(|| v.trim().trim_matches('"'))
    })
}

/// Reads every role's `/metrics` at once; a role that does not answer
/// adds nothing (the overview's roles table says it is down).
pub async fn scrape(host: &str, probes: &[RoleProbe]) -> Sample {
    let http = reqwest::Client::builder()
        .timeout(SCRAPE_TIMEOUT)
        .build()
        .expect("an HTTP client with a timeout");
    let texts = join_all(probes.iter().map(|p| {
        let http = http.clone();
        let url = format!("http://{host}:{}/metrics", p.port);
        async move { http.get(&url).send().await.ok()?.text().await.ok() }
    }))
    .await;
    let mut sample = Sample {
        at: Utc::now(),
        ..Sample::default()
    };
    for text in texts.into_iter().flatten() {
        parse(&text, &mut sample.series);
    }
    sample
}

impl Sample {
    /// Every series named `name` (or ending in it, with `suffix`), with
    /// the value of `by` in its labels.
    pub fn values<'a>(
        &'a self,
        name: &'a str,
        suffix: bool,
        by: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a str, f64)> + 'a {
        self.series.iter().filter_map(move |((n, labels), v)| {
            let hit = if suffix { n.ends_with(name) } else { n == name };
            hit.then(|| (n.as_str(), label(labels, by).unwrap_or(""), *v))
        })
    }

    /// Each consumer's mean event age over the applies between `earlier`
    /// and this sample; a consumer that applied nothing has none.
    pub fn event_ages(&self, earlier: &Sample) -> BTreeMap<String, f64> {
        let totals = |s: &Sample| -> BTreeMap<String, (f64, f64)> {
            let mut t: BTreeMap<String, (f64, f64)> = BTreeMap::new();
            for (_, consumer, v) in s.values(EVENT_AGE_SUM, false, "consumer") {
                t.entry(consumer.to_owned()).or_default().0 += v;
            }
            for (_, consumer, v) in s.values(EVENT_AGE_COUNT, false, "consumer") {
                t.entry(consumer.to_owned()).or_default().1 += v;
            }
            t
        };
        let before = totals(earlier);
        totals(self)
            .into_iter()
            .filter_map(|(consumer, (sum, count))| {
                let (sum0, count0) = before.get(&consumer).copied().unwrap_or_default();
                // A process that restarted counts from zero again.
                let (ds, dc) = if count >= count0 {
                    (sum - sum0, count - count0)
                } else {
                    (sum, count)
                };
                (dc > 0.0).then(|| (consumer, ds / dc))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP consumer_event_age_seconds Age
# TYPE consumer_event_age_seconds histogram
consumer_event_age_seconds_bucket{consumer="orders.saga",le="0.1"} 3
consumer_event_age_seconds_sum{consumer="orders.saga"} 1.5
consumer_event_age_seconds_count{consumer="orders.saga"} 3
payments_reconciliation_mismatches_total{kind="unknown_key"} 2
payments_reconciliation_repairs_total{kind="unknown_key"} 0
projection_verify_differences{view="orders"} 4
http_requests_total{path="/orders"} 9
"#;

    fn sample(text: &str) -> Sample {
        let mut s = Sample::default();
        parse(text, &mut s.series);
        s
    }

    #[test]
    fn it_keeps_the_series_it_shows_and_sums_them_over_roles() {
        let mut s = sample(TEXT);
        parse(TEXT, &mut s.series);
        assert_eq!(s.series.len(), 5, "{:?}", s.series);
        let drift: Vec<_> = s.values(DRIFT_SUFFIX, true, "view").collect();
        assert_eq!(drift, [("projection_verify_differences", "orders", 8.0)]);
    }

    #[test]
    fn event_age_is_the_mean_over_the_applies_between_two_samples() {
        let earlier = sample(TEXT);
        let later = sample(
            "consumer_event_age_seconds_sum{consumer=\"orders.saga\"} 5.5\n\
             consumer_event_age_seconds_count{consumer=\"orders.saga\"} 5\n",
        );
        assert_eq!(later.event_ages(&earlier)["orders.saga"], 2.0);
        assert!(earlier.event_ages(&earlier).is_empty(), "nothing applied");
        // Restarted: its totals start again.
        let restarted = sample(
            "consumer_event_age_seconds_sum{consumer=\"orders.saga\"} 0.5\n\
             consumer_event_age_seconds_count{consumer=\"orders.saga\"} 1\n",
        );
        assert_eq!(restarted.event_ages(&earlier)["orders.saga"], 0.5);
    }
}
