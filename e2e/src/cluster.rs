//! The stack as real processes, as `make e2e` and `make bench` run it: four
//! fresh databases, queues and an exchange named after the run, each
//! service role (api, consumer, relay) a process of its own, and a client
//! that retries like a real one.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use reliability::auth::JwtKeys;
use reliability::testing::{amqp_url, database_url};
use reliability::{TenantId, db};
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;

use crate::check::Dbs;
use crate::procs::Cluster;

pub const CONSUMERS: [&str; 6] = [
    "orders.saga",
    "inventory.stock",
    "payments.charges",
    "projection.views",
    "projection.history",
    "graph.edges",
];

/// The most partitions a run gives an ordered subscription (the K change
/// scenario goes to 8): what setup and cleanup sweep.
pub const MAX_PARTITIONS: u16 = 8;

/// The queues the stack's events wait in, with `prefix`: each order-free
/// subscription's queue, each ordered one's partitions (the code's K).
pub fn queues(prefix: &str) -> Vec<String> {
    queues_of(contracts::topology::ALL, prefix)
}

/// The queues `subscriptions` consume from, partitions included.
fn queues_of<'a>(
    subscriptions: impl IntoIterator<Item = &'a contracts::topology::Subscription>,
    prefix: &str,
) -> Vec<String> {
    subscriptions
        .into_iter()
        .flat_map(|s| reliability::broker::QueueSpec::for_subscription(s, "", prefix).queues())
        .collect()
}

/// Every queue name the stack may have made (for deletion): the
/// subscriptions' own names and partitions up to [`MAX_PARTITIONS`].
pub fn queue_names(prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    for sub in contracts::topology::ALL {
        let mut spec = reliability::broker::QueueSpec::for_subscription(sub, "", prefix);
        names.push(spec.queue.clone());
        if spec.is_ordered() {
            spec.partitions = MAX_PARTITIONS;
            names.extend(spec.queues());
        }
    }
    names
}
/// The services a run starts, in the roster's order (services/roster.txt).
pub fn services() -> Vec<&'static str> {
    contracts::roster::names()
}

/// The graph service's FalkorDB: the world's (`GRAPH_URL`), else the one
/// `scripts/falkordb.sh` starts on this machine.
pub fn graph_url() -> String {
    std::env::var("GRAPH_URL").unwrap_or_else(|_| "falkor://127.0.0.1:6380".into())
}
pub const SECRET: &str = "cluster-secret";

/// Where a run lives: databases `{name}_orders`…, exchange `{name}.events`,
/// queues `{name}.…`, graph `{name}` on [`graph_url`], ports
/// `port_base + 1..=5` (the services, in
/// [`services`] order) and `port_base + 19` (the provider simulator; not
/// `+ 10`, which is 9090 for e2e: the compose stack's Prometheus),
/// binaries from `target/{profile}`, logs in `.run/{name}/`.
pub struct Layout {
    pub name: &'static str,
    pub port_base: u16,
    pub profile: &'static str,
}

impl Layout {
    pub fn queue_prefix(&self) -> String {
        format!("{}.", self.name)
    }

    pub fn port(&self, service: &str) -> u16 {
        let i = services().iter().position(|s| *s == service);
        self.port_base + i.map_or(19, |i| i as u16 + 1)
    }

    pub fn url(&self, service: &str) -> String {
        format!("http://127.0.0.1:{}", self.port(service))
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
            .join(self.profile)
            .join(name)
    }
}

/// Fresh databases (migrated), no queues left from an earlier run, and every
/// role of every service started and ready. `env` adds to or overrides the
/// processes' environment.
pub async fn launch(layout: &Layout, env: &[(&str, &str)]) -> anyhow::Result<(Cluster, Dbs)> {
    launch_built(layout, env, None).await
}

/// As [`launch`], from the binaries in `bins` when given (another build of
/// the platform, e.g. the bench's baseline): each service's schema is then
/// made by its own binary's `migrate`, not by this tree's migrations.
pub async fn launch_built(
    layout: &Layout,
    env: &[(&str, &str)],
    bins: Option<&Path>,
) -> anyhow::Result<(Cluster, Dbs)> {
    let bin = |name: &str| bins.map_or_else(|| layout.bin(name), |dir| dir.join(name));
    let admin_opts = PgConnectOptions::from_str(&database_url())?;
    let admin = db::pool(admin_opts.clone(), 2).await?;
    db::ensure_roles(&admin).await?;
    let mut owners = Vec::new();
    drop_databases(layout).await?;
    for (service, migrations) in [
        ("orders", &orders::MIGRATIONS),
        ("inventory", &inventory::MIGRATIONS),
        ("payments", &payments::MIGRATIONS),
        ("projection", &projection::MIGRATIONS),
        ("graph", &graph::MIGRATIONS),
    ] {
        let name = format!("{}_{service}", layout.name);
        db::ensure_database(&admin, &name).await?;
        let owner = db::pool(
            db::options_for_role(&admin_opts.clone().database(&name), db::OWNER_ROLE),
            4,
        )
        .await?;
        if bins.is_none() {
            db::migrate(&owner, Some(migrations)).await?;
        }
        owners.push(owner);
    }
    let dbs = Dbs {
        orders: owners[0].clone(),
        inventory: owners[1].clone(),
        payments: owners[2].clone(),
        projection: owners[3].clone(),
        // Another build (the bench's baseline) may have no graph service.
        graph: bin("graph").exists().then(|| {
            let store = graph::store::Store::new(&graph_url(), layout.name);
            std::sync::Arc::new(store)
        }),
    };
    if let Some(graph) = &dbs.graph {
        graph
            .delete()
            .await
            .map_err(|e| anyhow::anyhow!("the graph of an earlier run: {e}"))?;
    }

    // Queues of an earlier run would deliver its events into these fresh databases.
    let prefix = layout.queue_prefix();
    let conn = reliability::broker::connect(&amqp_url(), "cluster-setup").await?;
    let channel = conn.create_channel().await?;
    for c in queue_names(&prefix) {
        for q in [c.clone(), reliability::broker::dead_letter_queue(&c)] {
            channel
                .queue_delete(
                    q.as_str().into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await?;
        }
        // An ordered subscription's hash exchange keeps the bindings of
        // partitions an earlier run had, beyond this run's K.
        channel
            .exchange_delete(
                format!("{c}.partitions").as_str().into(),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await?;
    }
    conn.close(200, "setup done".into()).await?;

    let pg = format!(
        "postgres://{}:{}",
        admin_opts.get_host(),
        admin_opts.get_port()
    );
    let mut vars: Vec<(String, String)> = vec![
        ("AMQP_URL".into(), amqp_url()),
        ("EVENTS_EXCHANGE".into(), format!("{}.events", layout.name)),
        ("QUEUE_PREFIX".into(), prefix.clone()),
        ("JWT_SECRET".into(), SECRET.into()),
        ("PSP_SIM_PORT".into(), layout.port("psp-sim").to_string()),
        ("PSP_URL".into(), layout.url("psp-sim")),
        ("PSP_LEASE_SECS".into(), "2".into()),
        ("PSP_TIMEOUT_MS".into(), "1000".into()),
        // The simulator's late landings take 2 s: a look-up that finds
        // nothing is final after 5; reconciliation every 5 s.
        ("PSP_LOOKUP_GRACE_SECS".into(), "5".into()),
        ("PSP_RECONCILE_INTERVAL_SECS".into(), "5".into()),
        ("PSP_RECONCILE_WINDOW_HOURS".into(), "1".into()),
        ("RUST_LOG".into(), "info".into()),
        ("GRAPH_URL".into(), graph_url()),
        ("GRAPH_NAME".into(), layout.name.into()),
    ];
    for svc in services() {
        let upper = svc.to_uppercase();
        vars.push((
            format!("{upper}_DATABASE_URL"),
            format!("{pg}/{}_{svc}", layout.name),
        ));
        vars.push((format!("{upper}_PORT"), layout.port(svc).to_string()));
    }
    for (k, v) in env {
        vars.retain(|(name, _)| name != k);
        vars.push(((*k).to_owned(), (*v).to_owned()));
    }
    let services: Vec<&contracts::roster::Service> = contracts::roster::services()
        .iter()
        .filter(|svc| bin(svc.name).exists())
        .collect();
    if bins.is_some() {
        for svc in services.iter().map(|s| s.name) {
            let out = std::process::Command::new(bin(svc))
                .arg("migrate")
                .envs(vars.iter().map(|(k, v)| (k, v)))
                .output()?;
            anyhow::ensure!(
                out.status.success(),
                "{} migrate: {}",
                bin(svc).display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let mut cluster = Cluster::new(
        vars,
        PathBuf::from(".run").join(layout.name),
        layout.port_base + 200,
    )?;
    cluster.add("psp-sim", bin("psp-sim"), &[], Some(layout.port("psp-sim")));
    for service in services {
        let (svc, bin) = (service.name, bin(service.name));
        cluster.add(
            &format!("{svc}-api"),
            bin.clone(),
            &["serve"],
            Some(layout.port(svc)),
        );
        cluster.add(&format!("{svc}-consumer"), bin.clone(), &["consume"], None);
        if service.outbox {
            cluster.add(&format!("{svc}-relay"), bin, &["relay"], None);
        }
    }
    cluster.start_all()?;
    cluster.wait_ready().await?;
    let expected = if bins.is_none() {
        queues(&prefix)
    } else {
        // Another build (the bench's baseline, 953eb30) predates ordered
        // subscriptions (docs/adr/0028) and may lack a service of today's
        // roster: it declares only the order-free queues of the services
        // it has.
        queues_of(
            contracts::topology::ALL.iter().filter(|s| {
                s.partitions == 0 && bin(s.consumer.split('.').next().unwrap_or_default()).exists()
            }),
            &prefix,
        )
    };
    reliability::testing::wait_for_queues(&expected).await;
    Ok((cluster, dbs))
}

/// Drops the run's databases, with whatever is still connected to them.
pub async fn drop_databases(layout: &Layout) -> anyhow::Result<()> {
    let admin = db::pool(PgConnectOptions::from_str(&database_url())?, 1).await?;
    for svc in services() {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {}_{svc} WITH (FORCE)",
            layout.name
        )))
        .execute(&admin)
        .await?;
    }
    admin.close().await;
    Ok(())
}

/// A client of the stack that retries like a real one.
pub struct Client {
    pub http: reqwest::Client,
    pub jwt: JwtKeys,
    orders: String,
    inventory: String,
    pub payments: String,
    /// Answers 500 and 503 seen by `post`: a dependency outage must be
    /// the one, never the other.
    pub answered_500: std::sync::atomic::AtomicU64,
    pub answered_503: std::sync::atomic::AtomicU64,
}

impl Client {
    pub fn new(layout: &Layout) -> anyhow::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
            jwt: JwtKeys::from_secret(SECRET.as_bytes()),
            orders: layout.url("orders"),
            inventory: layout.url("inventory"),
            payments: layout.url("payments"),
            answered_500: Default::default(),
            answered_503: Default::default(),
        })
    }

    pub fn token(&self, tenant: i64) -> String {
        self.jwt.mint(
            TenantId::new(tenant).expect("positive"),
            Duration::from_secs(3600),
        )
    }

    /// POSTs with the same key until the answer is known (a client that
    /// retries timeouts, resets, 5xx, 425 and 429, the last two after their
    /// `Retry-After`, at most 1 s here): the operation's outcome.
    pub async fn post(
        &self,
        tenant: i64,
        url: &str,
        key: &str,
        body: &Value,
    ) -> anyhow::Result<(u16, Value)> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let sent = self
                .http
                .post(url)
                .bearer_auth(self.token(tenant))
                .header("Idempotency-Key", key)
                .json(body)
                .send()
                .await;
            if let Ok(resp) = sent {
                let status = resp.status().as_u16();
                let counter = match status {
                    500 => Some(&self.answered_500),
                    503 => Some(&self.answered_503),
                    _ => None,
                };
                if let Some(c) = counter {
                    c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                if status < 500 && status != 425 && status != 429 {
                    return Ok((status, resp.json().await.unwrap_or(Value::Null)));
                }
                let wait = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                    .map_or(Duration::ZERO, |s| {
                        Duration::from_secs(s).min(Duration::from_secs(1))
                    });
                tokio::time::sleep(wait).await;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{url} with key {key} never answered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One stock adjustment of `delta` under the Idempotency-Key `key`.
    pub async fn adjust(
        &self,
        tenant: i64,
        sku: &str,
        delta: i64,
        key: &str,
    ) -> anyhow::Result<()> {
        let body = json!({"sku": sku, "delta": delta, "reason": "e2e"});
        let url = format!("{}/stock/adjustments", self.inventory);
        let (status, body) = self.post(tenant, &url, key, &body).await?;
        anyhow::ensure!(status == 201, "adjust {sku}: {status} {body}");
        Ok(())
    }

    pub async fn stock(&self, tenant: i64, sku: &str, units: i64) -> anyhow::Result<()> {
        let body = json!({"sku": sku, "delta": units, "reason": "e2e"});
        let url = format!("{}/stock/adjustments", self.inventory);
        let (status, body) = self
            .post(tenant, &url, &format!("stock-{tenant}-{sku}"), &body)
            .await?;
        anyhow::ensure!(status == 201, "stock: {status} {body}");
        Ok(())
    }

    pub async fn order(
        &self,
        tenant: i64,
        key: &str,
        customer: &str,
        sku: &str,
        quantity: i64,
    ) -> anyhow::Result<i64> {
        let body = json!({"customer_id": customer, "currency": "EUR", "lines": [{"sku": sku, "quantity": quantity, "unit_price_cents": 1250}]});
        let url = format!("{}/orders", self.orders);
        let (status, body) = self.post(tenant, &url, key, &body).await?;
        anyhow::ensure!(status == 201, "order: {status} {body}");
        body["order_id"]
            .as_i64()
            .ok_or_else(|| anyhow::anyhow!("no order id in {body}"))
    }

    /// `n` orders of one unit of `SKU-{tenant}` each, 16 at a time; about
    /// one in ten declined by the provider.
    pub async fn orders(&self, tenant: i64, n: usize) -> anyhow::Result<Vec<i64>> {
        self.orders_from(tenant, 0, n).await
    }

    /// Orders `first..first + n` of the tenant (their keys), 16 at a time.
    pub async fn orders_from(
        &self,
        tenant: i64,
        first: usize,
        n: usize,
    ) -> anyhow::Result<Vec<i64>> {
        use futures_util::StreamExt;
        let sku = format!("SKU-{tenant}");
        let all: Vec<_> = futures_util::stream::iter((first..first + n).map(|i| {
            let customer = if i % 10 == 9 {
                format!("decline-{i}")
            } else {
                format!("c-{i}")
            };
            let key = format!("order-{tenant}-{i}");
            let sku = sku.clone();
            async move { self.order(tenant, &key, &customer, &sku, 1).await }
        }))
        .buffered(16)
        .collect()
        .await;
        all.into_iter().collect()
    }

    /// A steady load: `per_second` orders each second until `done` is set,
    /// then one round more. It lasts as long as a fault takes, however fast
    /// the machine; paced, so that what waits out the fault stays a backlog
    /// the stack drains within the checker's deadline. Returns how many were
    /// placed.
    pub async fn orders_until(
        &self,
        tenant: i64,
        per_second: usize,
        done: &std::sync::atomic::AtomicBool,
    ) -> anyhow::Result<usize> {
        let mut placed = 0;
        loop {
            let round = Instant::now();
            let last = done.load(std::sync::atomic::Ordering::Acquire);
            placed += self.orders_from(tenant, placed, per_second).await?.len();
            if last {
                return Ok(placed);
            }
            tokio::time::sleep(Duration::from_secs(1).saturating_sub(round.elapsed())).await;
        }
    }
}
