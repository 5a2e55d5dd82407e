//! The relay and the consumer against the broker's and the database's own
//! limits: a sliding-window confirmed publisher, a raw consume + ack.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use reliability::TenantTx;
use reliability::broker::{self, Outgoing};
use reliability::consumer::{Apply, Consumer, ConsumerConfig, Handler, HandlerError};
use reliability::outbox::Envelope;
use reliability::relay::{Relay, RelayConfig};
use serde_json::{Value, json};
use testkit::{TestDb, amqp_url, unique};
use tokio_util::sync::CancellationToken;

use crate::{Sizes, Table, cpu_self, pct, rawamqp};

mod log;
mod window;
use window::{Publish, WINDOW};
pub(crate) use window::{outgoing, sliding_window_publish};

pub(crate) const STATE_SQL: &str = "
CREATE TABLE bench_state (
    tenant_id bigint NOT NULL, aggregate_id text NOT NULL, applied bigint NOT NULL,
    PRIMARY KEY (tenant_id, aggregate_id));
ALTER TABLE bench_state ENABLE ROW LEVEL SECURITY;
ALTER TABLE bench_state FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON bench_state
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
GRANT SELECT, INSERT, UPDATE ON bench_state TO commerce_app;";

/// One upsert per event: the smallest real piece of state a consumer keeps.
struct Upsert;

impl Handler for Upsert {
    async fn handle(&self, tx: &mut TenantTx, e: &Envelope) -> Result<(), HandlerError> {
        sqlx::query(
            "INSERT INTO bench_state (tenant_id, aggregate_id, applied) VALUES ($1, $2, 1)
             ON CONFLICT (tenant_id, aggregate_id) DO UPDATE SET applied = bench_state.applied + 1",
        )
        .bind(e.tenant_id)
        .bind(&e.aggregate_id)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// The bench's outbox rows, numbered by `g` (the caller's `FROM`):
/// OrderPlaced-sized events over 100 tenants and 10 000 aggregates.
macro_rules! outbox_rows {
    () => {
        r#"INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers)
           SELECT 1 + g % 100, 'order', (g % 10000)::text, 'OrderPlaced',
                  jsonb_build_object('order_id', g, 'customer_id', 'c-' || g, 'currency', 'EUR',
                                     'total_cents', 2500, 'lines',
                                     jsonb_build_array(jsonb_build_object('sku', 'SKU-1', 'quantity', 2, 'unit_price_cents', 1250))),
                  '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'"#
    };
}
use outbox_rows;

/// `rows` OrderPlaced-sized events over 100 tenants and 10 000 aggregates.
async fn fill(db: &TestDb, rows: i64) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE outbox_messages")
        .execute(&db.owner)
        .await?;
    sqlx::query(concat!(outbox_rows!(), " FROM generate_series(1, $1) g"))
        .bind(rows)
        .execute(&db.owner)
        .await?;
    sqlx::query("VACUUM ANALYZE outbox_messages")
        .execute(&db.owner)
        .await?;
    Ok(())
}

pub(crate) async fn relay_and_consumer(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let db = TestDb::new().await;
    sqlx::raw_sql(STATE_SQL).execute(&db.owner).await?;
    let exchange = unique("reltest.bench.");
    let sink = ConsumerConfig::new(&format!("{exchange}.sink"), &exchange, &["#"]);
    let queue = sink.queue.queue.clone();
    let conn = broker::connect(&amqp_url(), "bench").await?;
    let channel = conn.create_channel().await?;
    broker::declare_exchange(&channel, &exchange).await?;
    broker::declare_queue(&channel, &sink.queue).await?;
    let purge = || async {
        channel
            .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
            .await
    };
    let n = s.rows as f64;

    // The limit: the same messages, same batches, no database.
    fill(&db, s.rows).await?;
    let rows: Vec<Envelope> = sqlx::query_as(
        "SELECT id, 'bench' AS source, tenant_id, aggregate_type, aggregate_id, event_type,
                event_version, occurred_at, payload
         FROM outbox_messages ORDER BY id",
    )
    .fetch_all(&db.owner)
    .await?;
    let headers: serde_json::Map<String, Value> = serde_json::from_value(
        json!({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}),
    )?;
    let messages = rows
        .iter()
        .map(|e| outgoing(e, broker::headers_from_json(&headers)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The consumer's events again, all of one tenant: a group records and
    // scopes each tenant's run in statements of its own (row-level
    // security), so the spread of tenants bounds what a group saves.
    let one_tenant = rows
        .iter()
        .take(usize::try_from(s.consume)?)
        .map(|e| {
            let e = Envelope {
                tenant_id: 1,
                ..e.clone()
            };
            outgoing(&e, broker::headers_from_json(&headers))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    drop(rows);
    // The broker's limit: a sliding window of confirms (at most WINDOW
    // unconfirmed, no batch barrier), the same messages, the same exchange.
    let publish_channel = conn.create_channel().await?;
    publish_channel
        .confirm_select(ConfirmSelectOptions { nowait: false })
        .await?;
    // And the same through a second client, the protocol by hand with no
    // library (rawamqp.rs): which of broker and library bounds the relay.
    // Each twice, interleaved, the better run kept; the queue emptied
    // before each.
    let (mut lapin_run, mut by_hand) = (Publish::default(), Publish::default());
    for _ in 0..2 {
        purge().await?;
        lapin_run
            .keep(n, async {
                sliding_window_publish(&publish_channel, &exchange, &messages).await
            })
            .await?;
        purge().await?;
        by_hand
            .keep(
                n,
                rawamqp::sliding_window_publish(&amqp_url(), &exchange, &messages, WINDOW),
            )
            .await?;
    }
    let raw = lapin_run.rate;
    println!(
        "   sliding-window confirmed publish: lapin {raw:.0} msg/s, by hand {:.0} msg/s",
        by_hand.rate
    );
    t.row([
        "confirmed publish, a client with no library (AMQP frames by hand), same messages and window",
        &format!("{:.0} msg/s", by_hand.rate),
        &format!("lapin's sliding window {raw:.0} msg/s"),
        &format!("{:.2}x", by_hand.rate / raw),
        "names the relay's bound",
    ]);
    t.row([
        "CPU per 1k messages published, lapin / by hand",
        &format!(
            "client {:.0} / {:.0} ms",
            lapin_run.client_ms, by_hand.client_ms
        ),
        &format!(
            "broker {:.0} / {:.0} ms",
            lapin_run.broker_ms, by_hand.broker_ms
        ),
        "",
        "",
    ]);

    let mut config = RelayConfig::new("bench", &exchange);
    config.batch_size = 500;
    for relays in [1, 2, 4] {
        purge().await?;
        if relays > 1 {
            fill(&db, s.rows).await?;
        }
        let cpu0 = cpu_self();
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..relays)
            .map(|_| {
                let relay = Relay::new(db.relay.clone(), &amqp_url(), config.clone());
                tokio::spawn(async move {
                    let publisher = relay.publisher().await?;
                    relay.drain(&publisher).await
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        let secs = t0.elapsed().as_secs_f64();
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
                .fetch_one(&db.owner)
                .await?;
        anyhow::ensure!(pending == 0, "{pending} rows left after the drain");
        let rate = n / secs;
        t.row([
            &format!("relay drain, {relays} relay(s), {} rows", s.rows),
            &format!("{rate:.0} events/s"),
            &format!("sliding-window publish {raw:.0} msg/s"),
            &pct(rate / raw),
            if relays == 1 {
                ">= 70% with one relay"
            } else {
                ">= 85% with 2-4 relays"
            },
        ]);
        if relays == 1 {
            let cpu = (cpu_self() - cpu0) * 1000.0 / n;
            t.row([
                "relay CPU per 1k events (this process)",
                &format!("{:.0} ms", cpu * 1000.0),
                "",
                "",
                "",
            ]);
            let (table, index, pending_index): (i64, i64, i64) = sqlx::query_as(
                "SELECT pg_table_size('outbox_messages'), pg_indexes_size('outbox_messages'),
                        (SELECT coalesce(sum(pg_relation_size(indexrelid)), 0)::bigint FROM pg_index
                         WHERE indrelid = 'outbox_messages'::regclass AND indpred IS NOT NULL)",
            )
            .fetch_one(&db.owner)
            .await?;
            t.row([
                "outbox after the drain (rows kept until archived)",
                &format!("table {} MiB, indexes {} MiB", table >> 20, index >> 20),
                &format!("pending index {} KiB", pending_index >> 10),
                "",
                "",
            ]);
        }
    }

    purge().await?;
    log::log_relay_drain(&db, &config, s.rows, (raw, by_hand.rate), t).await?;

    // The queue now holds the last drain's messages.
    let m = s.consume;
    let raw_channel = conn.create_channel().await?;
    raw_channel
        .basic_qos(sink.prefetch, BasicQosOptions { global: false })
        .await?;
    let mut deliveries = raw_channel
        .basic_consume(
            queue.as_str().into(),
            "bench-raw".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let t0 = Instant::now();
    for _ in 0..m {
        let d = deliveries
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("queue ran dry"))??;
        d.ack(BasicAckOptions::default()).await?;
    }
    let raw_consume = m as f64 / t0.elapsed().as_secs_f64();
    raw_channel.close(200, "done".into()).await?;

    // The consumer runtime with lanes and a second consumer beside the
    // first: each run applies the same `m` events afresh (its own consumer
    // name: its own dedup records), republished onto the emptied queue.
    let m_usize = usize::try_from(m)?;
    for (label, consumers, lanes, events) in [
        ("1 lane", 1, 1, &messages[..m_usize]),
        ("2 lanes", 1, 2, &messages[..m_usize]),
        ("4 lanes", 1, 4, &messages[..m_usize]),
        ("2 consumers x 2 lanes", 2, 2, &messages[..m_usize]),
        ("4 lanes, one tenant", 1, 4, &one_tenant[..]),
    ] {
        purge().await?;
        sliding_window_publish(&publish_channel, &exchange, events).await?;
        let mut config = sink.clone();
        config.name = format!("{}-{}-{consumers}x{lanes}", sink.name, label.len());
        config.lanes = lanes;
        let applied = apply_all(&db, &config, consumers, m).await?;
        t.row([
            &format!("consumer apply, {m} events, {label}"),
            &format!("{applied:.0} events/s"),
            &format!("raw consume+ack {raw_consume:.0}/s"),
            &pct(applied / raw_consume),
            if label == "4 lanes" { ">= 65%" } else { "" },
        ]);
    }
    drop(messages);

    conn.close(200, "bench done".into()).await?;
    testkit::delete_broker_objects(&[queue], &exchange).await;
    db.cleanup().await;
    Ok(())
}

/// Applies `m` waiting events with `replicas` consumers of `config`, each
/// an `Upsert`; events per second. Fails if any was parked.
pub(crate) async fn apply_all(
    db: &TestDb,
    config: &ConsumerConfig,
    replicas: usize,
    m: u64,
) -> anyhow::Result<f64> {
    apply_with(replicas, m, || {
        Consumer::new(db.app.clone(), &amqp_url(), config.clone(), Upsert)
    })
    .await
}

/// Applies `m` waiting events with `replicas` consumers that `consumer`
/// builds; events per second. Fails if any was parked or dead-lettered.
pub(crate) async fn apply_with<A: Apply>(
    replicas: usize,
    m: u64,
    consumer: impl Fn() -> Consumer<A>,
) -> anyhow::Result<f64> {
    let running: Vec<_> = (0..replicas).map(|_| Arc::new(consumer())).collect();
    let stop = CancellationToken::new();
    let t0 = Instant::now();
    let tasks: Vec<_> = running
        .iter()
        .map(|c| {
            let (c, stop) = (c.clone(), stop.clone());
            tokio::spawn(async move { c.run(stop).await })
        })
        .collect();
    let deadline = t0 + Duration::from_secs(600);
    let finished = || running.iter().map(|c| c.stats().finished()).sum::<u64>();
    while finished() < m {
        anyhow::ensure!(Instant::now() < deadline, "consumer too slow");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = finished() as f64 / t0.elapsed().as_secs_f64();
    stop.cancel();
    for task in tasks {
        task.await??;
    }
    let lost: u64 = running
        .iter()
        .map(|c| c.stats().parked + c.stats().dead_lettered)
        .sum();
    anyhow::ensure!(lost == 0, "{lost} events parked or dead-lettered");
    Ok(rate)
}
