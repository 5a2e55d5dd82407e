//! The stack as real processes, as `make e2e` and `make bench` run it: four
//! fresh databases, queues and an exchange named after the run, each
//! service role (api, consumer, relay) a process of its own, and a client
//! that retries like a real one.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use reliability::db;
use sqlx::postgres::PgConnectOptions;
use testkit::{amqp_url, database_url};

use crate::check::Dbs;
pub use crate::client::Client;
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
        rolled_from_unnumbered: false,
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
    // Bounded: lapin can leave a close pending forever over a reset.
    let _ = reliability::broker::bounded(conn.close(200, "setup done".into())).await;

    let pg = format!(
        "postgres://{}:{}",
        admin_opts.get_host(),
        admin_opts.get_port()
    );
    let mut vars: Vec<(String, String)> = vec![
        ("AMQP_URL".into(), amqp_url()),
        ("EVENTS_EXCHANGE".into(), format!("{}.events", layout.name)),
        ("QUEUE_PREFIX".into(), prefix.clone()),
        // A management API in the environment is another broker's (the
        // world's has none): the consumers' bindings go unchecked.
        ("RABBITMQ_MANAGEMENT_URL".into(), String::new()),
        ("JWT_SECRET".into(), SECRET.into()),
        ("PSP_SIM_PORT".into(), layout.port("psp-sim").to_string()),
        ("PSP_URL".into(), layout.url("psp-sim")),
        ("PSP_LEASE_SECS".into(), "2".into()),
        ("PSP_TIMEOUT_MS".into(), "1000".into()),
        // The simulator's late landings take 1.8 s, inside the lease: a
        // look-up that finds nothing is final after 5; reconciliation
        // every 5 s.
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
        // Another build may predate ordered subscriptions (docs/adr/0028;
        // make e2e-upgrade's 953eb30) and lack a service of today's
        // roster: only the order-free queues of the services it has are
        // awaited (the bench's f3ff5b8 declares the ordered ones too).
        queues_of(
            contracts::topology::ALL.iter().filter(|s| {
                s.partitions == 0 && bin(s.consumer.split('.').next().unwrap_or_default()).exists()
            }),
            &prefix,
        )
    };
    testkit::wait_for_queues(&expected).await;
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
