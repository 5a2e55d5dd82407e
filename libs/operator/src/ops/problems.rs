//! A problem `status` names: one sentence for a person, and since when it
//! has been true where the stores say (the oldest dead letter, parked
//! aggregate or pending row it counts). The console orders its problems
//! by that age (issue 45): the oldest is usually the cause of the rest.

use std::fmt;
use std::ops::Deref;

use chrono::{DateTime, Utc};
use serde::{Serialize, Serializer};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub text: String,
    /// When the oldest thing it counts began; `None` where nothing says
    /// (a process down, a binding missing).
    pub since: Option<DateTime<Utc>>,
}

impl Problem {
    /// The problem `text`, its age not known.
    pub fn new(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            since: None,
        }
    }

    /// The problem, true since `since`.
    #[must_use]
    pub fn since(mut self, since: Option<DateTime<Utc>>) -> Self {
        self.since = since;
        self
    }

    /// The problem, true for the last `seconds`.
    #[must_use]
    pub fn for_seconds(self, seconds: Option<f64>) -> Self {
        let since = seconds.and_then(|s| {
            chrono::Duration::try_milliseconds((s * 1000.0) as i64).map(|d| Utc::now() - d)
        });
        self.since(since)
    }
}

impl From<String> for Problem {
    fn from(text: String) -> Self {
        Self::new(text)
    }
}

/// A problem reads as its sentence: `status`'s lines and tests match on it.
impl Deref for Problem {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Serialised as its sentence, as `status --json` has always written it.
impl Serialize for Problem {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

/// Orders `problems` by age: those whose start nothing records first
/// (a process down is news, and often the cause), then the oldest first.
pub fn by_age(problems: &mut [Problem]) {
    problems.sort_by_key(|p| (p.since.is_some(), p.since));
}

/// An age as a person reads it: `40 s`, `12 min`, `3 h 5 min`, `2 d 4 h`.
pub fn age(since: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let s = (now - since).num_seconds().max(0);
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..86400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unknown_first_then_the_oldest() {
        let now = Utc::now();
        let ago = |m: i64| Some(now - chrono::Duration::minutes(m));
        let mut p = vec![
            Problem::new("new").since(ago(1)),
            Problem::new("down"),
            Problem::new("old").since(ago(90)),
        ];
        by_age(&mut p);
        let order: Vec<&str> = p.iter().map(|p| &**p).collect();
        assert_eq!(order, ["down", "old", "new"]);
    }

    #[test]
    fn ages_read_in_the_largest_units() {
        let now = Utc::now();
        let ago = |s: i64| now - chrono::Duration::seconds(s);
        assert_eq!(age(ago(40), now), "40 s");
        assert_eq!(age(ago(12 * 60 + 5), now), "12 min");
        assert_eq!(age(ago(3 * 3600 + 5 * 60), now), "3 h 5 min");
        assert_eq!(age(ago(2 * 86400 + 4 * 3600), now), "2 d 4 h");
        assert_eq!(age(ago(-5), now), "0 s", "a clock ahead reads as now");
    }

    #[test]
    fn it_serialises_as_its_sentence() {
        let p = Problem::new("orders: 2 rows").since(Some(Utc::now()));
        assert_eq!(serde_json::to_string(&p).unwrap(), "\"orders: 2 rows\"");
    }
}
