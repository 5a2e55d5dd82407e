//! `make bench`: the system measured against the raw limits of the same
//! PostgreSQL and RabbitMQ, in one run, each figure next to its limit:
//!
//! 1. relay drain (1, 2, 4 relays) vs a raw publisher of the same messages
//!    with pipelined confirms and no database;
//! 2. consumer apply (dedup + state + offset + commit + ack) vs a raw
//!    consume + ack of the same queue;
//! 3. `POST /orders` at 1, 8, 32 connections vs pgbench running the same
//!    SQL transaction on the same database;
//! 4. idempotent replay latency;
//! 5. placed → confirmed (orders and projection), light and heavy load;
//! 6. resources: peak RSS, outbox size after the drain, CPU per 1k events.
//!
//! `bench --smoke` runs everything tiny (seconds), for CI. The full run
//! writes `docs/benchmarks.md`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use reliability::broker::{self, Outgoing};
use reliability::consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
use reliability::outbox::Envelope;
use reliability::relay::{Relay, RelayConfig};
use reliability::service::{CommonSettings, Databases, Role, ShutdownToken};
use reliability::testing::{TestDb, amqp_url, database_url, unique};
use reliability::{TenantId, TenantTx};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

struct Sizes {
    /// Outbox rows the relays drain.
    rows: i64,
    /// Messages consumed raw and through the consumer runtime.
    consume: u64,
    /// Duration of each HTTP load level.
    http: Duration,
    replays: usize,
    /// Orders followed to `confirmed` at light load, and per client at heavy.
    e2e_light: usize,
    e2e_heavy: usize,
    /// Orders per tenant (4 tenants) through the stack run as processes.
    procs_orders: usize,
}

impl Sizes {
    fn new(smoke: bool) -> Self {
        let mut sizes = Self::preset(smoke);
        // For quick iterations on one figure: BENCH_ROWS=50000 BENCH_CONSUME=20000.
        if let Some(rows) = env_number("BENCH_ROWS") {
            sizes.rows = rows;
        }
        if let Some(n) = env_number("BENCH_CONSUME") {
            sizes.consume = n.try_into().unwrap_or(sizes.consume);
        }
        // The raw consumer and the consumer runtime each take `consume`
        // messages from what the last drain left in the queue.
        sizes.consume = sizes.consume.min(sizes.rows.unsigned_abs() / 2);
        sizes
    }

    fn preset(smoke: bool) -> Self {
        if smoke {
            Self {
                rows: 2_000,
                consume: 500,
                http: Duration::from_secs(1),
                replays: 50,
                e2e_light: 3,
                e2e_heavy: 2,
                procs_orders: 5,
            }
        } else {
            Self {
                rows: 200_000,
                consume: 50_000,
                http: Duration::from_secs(10),
                replays: 2_000,
                e2e_light: 100,
                e2e_heavy: 20,
                procs_orders: 500,
            }
        }
    }
}

fn env_number(name: &str) -> Option<i64> {
    std::env::var(name).ok()?.parse().ok()
}

/// measure, figure, limit, ratio, target
#[derive(Default)]
struct Table(Vec<[String; 5]>);

impl Table {
    fn row(&mut self, cells: [&str; 5]) {
        let row = cells.map(str::to_owned);
        println!(
            "{:<44} {:<40} {:<28} {:>7}  {}",
            row[0], row[1], row[2], row[3], row[4]
        );
        self.0.push(row);
    }

    fn markdown(&self) -> String {
        let mut s =
            String::from("| measure | figure | limit | ratio | target |\n|---|---|---|---|---|\n");
        for r in &self.0 {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                r[0], r[1], r[2], r[3], r[4]
            );
        }
        s
    }
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let sizes = Sizes::new(smoke);
    let started = Instant::now();
    println!(
        "bench ({}): {} outbox rows, {} consumed, {:?} per HTTP level",
        if smoke { "smoke" } else { "full" },
        sizes.rows,
        sizes.consume,
        sizes.http
    );
    println!(
        "{:<44} {:<40} {:<28} {:>7}  target",
        "measure", "figure", "limit", "ratio"
    );
    // For quick iterations on one part: BENCH_ONLY=relay,http,e2e,procs (no report).
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let runs = |part: &str| only.is_empty() || only.split(',').any(|p| p.trim() == part);
    let mut table = Table::default();
    if runs("relay") {
        relay_and_consumer(&sizes, &mut table).await?;
    }
    if runs("http") {
        http(&sizes, &mut table).await?;
    }
    if runs("e2e") {
        end_to_end(&sizes, &mut table).await?;
    }
    table.row([
        "peak RSS of the bench process",
        &format!(
            "{} MiB",
            e2e::procs::peak_rss_kib("self").unwrap_or(0) / 1024
        ),
        "",
        "",
        "the in-process stack of the parts above",
    ]);
    if runs("procs") {
        processes(&sizes, &mut table).await?;
    }
    let secs = started.elapsed().as_secs();
    println!("bench: done in {secs}s");
    if !smoke && only.is_empty() {
        write_report(&table, secs)?;
        println!("wrote docs/benchmarks.md");
    }
    Ok(())
}

// ---------------------------------------------------------------- relay + consumer

const STATE_SQL: &str = "
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

/// `rows` OrderPlaced-sized events over 100 tenants and 10 000 aggregates.
async fn fill(db: &TestDb, rows: i64) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE outbox_messages")
        .execute(&db.owner)
        .await?;
    sqlx::query(
        r#"INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers)
           SELECT 1 + g % 100, 'order', (g % 10000)::text, 'OrderPlaced',
                  jsonb_build_object('order_id', g, 'customer_id', 'c-' || g, 'currency', 'EUR',
                                     'total_cents', 2500, 'lines',
                                     jsonb_build_array(jsonb_build_object('sku', 'SKU-1', 'quantity', 2, 'unit_price_cents', 1250))),
                  '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'
           FROM generate_series(1, $1) g"#,
    )
    .bind(rows)
    .execute(&db.owner)
    .await?;
    sqlx::query("VACUUM ANALYZE outbox_messages")
        .execute(&db.owner)
        .await?;
    Ok(())
}

/// Publishes `messages` as fast as the broker confirms them: at most
/// `WINDOW` unconfirmed at any time, each confirm awaited in order, no
/// barrier between batches. Fails on any return or nack.
async fn sliding_window_publish(
    channel: &lapin::Channel,
    exchange: &str,
    messages: &[Outgoing],
) -> anyhow::Result<()> {
    const WINDOW: usize = 1000;
    let mut in_flight = std::collections::VecDeque::with_capacity(WINDOW);
    for m in messages {
        if in_flight.len() == WINDOW {
            let confirm: lapin::PublisherConfirm = in_flight.pop_front().expect("window is full");
            anyhow::ensure!(
                matches!(confirm.await?, lapin::Confirmation::Ack(None)),
                "not routed"
            );
        }
        let props = lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(m.message_id.as_str().into())
            .with_type(m.kind.as_str().into())
            .with_headers(m.headers.clone());
        let confirm = channel
            .basic_publish(
                exchange.into(),
                m.routing_key.as_str().into(),
                lapin::options::BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &m.body,
                props,
            )
            .await?;
        in_flight.push_back(confirm);
    }
    for confirm in in_flight {
        anyhow::ensure!(
            matches!(confirm.await?, lapin::Confirmation::Ack(None)),
            "not routed"
        );
    }
    Ok(())
}

async fn relay_and_consumer(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
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
        .map(|e| {
            Ok(Outgoing {
                routing_key: e.routing_key(),
                message_id: e.message_id(),
                kind: e.event_type.clone(),
                headers: broker::headers_from_json(&headers),
                body: serde_json::to_vec(e)?,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    drop(rows);
    // The broker's limit: a sliding window of confirms (at most WINDOW
    // unconfirmed, no batch barrier), the same messages, the same exchange.
    let publish_channel = conn.create_channel().await?;
    publish_channel
        .confirm_select(ConfirmSelectOptions { nowait: false })
        .await?;
    let t0 = Instant::now();
    sliding_window_publish(&publish_channel, &exchange, &messages).await?;
    let raw = n / t0.elapsed().as_secs_f64();
    println!("   raw sliding-window confirmed publish: {raw:.0} msg/s");

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
    for (label, consumers, lanes) in [
        ("1 lane", 1, 1),
        ("2 lanes", 1, 2),
        ("4 lanes", 1, 4),
        ("2 consumers x 2 lanes", 2, 2),
    ] {
        purge().await?;
        let m_usize = usize::try_from(m)?;
        sliding_window_publish(&publish_channel, &exchange, &messages[..m_usize]).await?;
        let mut config = sink.clone();
        config.name = format!("{}-{}-{consumers}x{lanes}", sink.name, label.len());
        config.lanes = lanes;
        let running: Vec<_> = (0..consumers)
            .map(|_| {
                Arc::new(Consumer::new(
                    db.app.clone(),
                    &amqp_url(),
                    config.clone(),
                    Upsert,
                ))
            })
            .collect();
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
        let applied = finished() as f64 / t0.elapsed().as_secs_f64();
        stop.cancel();
        for task in tasks {
            task.await??;
        }
        t.row([
            &format!("consumer apply, {m} events, {label}"),
            &format!("{applied:.0} events/s"),
            &format!("raw consume+ack {raw_consume:.0}/s"),
            &pct(applied / raw_consume),
            if lanes == 4 { ">= 60%" } else { "" },
        ]);
    }
    drop(messages);

    conn.close(200, "bench done".into()).await?;
    reliability::testing::delete_broker_objects(&[queue], &exchange).await;
    db.cleanup().await;
    Ok(())
}

// ---------------------------------------------------------------- HTTP

/// The transaction `POST /orders` runs, statement for statement, for pgbench.
const PGBENCH_SQL: &str = r#"\set t random(1, 100)
\set k random(1, 1000000000000)
BEGIN;
SELECT set_config('app.tenant_id', :t::text, true);
SELECT set_config('lock_timeout', '5000ms', true);
INSERT INTO idempotency_keys (tenant_id, scope, key, request_hash, expires_at) VALUES (:t, 'POST /orders', 'pgb-' || :k, '\x00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff', now() + make_interval(secs => 86400)) ON CONFLICT (tenant_id, scope, key) DO UPDATE SET request_hash = EXCLUDED.request_hash, expires_at = EXCLUDED.expires_at, created_at = now(), response_status = NULL, response_content_type = NULL, response_body = NULL, completed_at = NULL WHERE idempotency_keys.expires_at <= now() RETURNING true;
SELECT set_config('lock_timeout', '0', true);
SAVEPOINT idempotent_handler;
INSERT INTO orders (tenant_id, customer_id, currency, total_cents) VALUES (:t, 'c-1', 'EUR', 2500) RETURNING order_id, status, customer_id, currency, total_cents, cancel_reason, created_at \gset
INSERT INTO order_lines (tenant_id, order_id, line_no, sku, quantity, unit_price_cents) SELECT :t, :order_id, l.n, l.sku, l.quantity, l.price FROM unnest(ARRAY['SKU-1']::text[], ARRAY[2]::int[], ARRAY[1250]::bigint[]) WITH ORDINALITY AS l(sku, quantity, price, n);
INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers) VALUES (:t, 'order', :order_id::text, 'OrderPlaced', 1, '{"order_id": 1, "customer_id": "c-1", "currency": "EUR", "total_cents": 2500, "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}]}', '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}') RETURNING id;
UPDATE idempotency_keys SET response_status = 201, response_content_type = 'application/json', response_body = convert_to('{"order_id": 1, "status": "pending", "customer_id": "c-1", "currency": "EUR", "total_cents": 2500, "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}], "created_at": "2026-01-01T00:00:00Z"}', 'UTF8'), completed_at = now() WHERE tenant_id = :t AND scope = 'POST /orders' AND key = 'pgb-' || :k;
COMMIT;
"#;

fn db_url(name: &str) -> String {
    let base = database_url();
    let cut = base.rfind('/').unwrap_or(base.len());
    format!("{}/{name}", &base[..cut])
}

struct Latencies(Vec<Duration>);

impl Latencies {
    fn quantile(&mut self, q: f64) -> Duration {
        self.0.sort_unstable();
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i]
    }

    fn summary(&mut self) -> String {
        format!(
            "p50 {:.1} p99 {:.1} max {:.1} ms",
            ms(self.quantile(0.5)),
            ms(self.quantile(0.99)),
            ms(self.quantile(1.0))
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn http(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let db = TestDb::with_migrations(&orders::MIGRATIONS).await;
    let stop = ShutdownToken::new();
    let mut common = CommonSettings::local();
    common.exchange = unique("reltest.bench.");
    let jwt = common.jwt_keys();
    let url = db_url(&db.name);
    let app = reliability::service::start(
        &orders::SERVICE,
        orders::Settings {
            role: Role::Serve,
            database_url: url.clone(),
            ..orders::Settings::local(common.clone())
        },
        Databases::connect_lazy(&url, &common)?,
        stop.clone(),
    )
    .await?;
    let base = format!("http://127.0.0.1:{}", app.port());
    tokio::spawn(app.run_until_stopped());
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    let tokens: Vec<String> = (1..=100)
        .map(|t| {
            jwt.mint(
                TenantId::new(t).expect("positive"),
                Duration::from_secs(3600),
            )
        })
        .collect();
    let body = json!({"customer_id": "c-1", "currency": "EUR",
                      "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}]})
    .to_string();
    let script = std::env::temp_dir().join(format!("bench-{}.sql", std::process::id()));
    std::fs::write(&script, PGBENCH_SQL)?;

    for conns in [1_usize, 8, 32] {
        let until = Instant::now() + s.http;
        let workers = (0..conns).map(|w| {
            let (http, base, body, tokens) = (&http, &base, &body, &tokens);
            async move {
                let mut lat = Vec::new();
                let mut i = 0;
                while Instant::now() < until {
                    i += 1;
                    let t0 = Instant::now();
                    let resp = http
                        .post(format!("{base}/orders"))
                        .bearer_auth(&tokens[(w + i) % tokens.len()])
                        .header("Idempotency-Key", format!("b-{conns}-{w}-{i}"))
                        .header("Content-Type", "application/json")
                        .body(body.clone())
                        .send()
                        .await?;
                    anyhow::ensure!(resp.status() == 201, "POST /orders: {}", resp.status());
                    lat.push(t0.elapsed());
                }
                anyhow::Ok(lat)
            }
        });
        let t0 = Instant::now();
        let mut all = Vec::new();
        for lat in futures_util::future::join_all(workers).await {
            all.extend(lat?);
        }
        let rps = all.len() as f64 / t0.elapsed().as_secs_f64();
        let pg = pgbench(&db.name, conns, s.http, &script)?;
        t.row([
            &format!("POST /orders, {conns} connection(s)"),
            &format!("{rps:.0}/s, {}", Latencies(all).summary()),
            &format!("pgbench {:.0} tps, avg {:.1} ms", pg.0, pg.1),
            &pct(rps / pg.0),
            if conns == 32 {
                ">= 60% at 32, p99 < 25 ms"
            } else {
                ""
            },
        ]);
    }
    let _ = std::fs::remove_file(&script);

    // Replays: the same key again and again.
    let post = || {
        http.post(format!("{base}/orders"))
            .bearer_auth(&tokens[0])
            .header("Idempotency-Key", "replayed-key")
            .header("Content-Type", "application/json")
            .body(body.clone())
            .send()
    };
    anyhow::ensure!(post().await?.status() == 201, "first POST");
    let mut lat = Vec::new();
    for _ in 0..s.replays {
        let t0 = Instant::now();
        let resp = post().await?;
        anyhow::ensure!(
            resp.headers().contains_key("Idempotent-Replayed"),
            "not a replay"
        );
        lat.push(t0.elapsed());
    }
    let mut lat = Latencies(lat);
    let p99 = ms(lat.quantile(0.99));
    t.row([
        &format!("idempotent replay, {} sequential", s.replays),
        &lat.summary(),
        "",
        "",
        &format!("p99 < 5 ms ({})", if p99 < 5.0 { "met" } else { "missed" }),
    ]);
    stop.cancel();
    db.cleanup().await;
    Ok(())
}

/// (tps, average latency ms) of pgbench running `script` as the runtime role.
fn pgbench(
    database: &str,
    conns: usize,
    secs: Duration,
    script: &std::path::Path,
) -> anyhow::Result<(f64, f64)> {
    let opts: sqlx::postgres::PgConnectOptions = database_url().parse()?;
    let out = std::process::Command::new("pgbench")
        .args(["-h", opts.get_host(), "-p", &opts.get_port().to_string()])
        .args(["-U", reliability::db::APP_ROLE, "-n", "-M", "prepared"])
        .args(["-c", &conns.to_string(), "-j", &conns.min(2).to_string()])
        .args(["-T", &secs.as_secs().max(1).to_string(), "-f"])
        .arg(script)
        .arg(database)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "pgbench: {}{}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |prefix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok((field("tps = "), field("latency average = ")))
}

// ---------------------------------------------------------------- end to end

/// Places one order; the time until orders and the projection show it confirmed.
async fn follow(stack: &e2e::Stack) -> anyhow::Result<(Duration, Duration)> {
    let t0 = Instant::now();
    let id = stack.order(1, "c-bench", "SKU-B", 1).await;
    let path = format!("/orders/{id}");
    let deadline = t0 + Duration::from_secs(60);
    let mut seen = [None, None];
    while seen.iter().any(Option::is_none) {
        anyhow::ensure!(Instant::now() < deadline, "order {id} never confirmed");
        if seen[0].is_none() && stack.orders.get(1, &path).await.1["status"] == "confirmed" {
            seen[0] = Some(t0.elapsed());
        }
        if seen[1].is_none() && stack.projection.get(1, &path).await.1["status"] == "confirmed" {
            seen[1] = Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok((seen[0].unwrap_or_default(), seen[1].unwrap_or_default()))
}

async fn end_to_end(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let stack = e2e::Stack::start().await?;
    stack.stock(1, "SKU-B", 1_000_000).await;
    let mut light = (Vec::new(), Vec::new());
    for _ in 0..s.e2e_light {
        let (o, p) = follow(&stack).await?;
        light.0.push(o);
        light.1.push(p);
    }
    let heavy_clients = 16;
    let runs = futures_util::future::join_all((0..heavy_clients).map(|_| async {
        let mut out = Vec::new();
        for _ in 0..s.e2e_heavy {
            out.push(follow(&stack).await?);
        }
        anyhow::Ok(out)
    }))
    .await;
    let mut heavy = (Vec::new(), Vec::new());
    for r in runs {
        for (o, p) in r? {
            heavy.0.push(o);
            heavy.1.push(p);
        }
    }
    let mut light_orders = Latencies(light.0);
    let p50 = ms(light_orders.quantile(0.5));
    t.row([
        "placed -> confirmed in orders, light (1 at a time)",
        &light_orders.summary(),
        "",
        "",
        &format!(
            "p50 < 30 ms ({})",
            if p50 < 30.0 { "met" } else { "missed" }
        ),
    ]);
    t.row([
        "placed -> confirmed in projection, light",
        &Latencies(light.1).summary(),
        "",
        "",
        "",
    ]);
    t.row([
        &format!("placed -> confirmed in orders, {heavy_clients} clients"),
        &Latencies(heavy.0).summary(),
        "",
        "",
        "",
    ]);
    t.row([
        &format!("placed -> confirmed in projection, {heavy_clients} clients"),
        &Latencies(heavy.1).summary(),
        "",
        "",
        "",
    ]);
    stack.stop().await;
    Ok(())
}

// ---------------------------------------------------------------- processes

/// The stack as separate processes, as `make up` and `make e2e` run it
/// (binaries of the bench's own profile): the order rate through the whole
/// saga, and the peak RSS of each service role under that load.
async fn processes(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    use e2e::cluster::{self, CONSUMERS, Client, Layout};
    let layout = Layout {
        name: "bench",
        port_base: 9180,
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    };
    let (mut procs, dbs) = cluster::launch(&layout, &[("RUST_LOG", "warn")]).await?;
    let client = Client::new(&layout)?;
    // The same load against a provider answering at once, in 100 ms and in
    // 300 ms (real providers: 200-800 ms); 4 fresh tenants each time.
    for (round, latency_ms) in [0_u64, 100, 300].into_iter().enumerate() {
        client
            .http
            .post(format!("{}/control/faults", layout.url("psp-sim")))
            .json(&json!({ "latency_ms": latency_ms }))
            .send()
            .await?
            .error_for_status()?;
        let first = 1 + 4 * round as i64;
        let tenants = first..=first + 3;
        for tenant in tenants.clone() {
            client
                .stock(tenant, &format!("SKU-{tenant}"), 1_000_000)
                .await?;
        }
        let t0 = Instant::now();
        let placed = futures_util::future::join_all(
            tenants
                .clone()
                .map(|tenant| client.orders(tenant, s.procs_orders)),
        )
        .await;
        let mut orders = 0;
        for p in placed {
            orders += p?.len();
        }
        let posted = t0.elapsed().as_secs_f64();
        let deadline = t0 + Duration::from_secs(600);
        for tenant in tenants {
            while !dbs.quiet(tenant).await? {
                anyhow::ensure!(Instant::now() < deadline, "tenant {tenant} never settled");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let decided = t0.elapsed().as_secs_f64();
        let (decided_rate, accepted_rate) = (orders as f64 / decided, orders as f64 / posted);
        println!(
            "   provider {latency_ms} ms: {decided_rate:.0} decided/s, {accepted_rate:.0} accepted/s"
        );
        t.row([
            &format!(
                "orders through the saga, as processes, provider {latency_ms} ms: {orders} orders, 4 tenants x 16 clients"
            ),
            &format!("{decided_rate:.0} orders/s decided"),
            &format!("{accepted_rate:.0} orders/s accepted"),
            &pct(decided_rate / accepted_rate),
            match latency_ms {
                0 => "decided >= 90% of accepted",
                100 => "decided >= 200/s",
                _ => "",
            },
        ]);
    }
    let rss = procs.peak_rss_kib();
    procs.stop_all();
    let mib = |name: &str| rss.get(name).map(|kib| kib / 1024);
    for svc in ["orders", "inventory", "payments", "projection"] {
        let roles: Vec<String> = ["api", "consumer", "relay"]
            .iter()
            .filter_map(|role| Some(format!("{role} {}", mib(&format!("{svc}-{role}"))?)))
            .collect();
        t.row([
            &format!("peak RSS under that load, {svc}"),
            &format!("{} MiB", roles.join(" / ")),
            "",
            "",
            "one process per role",
        ]);
    }
    t.row([
        "peak RSS under that load, provider simulator",
        &format!("{} MiB", mib("psp-sim").unwrap_or_default()),
        "",
        "",
        "",
    ]);
    // Leave nothing behind: the databases and the run's queues and exchange.
    for pool in [&dbs.orders, &dbs.inventory, &dbs.payments, &dbs.projection] {
        pool.close().await;
    }
    cluster::drop_databases(&layout).await?;
    let queues: Vec<String> = CONSUMERS
        .iter()
        .map(|c| format!("{}{c}", layout.queue_prefix()))
        .collect();
    reliability::testing::delete_broker_objects(&queues, &format!("{}.events", layout.name)).await;
    Ok(())
}

// ---------------------------------------------------------------- machine

/// CPU seconds (user + system) this process used so far.
fn cpu_self() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15; 11 and 12 after the ")".
    (ticks(11) + ticks(12)) / 100.0
}

fn command_output(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn write_report(table: &Table, secs: u64) -> anyhow::Result<()> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name\t: ").map(str::to_owned))
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    let doc = format!(
        "# Benchmarks\n\n\
         The latest `make bench` run, written by the bench itself (`bench/src/main.rs`).\n\
         Every figure stands next to the raw limit of the same PostgreSQL and RabbitMQ\n\
         on the same machine, measured in the same run.\n\n\
         ## How to reproduce\n\n\
         ```sh\nmake bench          # release build, about {mins} min; rewrites this file\n\
         make bench-smoke    # seconds, what CI runs\n```\n\n\
         ## Machine\n\n\
         - {} cores, {cpu}\n- {mem}\n- {}\n- RabbitMQ {}\n- run took {secs} s, finished {}\n\n\
         ## Results\n\n{}\n\
         See the analysis below the table for what bounds each figure.\n",
        std::thread::available_parallelism().map_or(0, usize::from),
        command_output(
            "psql",
            &[
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-Atc",
                "SELECT version()"
            ]
        ),
        command_output("rabbitmqctl", &["-q", "version"]),
        command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        table.markdown(),
        mins = secs.div_ceil(60),
    );
    // Hand-written analysis lives below the marker and is kept across runs.
    let path = std::path::Path::new("docs/benchmarks.md");
    let kept = std::fs::read_to_string(path)
        .ok()
        .and_then(|old| old.split_once(ANALYSIS).map(|(_, rest)| rest.to_owned()))
        .unwrap_or_else(|| "\n".into());
    std::fs::write(path, format!("{doc}\n{ANALYSIS}{kept}"))?;
    Ok(())
}

const ANALYSIS: &str = "<!-- analysis: kept across runs -->";
