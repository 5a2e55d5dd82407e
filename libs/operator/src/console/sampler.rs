//! The console's memory of what only the processes know (each consumer's
//! event age, reconciliation's findings, verification's drift): every
//! process role's `/metrics`, read every [`SAMPLE_EVERY`], the last hour
//! kept in memory. The rest of the overview's charts come from
//! PostgreSQL (`ops::charts`); a process's histogram is the only record
//! of how old each event was when it was applied.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;

use crate::ops::roles::RoleProbe;
use crate::ops::scrape::{self, Sample};

/// How often every role is read: a Prometheus scrape's usual interval.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(15);
/// An hour of samples, and the one before it.
const KEPT: usize = 3600 / 15 + 1;
const MINUTES: usize = 60;

#[derive(Default)]
pub struct Samples(Mutex<VecDeque<Sample>>);

impl Samples {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn push(&self, sample: Sample) {
        let mut kept = self.lock();
        if kept.len() == KEPT {
            kept.pop_front();
        }
        kept.push_back(sample);
    }

    /// Reads every role now, then every [`SAMPLE_EVERY`], for ever (the
    /// console's process is its lifetime).
    pub async fn run(self: Arc<Self>, host: String, roles: Vec<RoleProbe>) {
        loop {
            self.push(scrape::scrape(&host, &roles).await);
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    }

    /// The latest reading, if any.
    pub fn latest(&self) -> Option<Sample> {
        self.lock().back().cloned()
    }

    /// Each consumer's mean event age over the last interval.
    pub fn event_ages(&self) -> BTreeMap<String, f64> {
        let kept = self.lock();
        match (kept.len().checked_sub(2).map(|i| &kept[i]), kept.back()) {
            (Some(earlier), Some(latest)) => latest.event_ages(earlier),
            _ => BTreeMap::new(),
        }
    }

    /// Each consumer's event age per minute of the last hour (the longest
    /// interval mean of the minute), the oldest first.
    pub fn event_age_chart(&self) -> BTreeMap<String, Vec<f64>> {
        let kept = self.lock();
        let now = Utc::now();
        let mut charts: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for (earlier, later) in kept.iter().zip(kept.iter().skip(1)) {
            let Ok(ago) = usize::try_from((now - later.at).num_minutes()) else {
                continue;
            };
            if ago >= MINUTES {
                continue;
            }
            for (consumer, age) in later.event_ages(earlier) {
                let points = charts.entry(consumer).or_insert_with(|| vec![0.0; MINUTES]);
                let p = &mut points[MINUTES - 1 - ago];
                *p = p.max(age);
            }
        }
        charts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs_ago: i64, sum: f64, count: f64) -> Sample {
        let mut s = Sample {
            at: Utc::now() - chrono::Duration::seconds(secs_ago),
            ..Sample::default()
        };
        let text = format!(
            "consumer_event_age_seconds_sum{{consumer=\"c\"}} {sum}\n\
             consumer_event_age_seconds_count{{consumer=\"c\"}} {count}\n"
        );
        scrape::parse(&text, &mut s.series);
        s
    }

    #[test]
    fn the_last_interval_is_the_age_now_and_each_minute_keeps_its_longest() {
        let samples = Samples::default();
        assert!(samples.event_ages().is_empty(), "nothing read yet");
        samples.push(at(150, 0.0, 0.0));
        samples.push(at(135, 10.0, 2.0)); // 5 s each, two minutes ago
        samples.push(at(120, 12.0, 4.0)); // 1 s each
        samples.push(at(5, 13.0, 5.0)); // 1 s, now
        assert_eq!(samples.event_ages()["c"], 1.0);
        let chart = &samples.event_age_chart()["c"];
        assert_eq!(chart.len(), MINUTES);
        assert_eq!(chart[MINUTES - 1], 1.0);
        assert_eq!(chart[MINUTES - 3], 5.0, "{chart:?}");
        for _ in 0..KEPT {
            samples.push(at(0, 13.0, 5.0));
        }
        assert_eq!(samples.lock().len(), KEPT, "an hour kept, no more");
    }
}
