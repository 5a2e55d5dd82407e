//! `POST /orders` at 1, 8 and 32 connections against pgbench running the
//! same transaction, and the idempotent replay.

use std::time::{Duration, Instant};

use reliability::TenantId;
use serde_json::json;
use service_kit::service::{CommonSettings, Databases, Role, ShutdownToken};
use testkit::{TestDb, database_url, unique};

use crate::{Latencies, Sizes, Table, ms, pct};

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

pub(crate) async fn http(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let db = TestDb::with_migrations(&orders::MIGRATIONS).await;
    let stop = ShutdownToken::new();
    let mut common = CommonSettings::local();
    common.exchange = unique("reltest.bench.");
    // No saga runs here: every order stays pending. The front door's own
    // cost is measured, not admission (the processes part measures that).
    common.admission_max_in_flight = 0;
    let jwt = common.jwt_keys();
    let url = db_url(&db.name);
    let app = service_kit::service::start(
        &orders::SERVICE,
        orders::Settings {
            role: Role::Serve,
            database_url: url.clone(),
            ..orders::Settings::local(common.clone())
        },
        Databases::connect_lazy(&url, &common, "bench-orders")?,
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
