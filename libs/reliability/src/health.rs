//! What `/readyz` reports beyond the database and the broker: each
//! long-running part of a process (the relay, each consumer) says whether it
//! is doing its job, and if not, why (e.g. "broker topology incomplete:
//! queue orders.saga is missing"). A process is ready only when every part
//! is.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Shared by the parts of one process and its `/readyz`.
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<Mutex<BTreeMap<String, Option<String>>>>);

impl Health {
    /// `part` is starting: not ready until it says so.
    pub fn starting(&self, part: &str) {
        self.set(part, Some("starting".to_owned()));
    }

    pub fn ready(&self, part: &str) {
        self.set(part, None);
    }

    pub fn not_ready(&self, part: &str, why: impl ToString) {
        self.set(part, Some(why.to_string()));
    }

    fn set(&self, part: &str, status: Option<String>) {
        self.0
            .lock()
            .expect("health lock poisoned")
            .insert(part.to_owned(), status);
    }

    /// Whether every part is ready, and each part's status ("ok" or why not).
    pub fn report(&self) -> (bool, serde_json::Map<String, serde_json::Value>) {
        let parts = self.0.lock().expect("health lock poisoned");
        let all_ready = parts.values().all(Option::is_none);
        let report = parts
            .iter()
            .map(|(part, status)| {
                (
                    part.clone(),
                    serde_json::Value::String(status.clone().unwrap_or_else(|| "ok".to_owned())),
                )
            })
            .collect();
        (all_ready, report)
    }
}
