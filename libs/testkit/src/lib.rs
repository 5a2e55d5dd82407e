//! Test support (feature `testing`): a fresh database per test with the
//! three roles, unique broker names, a TCP proxy that can cut the broker off,
//! and waiting on a condition with a deadline instead of sleeping.
//!
//! `DATABASE_URL` is a superuser URL (default: the local server as
//! `postgres`); roles log in the same way, with no password (trust auth, as
//! on the dev machine and in CI). `AMQP_URL` defaults to the local broker.

use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::{Duration, Instant};

use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Executor, PgPool};

use reliability::db;

pub mod browser;

mod logical;
pub use logical::logical_decoding;

mod broker;
pub use broker::Broker;

mod proxy;
pub use proxy::{TcpProxy, broker_addr, postgres_addr};

mod appliers;
pub use appliers::{AppliersCheck, assert_competing_appliers_agree, event, race};

mod serve;
pub use serve::{Served, serve};

mod sources;
pub use sources::{SourceDbs, seeded_sources};

pub const TEST_DATABASE_PREFIX: &str = "reltest_";

/// How long a test waits on a condition before it fails.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// A tenant id a test knows to be valid.
pub fn tenant(id: i64) -> reliability::TenantId {
    reliability::TenantId::new(id).expect("a test's tenant id is positive")
}

pub fn database_url() -> String {
    reliability::db::use_one_crypto_provider();
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

pub fn amqp_url() -> String {
    reliability::db::use_one_crypto_provider();
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// The management API of `AMQP_URL`'s broker: `RABBITMQ_MANAGEMENT_URL`,
/// or the local one's.
pub fn management_url() -> String {
    std::env::var("RABBITMQ_MANAGEMENT_URL")
        .unwrap_or_else(|_| service_kit::bindings::MANAGEMENT_URL.to_owned())
}

/// A service's shared settings for a test: the local defaults, but the
/// broker of `AMQP_URL` (the one every other part of the test talks to).
pub fn common_settings() -> service_kit::service::CommonSettings {
    service_kit::service::CommonSettings {
        amqp_url: amqp_url(),
        ..service_kit::service::CommonSettings::local()
    }
}

/// Sends this process's logs (`RUST_LOG`, default `warn`) to the test's
/// captured output, so a failing test shows what the services said (a
/// refused publish, a reconnect) and a passing one stays quiet.
pub fn capture_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    use tracing_subscriber::prelude::*;
    // Already installed by an earlier call in this process: keep it.
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_test_writer()
                .with_filter(filter),
        )
        .with(reliability::trace::layer())
        .try_init();
}

/// `prefix` plus 12 random hex digits: names that never collide across tests.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A database of its own for one test, migrated, with a pool per role.
pub struct TestDb {
    pub name: String,
    pub owner: PgPool,
    pub app: PgPool,
    pub relay: PgPool,
    /// The superuser connection (server-wide views such as `pg_stat_activity`).
    pub admin: PgPool,
}

/// A test's pool: small, and giving idle connections back within seconds.
/// A stack of four services is sixteen pools; two stacks side by side with
/// production-sized pools that keep what they once opened went past
/// PostgreSQL's default 100 connections, and a relay that cannot connect
/// backs off (a CI flake: an outbox not drained in time).
async fn test_pool(options: PgConnectOptions, max_connections: u32) -> reliability::Result<PgPool> {
    Ok(db::pool_options()
        .max_connections(max_connections)
        .idle_timeout(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await?)
}

impl TestDb {
    /// The reliability tables only.
    pub async fn new() -> Self {
        Self::create(None).await
    }

    /// The reliability tables and a service's migrations.
    pub async fn with_migrations(service: &Migrator) -> Self {
        Self::create(Some(service)).await
    }

    async fn create(service: Option<&Migrator>) -> Self {
        capture_logs();
        let admin_opts =
            PgConnectOptions::from_str(&database_url()).expect("DATABASE_URL is a valid URL");
        let admin = test_pool(admin_opts.clone(), 1)
            .await
            .expect("connect to DATABASE_URL as a superuser");
        db::ensure_roles(&admin).await.expect("create roles");
        let name = unique(TEST_DATABASE_PREFIX);
        db::ensure_database(&admin, &name)
            .await
            .expect("create test database");
        let base = admin_opts.database(&name);
        let owner = test_pool(db::options_for_role(&base, db::OWNER_ROLE), 3)
            .await
            .expect("connect as owner");
        db::migrate(&owner, service)
            .await
            .expect("migrate test database");
        let app = test_pool(db::options_for_role(&base, db::APP_ROLE), 10)
            .await
            .expect("connect as app");
        let relay = test_pool(db::options_for_role(&base, db::RELAY_ROLE), 6)
            .await
            .expect("connect as relay");
        Self {
            name,
            owner,
            app,
            relay,
            admin,
        }
    }

    /// The pools as a service takes them.
    pub fn databases(&self) -> service_kit::service::Databases {
        service_kit::service::Databases {
            app: self.app.clone(),
            relay: self.relay.clone(),
            owner: self.owner.clone(),
            replication_url: Some(self.url()),
        }
    }

    /// The superuser's URL of this database (a role with REPLICATION too).
    pub fn url(&self) -> String {
        let url = database_url();
        let (server, _) = url.rsplit_once('/').expect("a database in DATABASE_URL");
        format!("{server}/{}", self.name)
    }

    /// A pool of its own for `role` with at most `max` connections: a test
    /// that needs a small pool, or a session setting of its own.
    pub async fn pool_as(&self, role: &str, max: u32) -> PgPool {
        let base = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL is a valid URL")
            .database(&self.name);
        test_pool(db::options_for_role(&base, role), max)
            .await
            .expect("connect as the role")
    }

    /// A pool for `role` that connects through `via` (a [`TcpProxy`] in front
    /// of PostgreSQL), so a test can cut the database off.
    pub async fn pool_via(&self, role: &str, via: SocketAddr) -> PgPool {
        let base = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL is a valid URL")
            .database(&self.name)
            .host(&via.ip().to_string())
            .port(via.port());
        // The role's own password where PostgreSQL asks for one.
        let opts = db::options_for_role(&base, role);
        db::pool_options()
            .max_connections(4)
            .acquire_timeout(Duration::from_millis(200))
            .connect_lazy_with(opts)
    }

    /// Drops the database. Tests that fail leave theirs behind; `make test`
    /// removes every `reltest_*` database before it runs.
    pub async fn cleanup(self) {
        self.app.close().await;
        self.relay.close().await;
        self.owner.close().await;
        // A replication slot on it (the log relay's) would refuse the drop.
        logical::drop_slots(&self.admin, &self.name).await;
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        let _ = self.admin.execute(sqlx::AssertSqlSafe(sql)).await;
    }
}

/// Polls `condition` every 20 ms until it holds; panics naming `what` if it
/// still does not after `deadline`.
pub async fn wait_until<F, Fut>(deadline: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if condition().await {
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client of one service's HTTP API that signs as any tenant: the typed
/// request helpers of every service's tests.
#[derive(Clone)]
pub struct ApiClient {
    pub url: String,
    pub jwt: service_kit::auth::JwtKeys,
    pub http: reqwest::Client,
}

/// Status, whether it was a replay, and the JSON body (Null if none).
pub type Answer = (u16, bool, serde_json::Value);

impl ApiClient {
    pub fn new(port: u16, jwt: service_kit::auth::JwtKeys) -> Self {
        Self {
            url: format!("http://127.0.0.1:{port}"),
            jwt,
            http: reqwest::Client::new(),
        }
    }

    pub fn token(&self, tenant: i64) -> String {
        self.jwt.mint(
            reliability::TenantId::new(tenant).expect("positive tenant"),
            Duration::from_secs(600),
        )
    }

    /// POST `body` (raw JSON text) to `path` as `tenant` with `Idempotency-Key: key`.
    pub async fn post(&self, tenant: i64, path: &str, key: &str, body: &str) -> Answer {
        let resp = self
            .http
            .post(format!("{}{path}", self.url))
            .bearer_auth(self.token(tenant))
            .header("Idempotency-Key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("request sent");
        let status = resp.status().as_u16();
        let replayed = resp
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        (
            status,
            replayed,
            resp.json().await.unwrap_or(serde_json::Value::Null),
        )
    }

    /// GET `path` as `tenant`.
    pub async fn get(&self, tenant: i64, path: &str) -> (u16, serde_json::Value) {
        let resp = self
            .http
            .get(format!("{}{path}", self.url))
            .bearer_auth(self.token(tenant))
            .send()
            .await
            .expect("request sent");
        (
            resp.status().as_u16(),
            resp.json().await.unwrap_or(serde_json::Value::Null),
        )
    }
}

/// Waits until every queue in `queues` exists, so that nothing a test
/// publishes is returned as unroutable (and backed off) before its consumer
/// has declared and bound its queue.
pub async fn wait_for_queues(queues: &[String]) {
    let conn = reliability::broker::connect(&amqp_url(), "reliability-tests")
        .await
        .expect("connect to AMQP_URL");
    for queue in queues {
        wait_until(
            Duration::from_secs(20),
            &format!("queue {queue} declared"),
            || async {
                // A failed passive declare closes its channel: probe on a fresh one.
                let Ok(probe) = reliability::broker::bounded(conn.create_channel()).await else {
                    return false;
                };
                reliability::broker::bounded(reliability::broker::queue_depth(&probe, queue))
                    .await
                    .is_ok()
            },
        )
        .await;
    }
    // lapin can leave a close pending forever over a connection reset:
    // bounded, like every call of the library.
    let _ = reliability::broker::bounded(conn.close(200, "queues seen".into())).await;
}

/// Deletes a test's queues (with their DLQs, and for an ordered
/// subscription's queue its partitions' exchange) and exchange (with its
/// DLX). Quorum queues are Raft groups: left behind, hundreds of them slow
/// the whole broker down. Pass an ordered subscription's `queues()` and
/// its `queue`.
pub async fn delete_broker_objects(queues: &[String], exchange: &str) {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let Ok(conn) = reliability::broker::connect(&amqp_url(), "reliability-tests-cleanup").await
    else {
        return;
    };
    let Ok(channel) = conn.create_channel().await else {
        return;
    };
    for queue in queues {
        for name in [queue.clone(), reliability::broker::dead_letter_queue(queue)] {
            let _ = channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
    let partitions = queues.iter().map(|q| format!("{q}.partitions"));
    for name in partitions.chain([
        exchange.to_owned(),
        reliability::broker::dead_letter_exchange(exchange),
    ]) {
        let _ = channel
            .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    let _ = reliability::broker::bounded(conn.close(200, "cleaned up".into())).await;
}

/// `false`, after saying why a test is skipped here: `why` it cannot run.
/// Panics instead where `var` is `required` (CI, which installs or sets
/// up what the test needs: `setup` says where).
pub fn skipped(var: &str, why: &str, setup: &str) -> bool {
    assert!(
        std::env::var(var).as_deref() != Ok("required"),
        "{why}: CI runs these tests ({setup})"
    );
    eprintln!("skipped: {why} ({setup})");
    false
}
