//! Named crash points, off unless a test or an operator turns them on.
//!
//! The e2e suite needs a process to die at exact places (after the broker
//! confirmed, before the row is marked; after commit, before ack). Each
//! component holds its own [`FailPoints`], built from the environment
//! (`RELIABILITY_FAILPOINTS=relay.after_confirm=abort,consumer.after_commit=error`)
//! or set by a test, so tests running in one process do not interfere.
//!
//! - `error`: the component returns [`crate::Error::FailPoint`] and stops as a
//!   crashed process would (its transaction rolls back, deliveries stay unacked);
//! - `abort`: the process aborts on the spot, like `kill -9`;
//! - `freeze`: the process stops itself (SIGSTOP) on the spot, as a paused
//!   VM or a long stall would: its transaction, locks, connections and
//!   unacked deliveries stay held until something sends it SIGCONT;
//! - `permanent` (the handler point only): the handler fails for good, as
//!   one with a bug on some data does;
//! - `crash` (the handler point only): the consumer stops as a crashed
//!   process would, in a test where `abort` would take the test down (the
//!   handler point's `error` is a failure the handler retries).
//!
//! A point fires once unless written `name=error*` / `name=abort*` (every time).
//! The handler point may be narrowed to one consumer,
//! `consumer.handler@<consumer>` (its process's other consumers untouched),
//! or to one consumer's events of one aggregate,
//! `consumer.handler@<consumer>/<tenant>/<type>:<id>`, e.g.
//! `consumer.handler@projection.history/7/product:SKU-1=permanent*` (a
//! poison aggregate, its neighbours untouched).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::{Error, Result};

/// Relay: the broker confirmed the batch; `processed_at` not yet written.
pub const RELAY_AFTER_CONFIRM: &str = "relay.after_confirm";
/// Relay: the batch is claimed; nothing published yet.
pub const RELAY_BEFORE_PUBLISH: &str = "relay.before_publish";
/// Relay: the batch is published; the broker's confirms not yet awaited.
pub const RELAY_BEFORE_CONFIRM: &str = "relay.before_confirm";
/// Consumer: the handler fails (`error`: a transient failure, retried and
/// then dead-lettered, the way a handler with a bug fails).
pub const CONSUMER_HANDLER: &str = "consumer.handler";
/// Consumer: the handler ran inside the transaction; not committed.
pub const CONSUMER_BEFORE_COMMIT: &str = "consumer.before_commit";
/// Consumer: committed; the delivery not yet acked.
pub const CONSUMER_AFTER_COMMIT: &str = "consumer.after_commit";
/// Consumer, one lane: `error` makes the broker close that lane's channel
/// (the lane acks a tag it was never given: 406), as a delivery
/// acknowledgement timeout or any channel error would. Not a crash: the
/// process goes on.
pub const CONSUMER_LANE_CHANNEL: &str = "consumer.lane_channel";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Error,
    Abort,
    Freeze,
    Permanent,
    Crash,
}

#[derive(Debug, Clone, Copy)]
struct Armed {
    action: Action,
    repeat: bool,
}

#[derive(Debug, Clone, Default)]
pub struct FailPoints(Arc<Mutex<HashMap<String, Armed>>>);

impl FailPoints {
    /// No point armed.
    pub fn none() -> Self {
        Self::default()
    }

    pub fn parse(spec: &str) -> Result<Self> {
        let points = Self::none();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, action) = item
                .split_once('=')
                .ok_or_else(|| Error::Config(format!("fail point `{item}` needs name=action")))?;
            let (action, repeat) = match action.strip_suffix('*') {
                Some(a) => (a, true),
                None => (action, false),
            };
            let action = match action {
                "error" => Action::Error,
                "abort" => Action::Abort,
                "freeze" => Action::Freeze,
                "permanent" => Action::Permanent,
                "crash" => Action::Crash,
                other => {
                    return Err(Error::Config(format!(
                        "unknown fail point action `{other}`"
                    )));
                }
            };
            points.arm_with(name, action, repeat);
        }
        Ok(points)
    }

    /// Arms `name` to fire once with `action`.
    pub fn arm(&self, name: &str, action: Action) {
        self.arm_with(name, action, false);
    }

    fn arm_with(&self, name: &str, action: Action, repeat: bool) {
        self.0
            .lock()
            .expect("fail point registry poisoned")
            .insert(name.to_owned(), Armed { action, repeat });
    }

    /// Whether any point is armed (a caller may then build scoped names).
    pub fn any_armed(&self) -> bool {
        !self
            .0
            .lock()
            .expect("fail point registry poisoned")
            .is_empty()
    }

    /// Fires `name` if armed.
    pub fn check(&self, name: &'static str) -> Result<()> {
        match self.fire(name) {
            Some(Action::Error | Action::Permanent) => Err(Error::FailPoint(name)),
            _ => Ok(()),
        }
    }

    /// Fires `name` if armed: aborts or freezes on the spot, or returns the
    /// failure the caller must produce (`Error` or `Permanent`).
    pub fn fire(&self, name: &str) -> Option<Action> {
        let fired = {
            let mut map = self.0.lock().expect("fail point registry poisoned");
            match map.get(name).copied() {
                Some(armed) if armed.repeat => Some(armed.action),
                Some(armed) => {
                    map.remove(name);
                    Some(armed.action)
                }
                None => None,
            }
        };
        match fired {
            None => None,
            Some(action @ (Action::Error | Action::Permanent | Action::Crash)) => {
                tracing::warn!(
                    fail_point = name,
                    ?action,
                    "fail point fired: failing as if crashed or broken"
                );
                Some(action)
            }
            Some(Action::Abort) => {
                tracing::warn!(fail_point = name, "fail point fired: aborting the process");
                std::process::abort()
            }
            Some(Action::Freeze) => {
                tracing::warn!(
                    fail_point = name,
                    "fail point fired: freezing the process (SIGSTOP)"
                );
                // kill(1), not libc: the crate forbids unsafe code. Returns
                // once thawed; the process then goes on as a stalled one would.
                let _ = std::process::Command::new("kill")
                    .args(["-STOP", &std::process::id().to_string()])
                    .status();
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_fires_once_unless_starred() {
        let fp = FailPoints::parse("a=error, b=error*").unwrap();
        assert!(fp.check("a").is_err());
        assert!(fp.check("a").is_ok());
        assert!(fp.check("b").is_err());
        assert!(fp.check("b").is_err());
        assert!(fp.check("c").is_ok());
    }

    #[test]
    fn a_scoped_permanent_point_fires_for_its_scope_only() {
        let fp = FailPoints::parse("consumer.handler@c/7/product:A=permanent*").unwrap();
        assert!(fp.any_armed());
        assert_eq!(fp.fire("consumer.handler@c/7/product:B"), None);
        assert_eq!(
            fp.fire("consumer.handler@c/7/product:A"),
            Some(Action::Permanent)
        );
        assert!(!FailPoints::none().any_armed());
    }

    #[test]
    fn freeze_is_an_action() {
        assert!(FailPoints::parse("consumer.before_commit=freeze").is_ok());
    }

    #[test]
    fn a_malformed_spec_is_rejected() {
        assert!(FailPoints::parse("a").is_err());
        assert!(FailPoints::parse("a=explode").is_err());
    }
}
