#![doc = include_str!("../README.md")]

use std::time::Duration;

use pg_walstream::{
    CancellationToken, EventStream, EventType, LogicalReplicationStream, ReplicationStreamConfig,
    StreamingMode,
};
use reliability::broker::Publisher;
use reliability::health::Health;
use reliability::relay::Relay;

mod slot;

pub use slot::{
    ACTIVE, LAG, METRICS, RETAINED_WAL, SlotStatus, ensure_slot, slot_status, watch_slot,
};

/// The publication of the outbox's inserts (reliability migration 0014).
pub const PUBLICATION: &str = "reliability_outbox";
/// The slot's name unless told: this, then the database's name (slots
/// are named across the server). One per database, shared by its
/// relays, of which PostgreSQL lets one read at a time.
pub const SLOT_PREFIX: &str = "outbox_relay_";
/// Rows read before they are published: four of the relay's batches of
/// 500, its window's 3 in flight and the next. PostgreSQL decodes about
/// 300k outbox rows a second here (docs/benchmarks.md): 2,000 take it
/// about 7 ms.
pub const DEFAULT_BATCH: usize = 2_000;
/// How long a batch waits for more commits before it is published: the
/// latency a light load pays for the batches a heavy load gets.
pub const DEFAULT_LINGER: Duration = Duration::from_millis(2);
/// How often a relay that does not hold the slot asks for it again: how
/// long the outbox waits, at most, after its reader died.
pub const DEFAULT_STANDBY_RETRY: Duration = Duration::from_secs(1);
/// With nothing to publish, how often the slot's position is moved to
/// what has been read: the WAL of other tables' writes is then released.
const IDLE_CONFIRM: Duration = Duration::from_secs(1);
/// How often PostgreSQL hears the confirmed position.
const FEEDBACK_EVERY: Duration = Duration::from_secs(1);
/// Its part of `/readyz`: ready while it reads the slot or waits behind
/// the relay that does; not, with the reason, while it cannot read.
pub const HEALTH_PART: &str = "log relay";
/// PostgreSQL's answer to a relay starting a slot another relay reads
/// (`object_in_use`): a standby, not a fault.
const SLOT_IN_USE: &str = "[55006]";
/// The outbox table, as pgoutput names it.
const OUTBOX: &str = "outbox_messages";

/// Why a reading of the log stopped; the relay then reads again from the
/// slot's confirmed position.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("replication: {0}")]
    Replication(#[from] pg_walstream::ReplicationError),
    #[error(transparent)]
    Relay(#[from] reliability::Error),
    #[error("creating the slot: {0}")]
    Slot(#[from] sqlx::Error),
    #[error("an outbox insert without a readable id: {0}")]
    Decode(String),
}

#[derive(Debug, Clone)]
pub struct LogRelayConfig {
    /// A connection string of a role with REPLICATION on the outbox's
    /// database (`replication=database` is added).
    pub replication_url: String,
    pub slot: String,
    pub publication: String,
    /// Rows read before they are published, at most: several of the
    /// relay's batches (`RelayConfig::batch_size`), so that its window
    /// keeps some in flight (`batches_in_flight`).
    pub batch: usize,
    pub linger: Duration,
    pub standby_retry: Duration,
}

impl LogRelayConfig {
    pub fn new(replication_url: &str) -> Self {
        Self {
            replication_url: replication_url.to_owned(),
            slot: slot_for(replication_url),
            publication: PUBLICATION.to_owned(),
            batch: DEFAULT_BATCH,
            linger: DEFAULT_LINGER,
            standby_retry: DEFAULT_STANDBY_RETRY,
        }
    }

    pub fn connection_string(&self) -> String {
        let sep = if self.replication_url.contains('?') {
            '&'
        } else {
            '?'
        };
        format!("{}{sep}replication=database", self.replication_url)
    }
}

/// [`SLOT_PREFIX`] and the database `url` names, as a slot may be named:
/// lower-case letters, digits and `_`, at most 63 bytes.
pub fn slot_for(url: &str) -> String {
    let path = url.split('?').next().unwrap_or(url);
    let database = path.rsplit_once('/').map_or("", |(_, db)| db);
    let name: String = format!("{SLOT_PREFIX}{database}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    name.chars().take(63).collect()
}

/// The log relay: learns which outbox rows committed, in commit order,
/// from the slot, and publishes them through `relay` (its confirms,
/// numbering, retries and DLQ), then confirms the slot past them.
pub struct LogRelay {
    relay: Relay,
    config: LogRelayConfig,
    health: Health,
}

/// Commits read and not yet published: their rows, and where the last one
/// ends in the log.
#[derive(Default)]
struct Pending {
    ids: Vec<i64>,
    end_lsn: u64,
}

impl LogRelay {
    pub fn new(relay: Relay, config: LogRelayConfig) -> Self {
        Self {
            relay,
            config,
            health: Health::default(),
        }
    }

    /// Reports to `health` as [`HEALTH_PART`] (the process's `/readyz`).
    pub fn with_health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    /// Reads the log until `shutdown`: holding the slot, or waiting for it
    /// while another relay holds it. Any failure reads again from the
    /// slot's confirmed position, which replays what was not confirmed;
    /// a replayed row already published is not claimed again.
    pub async fn run(&self, shutdown: CancellationToken) {
        self.health.starting(HEALTH_PART);
        loop {
            let read = async {
                let publisher = self.relay.publisher().await?;
                self.read(&publisher, &shutdown).await
            };
            let failed = tokio::select! {
                () = shutdown.cancelled() => return,
                r = read => match r {
                    Ok(()) => return,
                    Err(e) => e,
                },
            };
            if failed.to_string().contains(SLOT_IN_USE) {
                self.health.ready(HEALTH_PART);
                tracing::debug!(slot = %self.config.slot, "another relay reads the slot; asking again");
            } else {
                self.health.not_ready(HEALTH_PART, &failed);
                tracing::info!(slot = %self.config.slot, error = %failed, "not reading the outbox's log; asking again");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.config.standby_retry) => {}
            }
        }
    }

    /// Holds the slot and publishes what it shows, until `shutdown`.
    async fn read(&self, publisher: &Publisher, shutdown: &CancellationToken) -> Result<(), Error> {
        let config = ReplicationStreamConfig::builder(&self.config.slot, &self.config.publication)
            .with_protocol_version(1)
            .with_streaming_mode(StreamingMode::Off)
            .with_feedback_interval(FEEDBACK_EVERY);
        slot::ensure_slot(&self.config.replication_url, &self.config.slot).await?;
        let mut stream =
            LogicalReplicationStream::new(&self.config.connection_string(), config).await?;
        // Refused while another relay reads the slot (it is active): this
        // one waits, and asks again.
        stream.start(None).await?;
        self.health.ready(HEALTH_PART);
        tracing::info!(slot = %self.config.slot, "reading the outbox's log");
        // A child: the stream's shutdown cancels its token, which must not
        // be the process's (an e2e run stopped every task of the relay
        // role at the first error read).
        let mut events = stream.into_stream(shutdown.child_token());
        let result = self.pump(&mut events, publisher).await;
        let _ = events.shutdown().await;
        result
    }

    async fn pump(&self, events: &mut EventStream, publisher: &Publisher) -> Result<(), Error> {
        let mut pending = Pending::default();
        let mut txn: Vec<i64> = Vec::new();
        let mut in_txn = false;
        loop {
            let wait = if pending.ids.is_empty() {
                IDLE_CONFIRM
            } else {
                self.config.linger
            };
            let event = match tokio::time::timeout(wait, events.next_event()).await {
                Ok(event) => event?,
                Err(_) if !pending.ids.is_empty() => {
                    self.publish(events, publisher, &mut pending).await?;
                    continue;
                }
                Err(_) => {
                    if !in_txn {
                        // Everything read is published: the slot may move.
                        let read = events.current_lsn();
                        confirm(events, read).await?;
                    }
                    continue;
                }
            };
            match event.event_type {
                EventType::Begin { .. } => {
                    in_txn = true;
                    txn.clear();
                }
                EventType::Insert { table, data, .. } if &*table == OUTBOX => {
                    let id = data.get("id").and_then(|v| v.as_str());
                    let id = id.and_then(|s| s.parse::<i64>().ok());
                    txn.push(id.ok_or_else(|| Error::Decode(format!("{data:?}")))?);
                }
                EventType::Commit { end_lsn, .. } => {
                    in_txn = false;
                    pending.ids.append(&mut txn);
                    pending.end_lsn = end_lsn.value();
                    if pending.ids.len() >= self.config.batch {
                        self.publish(events, publisher, &mut pending).await?;
                    }
                }
                _ => {}
            }
        }
    }

    /// Publishes the pending rows, then confirms the slot past their
    /// commits: only after the broker confirmed them (or the relay
    /// recorded why not, for the polling relay to retry).
    async fn publish(
        &self,
        events: &mut EventStream,
        publisher: &Publisher,
        pending: &mut Pending,
    ) -> Result<(), Error> {
        let mut report = self.relay.relay_ids(publisher, &pending.ids).await?;
        // Where an ordered subscription binds, a batch holds back a row
        // whose aggregate an earlier batch of the window had in flight; that
        // one is settled now, so another pass publishes it rather than the
        // sweep, seconds later. Rows published already claim nothing.
        // Again while a pass held rows back and published some: each such
        // pass publishes at least one, so it ends; what no pass can move
        // (another relay holds its aggregate) is the sweep's.
        while report.held > 0 && report.published > 0 {
            report = self.relay.relay_ids(publisher, &pending.ids).await?;
        }
        confirm(events, pending.end_lsn).await?;
        *pending = Pending::default();
        Ok(())
    }
}

/// Confirms the slot up to `lsn` and tells PostgreSQL now: the library's
/// own feedback goes out only every 128 frames read, which a quiet
/// outbox may not see for minutes, holding WAL meanwhile.
async fn confirm(events: &mut EventStream, lsn: u64) -> Result<(), Error> {
    if events.get_feedback_lsn().1 >= lsn {
        return Ok(());
    }
    events.update_flushed_lsn(lsn);
    events.update_applied_lsn(lsn);
    events.inner_mut().send_feedback().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_slot_is_named_after_its_database() {
        assert_eq!(
            super::slot_for("postgres://commerce_wal@db:5432/Orders-EU?sslmode=require"),
            "outbox_relay_orders_eu"
        );
    }
}
