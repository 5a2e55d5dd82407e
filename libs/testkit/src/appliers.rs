//! The check every handler passes before it runs with lanes and replicas
//! (docs/adr/0010): the same events, applied by one consumer in order and by
//! three competing consumers (two lanes each) with shuffled and repeated
//! delivery, end in the same state, with no applier ever deadlocked.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use sqlx::migrate::Migrator;
use tokio_util::sync::CancellationToken;

use super::{TestDb, amqp_url, delete_broker_objects, unique, wait_until};
use reliability::broker::{self, QueueSpec};
use reliability::consumer::{Apply, Consumer, ConsumerConfig, ConsumerStats, Handler};
use reliability::outbox::Envelope;

/// What to apply and what state to compare.
pub struct AppliersCheck<'a> {
    /// The service's migrations (the reliability tables come first).
    pub migrations: &'static Migrator,
    /// The consumer's name, as in the service (its dedup and lock keys).
    pub consumer: &'a str,
    /// Each wave is delivered shuffled and repeated, and the next one only
    /// once it has settled: a wave holds events whose order the domain does
    /// not fix (a payment decision cannot overtake its order's placement).
    pub waves: Vec<Vec<Envelope>>,
    /// SQL run as the owner before any event: the rows the events expect.
    pub seed: &'a str,
    /// A query of the handler's state (run as the owner), compared row by row.
    pub state: &'a str,
}

/// Runs the check; panics with both states if they differ, or if an applier
/// had to fall back or retry (two appliers deadlocked).
pub async fn assert_competing_appliers_agree<H: Handler>(
    check: AppliersCheck<'_>,
    handler: impl Fn() -> H,
) {
    let in_order = TestDb::with_migrations(check.migrations).await;
    seed(&in_order, check.seed).await;
    let single = Consumer::new(
        in_order.app.clone(),
        "",
        ConsumerConfig::new(check.consumer, "", &[]),
        handler(),
    );
    for event in check.waves.iter().flatten() {
        single
            .apply(event)
            .await
            .unwrap_or_else(|e| panic!("in-order apply of {}: {e}", event.message_id()));
    }
    let expected = state(&in_order, check.state).await;
    in_order.cleanup().await;

    let events = check.waves.iter().map(Vec::len).sum::<usize>() as u64;
    for round in 0..ROUNDS {
        let (actual, stats) = compete(&check, &handler, round).await;
        assert_eq!(
            actual, expected,
            "round {round}: three competing consumers (left) and one in order (right) disagree"
        );
        assert_eq!(
            (stats.applied, stats.dead_lettered),
            (events, 0),
            "round {round}: each event applied once, none dead-lettered: {stats:?}"
        );
        assert_eq!(
            (stats.fallbacks, stats.retries),
            (0, 0),
            "round {round}: no group fell back and nothing was retried (a deadlock would): {stats:?}"
        );
    }
}

/// Races are a matter of timing: each round is another shuffle on a fresh
/// database, so a missing lock shows in nearly every run of the check.
const ROUNDS: u64 = 4;

/// One competing run: its final state and what the consumers counted.
async fn compete<H: Handler>(
    check: &AppliersCheck<'_>,
    handler: &impl Fn() -> H,
    round: u64,
) -> (Vec<String>, ConsumerStats) {
    let competing = TestDb::with_migrations(check.migrations).await;
    seed(&competing, check.seed).await;
    let stats = race(check.consumer, &check.waves, round, |config| {
        Consumer::new(competing.app.clone(), &amqp_url(), config, handler())
    })
    .await;
    let actual = state(&competing, check.state).await;
    competing.cleanup().await;
    (actual, stats)
}

/// Delivers `waves` to three consumers built by `consumer` (two lanes each,
/// small groups) competing on one queue of their own: each wave shuffled,
/// each event one to three times, the next wave once the last settled.
/// Returns what they counted. The same `round` gives the same shuffle.
/// For a handler, [`assert_competing_appliers_agree`] compares the state
/// this leaves with one applier's in order; a [`reliability::consumer::Sink`]
/// compares its own store's.
pub async fn race<A: Apply>(
    name: &str,
    waves: &[Vec<Envelope>],
    round: u64,
    consumer: impl Fn(ConsumerConfig) -> Consumer<A>,
) -> ConsumerStats {
    let exchange = unique("reltest.appliers.x.");
    let queue = unique("reltest.appliers.q.");
    let conn = broker::connect(&amqp_url(), "reliability-tests-appliers")
        .await
        .expect("connect to AMQP_URL");
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions { nowait: false })
        .await
        .unwrap();
    let mut config = ConsumerConfig::new(name, &exchange, &[]);
    config.queue = QueueSpec::new(&queue, &exchange, &[]);
    config.lanes = 2;
    config.prefetch = 8;
    config.batch_max = 4;
    config.retry_delay = Duration::from_millis(10);
    broker::declare_queue(&channel, &config.queue)
        .await
        .unwrap();

    let stop = CancellationToken::new();
    let consumers: Vec<_> = (0..3).map(|_| Arc::new(consumer(config.clone()))).collect();
    let tasks: Vec<_> = consumers
        .iter()
        .map(|c| {
            let (c, stop) = (c.clone(), stop.clone());
            tokio::spawn(async move { c.run(stop).await })
        })
        .collect();

    let mut rng = 0x9E37_79B9_7F4A_7C15_u64 ^ (round + 1).wrapping_mul(0xA076_1D64_78BD_642F);
    let mut delivered = 0u64;
    for wave in waves {
        let mut deliveries = Vec::new();
        for event in wave {
            for _ in 0..=next(&mut rng) % 3 {
                deliveries.push(event);
            }
        }
        for i in (1..deliveries.len()).rev() {
            deliveries.swap(i, (next(&mut rng) % (i as u64 + 1)) as usize);
        }
        for event in &deliveries {
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &serde_json::to_vec(event).unwrap(),
                    BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_message_id(event.message_id().as_str().into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
        delivered += deliveries.len() as u64;
        wait_until(
            Duration::from_secs(60),
            &format!("{delivered} deliveries settled"),
            || async { total(&consumers).finished() >= delivered },
        )
        .await;
    }
    stop.cancel();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let _ = conn.close(200, "appliers check done".into()).await;
    delete_broker_objects(&[queue], &exchange).await;
    total(&consumers)
}

fn total(consumers: &[Arc<Consumer<impl Apply>>]) -> ConsumerStats {
    consumers
        .iter()
        .map(|c| c.stats())
        .fold(ConsumerStats::default(), |a, b| ConsumerStats {
            applied: a.applied + b.applied,
            duplicates: a.duplicates + b.duplicates,
            dead_lettered: a.dead_lettered + b.dead_lettered,
            parked: a.parked + b.parked,
            retries: a.retries + b.retries,
            grouped: a.grouped + b.grouped,
            fallbacks: a.fallbacks + b.fallbacks,
            gathered: a.gathered + b.gathered,
            redelivered: a.redelivered + b.redelivered,
            lane_restarts: a.lane_restarts + b.lane_restarts,
        })
}

async fn seed(db: &TestDb, sql: &str) {
    if !sql.is_empty() {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&db.owner)
            .await
            .expect("seed the test database");
    }
}

/// The rows of `query` as JSON text, sorted.
async fn state(db: &TestDb, query: &str) -> Vec<String> {
    let sql = format!("SELECT row_to_json(s)::text FROM ({query}) s ORDER BY 1");
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(&db.owner)
        .await
        .expect("read the handler's state")
}

/// xorshift64: a fixed shuffle, the same on every run.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// An event as a relay would deliver it (version 1, occurred now).
pub fn event(
    source: &str,
    id: i64,
    tenant: i64,
    aggregate: (&str, i64),
    event_type: &str,
    payload: serde_json::Value,
) -> Envelope {
    Envelope {
        id,
        source: source.to_owned(),
        tenant_id: tenant,
        aggregate_type: aggregate.0.to_owned(),
        aggregate_id: aggregate.1.to_string(),
        event_type: event_type.to_owned(),
        event_version: 1,
        occurred_at: chrono::Utc::now(),
        payload,
        aggregate_seq: None,
    }
}
