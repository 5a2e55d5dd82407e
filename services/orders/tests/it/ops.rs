//! Every process role is observable: each serves `/healthz`, `/readyz` and
//! `/metrics` on an ops port of its own, on loopback unless told otherwise,
//! and `/readyz` says why a part is not doing its job. An API port tells an
//! anonymous caller nothing about tenants.

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use orders::{SERVICE, Settings};
use reliability::broker;
use serde_json::Value;
use service_kit::service::{self, CommonSettings, Role, ShutdownToken};
use std::time::Duration;
use testkit::{TestDb, amqp_url, delete_broker_objects, unique, wait_until};

async fn get(port: u16, path: &str) -> (u16, String) {
    let resp = reqwest::get(format!("http://127.0.0.1:{port}{path}"))
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn settings(role: Role, common: CommonSettings) -> Settings {
    Settings {
        role,
        ..Settings::local(common)
    }
}

fn common() -> CommonSettings {
    let mut common = testkit::common_settings();
    common.exchange = unique("reltest.ops.");
    common.queue_prefix = unique("reltest.ops.");
    common
}

/// A relay process of orders on `db`, running until `stop`: its ops port.
async fn start_relay(db: &TestDb, common: &CommonSettings, stop: &ShutdownToken) -> u16 {
    let app = service::start(
        &SERVICE,
        settings(Role::Relay, common.clone()),
        db.databases(),
        stop.clone(),
    )
    .await
    .unwrap();
    let port = app.ops_port();
    tokio::spawn(app.run_until_stopped());
    port
}

fn queues(common: &CommonSettings) -> Vec<String> {
    contracts::topology::ALL
        .iter()
        .map(|s| common.queue_spec(s).unwrap().queue)
        .collect()
}

#[tokio::test]
async fn relay_and_consumer_processes_serve_health_readiness_and_their_metrics() {
    let db = TestDb::with_migrations(&orders::MIGRATIONS).await;
    let common = common();
    let stop = ShutdownToken::new();
    let mut ports = Vec::new();
    for role in [Role::Relay, Role::Consume] {
        let app = service::start(
            &SERVICE,
            settings(role, common.clone()),
            db.databases(),
            stop.clone(),
        )
        .await
        .unwrap();
        ports.push(app.ops_port());
        tokio::spawn(app.run_until_stopped());
    }
    for (port, part, metric) in [
        (ports[0], "relay", "outbox_lag_seconds"),
        (ports[1], "consumer orders.saga", "consumer_dlq_depth"),
    ] {
        assert_eq!(get(port, "/healthz").await.0, 200);
        wait_until(
            Duration::from_secs(20),
            &format!("{part} ready"),
            || async {
                let (status, body) = get(port, "/readyz").await;
                let body: Value = serde_json::from_str(&body).unwrap();
                // A consumer of several lanes reports each (`… lane 0`).
                let parts: Vec<&Value> = body["parts"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(name, _)| name.starts_with(part))
                    .map(|(_, v)| v)
                    .collect();
                status == 200 && !parts.is_empty() && parts.iter().all(|v| *v == "ok")
            },
        )
        .await;
        wait_until(
            Duration::from_secs(20),
            &format!("{metric} exported"),
            || async { get(port, "/metrics").await.1.contains(metric) },
        )
        .await;
    }
    stop.cancel();
    delete_broker_objects(&queues(&common), &common.exchange).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_relay_that_cannot_declare_its_topology_is_not_ready_and_says_why() {
    let db = TestDb::with_migrations(&orders::MIGRATIONS).await;
    let common = common();
    // A classic queue squats on the name of the saga's quorum queue.
    let squatter = common
        .queue_spec(&contracts::topology::ORDERS_SAGA)
        .unwrap()
        .queue;
    let conn = broker::connect(&amqp_url(), "ops-test").await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            squatter.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let stop = ShutdownToken::new();
    let port = start_relay(&db, &common, &stop).await;
    wait_until(
        Duration::from_secs(20),
        "the relay reports why it waits",
        || async {
            let (status, body) = get(port, "/readyz").await;
            let body: Value = serde_json::from_str(&body).unwrap();
            status == 503
                && body["parts"]["relay"]
                    .as_str()
                    .is_some_and(|why| why.contains("topology"))
        },
    )
    .await;
    stop.cancel();
    let _ = conn.close(200, "done".into()).await;
    delete_broker_objects(&queues(&common), &common.exchange).await;
    db.cleanup().await;
}

/// The API open to the world (`BIND_ADDRESS=0.0.0.0`), the ops port left
/// at its default. Tenant 2's orders must not show to a caller without a
/// token: no series on any path of the API port, and the ops port (whose
/// metrics count them) unreachable from outside this host.
#[tokio::test]
async fn an_anonymous_caller_of_the_api_port_learns_nothing_of_a_tenants_volume() {
    let app = crate::TestApp::spawn_with(|c| {
        c.bind_address = "0.0.0.0".into();
        c.auth.jwt_secret = Some("a-secret-of-this-test-only-32-bytes-or-more".into());
    })
    .await;
    for i in 0..5 {
        let (status, _, _) = app.place(2, &format!("k{i}"), crate::ORDER).await;
        assert_eq!(status, 201);
    }
    assert!(app.metrics().await.contains("http_requests_total"));
    let port = app
        .api
        .url
        .rsplit(':')
        .next()
        .unwrap()
        .parse::<u16>()
        .unwrap();
    for path in [
        "/metrics",
        "/metrics/per-object",
        "/readyz",
        "/healthz",
        "/orders",
        "/stats",
    ] {
        let (_, body) = get(port, path).await;
        for word in [
            "# TYPE",
            "http_requests",
            "tenant",
            "outbox",
            "_total",
            "parts",
        ] {
            assert!(!body.contains(word), "{path} says {word}: {body}");
        }
    }
    // (`/openapi.json` is the contract, the same for everyone.)
    // From another address of this host, as a caller elsewhere would come.
    let ops: u16 = app.ops.rsplit(':').next().unwrap().parse().unwrap();
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    if let Some(here) = probe
        .connect("192.0.2.1:9")
        .ok()
        .and_then(|()| probe.local_addr().ok())
        .map(|a| a.ip())
        .filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
    {
        assert!(
            std::net::TcpStream::connect((here, port)).is_ok(),
            "the API at {here}"
        );
        assert!(
            std::net::TcpStream::connect((here, ops)).is_err(),
            "the ops port answers at {here}"
        );
    } else {
        eprintln!("no address but loopback here: the reach check is skipped");
    }
    app.stop().await;
}

#[test]
fn help_never_prints_a_secret_the_environment_holds() {
    let secret = "s3cret-in-the-environment";
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orders"))
        .arg("--help")
        .env("JWT_SECRET", format!("{secret}-at-least-32-bytes-long"))
        .env(
            "ORDERS_DATABASE_URL",
            format!("postgres://u:{secret}@127.0.0.1:1/orders"),
        )
        .env("AMQP_URL", format!("amqp://u:{secret}@127.0.0.1:1/%2f"))
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    assert!(help.contains("JWT_SECRET"), "names the variable:\n{help}");
    assert!(!help.contains(secret), "printed a secret:\n{help}");
}

/// A server with no connection slots left (53300: here the database's
/// own limit, reached as the server's would be by a scale-out) makes the
/// process not ready, and `/readyz` says so in the server's words. Before,
/// every process said only that its pool timed out.
#[tokio::test]
async fn a_server_with_no_connection_slots_left_is_named_by_readyz() {
    let db = TestDb::with_migrations(&orders::MIGRATIONS).await;
    let common = common();
    let stop = ShutdownToken::new();
    let port = start_relay(&db, &common, &stop).await;
    wait_until(Duration::from_secs(20), "ready", || async {
        get(port, "/readyz").await.0 == 200
    })
    .await;
    // No new connection to the database for anyone but a superuser, and
    // the ones open are gone.
    let full = |limit: i32| format!(r#"ALTER DATABASE "{}" CONNECTION LIMIT {limit}"#, db.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(full(0)))
        .execute(&db.admin)
        .await
        .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = $1 AND pid <> pg_backend_pid() AND usename <> current_user",
    )
    .bind(&db.name)
    .execute(&db.admin)
    .await
    .unwrap();
    wait_until(
        Duration::from_secs(20),
        "readyz names the cause",
        || async {
            let (status, body) = get(port, "/readyz").await;
            let body: Value = serde_json::from_str(&body).unwrap();
            status == 503
                && body["database"] == false
                && body["database_cause"]
                    .as_str()
                    .is_some_and(|c| c.contains("no connection slots left") && c.contains("53300"))
        },
    )
    .await;
    stop.cancel();
    sqlx::raw_sql(sqlx::AssertSqlSafe(full(-1)))
        .execute(&db.admin)
        .await
        .unwrap();
    delete_broker_objects(&queues(&common), &common.exchange).await;
    db.cleanup().await;
}
