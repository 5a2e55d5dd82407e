//! A broker that blocks publishers: a memory alarm held for 45 s under
//! steady load, then cleared. Nothing may reach a DLQ, be lost, or be
//! applied twice; no outbox row may be charged an attempt for it. And the
//! relays must wait on their blocked connections (docs/adr/0025): broker
//! connections and relay memory stay flat, and the duplicates the alarm
//! costs stay small. Before, every confirm timeout left a blocked
//! connection behind with a window of publishes queued in it, each sent
//! again when the alarm cleared.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::world::World;

use crate::run::{Outcome, Run, attempts_spent, quiesce};

/// How long the alarm holds: four of the relays' 10 s confirm timeouts,
/// three samples. The defect it guards against left a blocked connection
/// behind at each one; a count of connections every 15 s shows it from
/// the first. Five minutes cost CI three and a half of its 45; 90 s (until
/// session 30) showed nothing more than 45.
const HELD: Duration = Duration::from_secs(45);
/// How often connections and memory are sampled meanwhile.
const SAMPLE: Duration = Duration::from_secs(15);
/// Orders per second while it holds.
const RATE: usize = 2;
/// Growth of the orders relay's resident set that counts as not flat.
const RSS_SLACK_KIB: u64 = 32 * 1024;
/// Duplicates the alarm may cost: what each relay had queued in lapin when
/// the block arrived goes out when it clears, and is published again.
const DUPLICATES_SLACK: i64 = 200;

/// Puts the watermark back however the scenario ends.
struct Watermark(&'static World, String);

impl Drop for Watermark {
    fn drop(&mut self) {
        let (world, before) = (self.0, self.1.clone());
        tokio::spawn(async move {
            world
                .ctl(0, &["set_vm_memory_high_watermark", &before])
                .await
        });
    }
}

/// What one sample saw.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    connections: u64,
    relay_connections: u64,
    relay_rss_kib: u64,
}

async fn sample(run: &Run) -> anyhow::Result<Sample> {
    // One line per connection, cluster-wide; the name a client gave is in
    // its properties (`{"connection_name","orders-relay"}`).
    let lines = run
        .world
        .ctl(
            0,
            &[
                "list_connections",
                "client_properties",
                "--no-table-headers",
                "-q",
            ],
        )
        .await?;
    let lines: Vec<&str> = lines.lines().filter(|l| !l.trim().is_empty()).collect();
    Ok(Sample {
        connections: lines.len() as u64,
        relay_connections: lines.iter().filter(|l| l.contains("-relay\"}")).count() as u64,
        relay_rss_kib: run.cluster.rss_kib("orders-relay").unwrap_or(0),
    })
}

pub async fn memory_alarm(run: &mut Run, tenant: i64) -> Outcome {
    let world = run.world;
    let before = world
        .ctl(
            0,
            &["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."],
        )
        .await?;
    let before = if before.parse::<f64>().is_ok() {
        before
    } else {
        "0.4".to_owned()
    };
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100_000)
        .await?;
    let dups_before = run.dbs.duplicates(tenant).await?;
    let start = sample(run).await?;
    let _restore = Watermark(world, before.clone());
    // One node's alarm blocks publishers on every node of the cluster.
    world
        .ctl(0, &["set_vm_memory_high_watermark", "0.0001"])
        .await?;
    let done = AtomicBool::new(false);
    let (placed, held) = tokio::join!(run.client.orders_until(tenant, RATE, &done), async {
        let began = Instant::now();
        let mut samples = Vec::new();
        while began.elapsed() < HELD {
            tokio::time::sleep(SAMPLE.min(HELD.saturating_sub(began.elapsed()))).await;
            let s = sample(run).await?;
            println!(
                "   {:>3} s into the alarm: {} broker connections ({} of relays), orders-relay {} MiB",
                began.elapsed().as_secs(),
                s.connections,
                s.relay_connections,
                s.relay_rss_kib / 1024
            );
            samples.push(s);
        }
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_messages WHERE tenant_id = $1 AND processed_at IS NULL",
        )
        .bind(tenant)
        .fetch_one(&run.dbs.orders)
        .await?;
        world
            .ctl(0, &["set_vm_memory_high_watermark", &before])
            .await?;
        done.store(true, Ordering::Release);
        anyhow::Ok((pending, samples))
    });
    let (waiting, samples) = held?;
    let placed = placed?;
    quiesce(run, tenant).await?;
    let dups = run.dbs.duplicates(tenant).await? - dups_before;

    let most = |f: fn(&Sample) -> u64| samples.iter().map(f).max().unwrap_or(0);
    let peak_conns = most(|s| s.connections);
    let peak_relay_conns = most(|s| s.relay_connections);
    let peak_rss = most(|s| s.relay_rss_kib);
    let first_rss = start.relay_rss_kib;
    let mut violations = Vec::new();
    if waiting == 0 {
        violations.push("scenario: the alarm held nothing back (did it fire?)".to_owned());
    }
    if peak_relay_conns > start.relay_connections {
        violations.push(format!(
            "relay: {} relay connections to the broker during the alarm, {} before: blocked ones were left behind",
            peak_relay_conns, start.relay_connections
        ));
    }
    if peak_conns > start.connections + 2 {
        violations.push(format!(
            "broker: {peak_conns} connections during the alarm, {} before",
            start.connections
        ));
    }
    if peak_rss > first_rss + RSS_SLACK_KIB {
        violations.push(format!(
            "relay: orders-relay grew from {} to {} MiB during the alarm",
            first_rss / 1024,
            peak_rss / 1024
        ));
    }
    if dups > DUPLICATES_SLACK {
        violations.push(format!(
            "relay: the alarm cost {dups} duplicate deliveries (bound {DUPLICATES_SLACK}): copies queued on blocked connections"
        ));
    }
    violations.extend(attempts_spent(run, tenant, "the blocked broker").await?);
    Ok((
        format!(
            "memory alarm (watermark 0.0001) held {} s under {RATE} orders/s: {placed} orders, {waiting} events waited in the outbox; broker connections {} before, at most {peak_conns} during (relays' {} → {peak_relay_conns}); orders-relay {} → at most {} MiB; {dups} duplicates absorbed; watermark back to {before}",
            HELD.as_secs(),
            start.connections,
            start.relay_connections,
            first_rss / 1024,
            peak_rss / 1024,
        ),
        violations,
    ))
}
