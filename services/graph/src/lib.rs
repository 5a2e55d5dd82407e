//! graph: customers, orders, products, payments and refunds as a property
//! graph in FalkorDB, derived from the commerce events (port 8085). Each
//! event is applied exactly once by one statement that also records it on
//! its aggregate's checkpoint in the graph (docs/adr/0030). It answers
//! what joins answer badly: an order's neighbourhood, what else the
//! customers who bought a product bought, and the open orders a product's
//! stock-out touches. PostgreSQL stays the source of truth; the graph can
//! be dropped and derived again.

#[macro_use]
pub mod apply;
pub mod cli;
mod error;
pub mod freshness;
pub mod http;
pub mod rebuild;
pub mod reproject;
pub mod schema;
pub mod store;
pub mod verify;

use std::sync::Arc;

use reliability::consumer::Consumer;
use service_kit::service::{self, Databases, Service, Tasks};
use sources::RebuildWith;
use sqlx::migrate::Migrator;

pub use error::{Error, Graph};

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/graph");

/// The graph service, as the runtime runs it.
pub static SERVICE: Service<GraphSettings> = Service {
    name: "graph",
    about: "Graph service",
    port: 8085,
    migrations: &MIGRATIONS,
    routes: http::router,
    subscriptions: contracts::topology::ALL,
    consume,
};

pub type Settings = service::Settings<GraphSettings>;

/// Where the graph lives.
#[derive(Debug, Clone, clap::Args)]
pub struct GraphSettings {
    /// The FalkorDB server (`falkor://host:port`); `make up` starts one.
    #[arg(long, env = "GRAPH_URL", default_value = DEFAULT_URL)]
    pub graph_url: String,
    /// The graph's name on that server.
    #[arg(long, env = "GRAPH_NAME", default_value = DEFAULT_NAME)]
    pub graph_name: String,
    /// Rebuild and exit: `name=owner-url` of each source database, e.g.
    /// `orders=postgres://commerce_owner@127.0.0.1/orders,inventory=…,payments=…`.
    #[arg(long, value_delimiter = ',')]
    pub rebuild_from: Vec<String>,
    /// What a rebuild reads: `rows`, the sources' current rows and then
    /// their tail (at any age), or `history`, every event the outboxes and
    /// their archives still hold (90 days).
    #[arg(long, value_enum, default_value_t = RebuildWith::Rows)]
    pub rebuild_with: RebuildWith,
    /// The scheduled verification pass (docs/adr/0035).
    #[command(flatten)]
    pub verify: sources::VerifySettings,
}

const DEFAULT_URL: &str = "falkor://127.0.0.1:6380";
const DEFAULT_NAME: &str = "commerce";

impl Default for GraphSettings {
    /// As with no environment: the defaults of the `#[arg]`s above.
    fn default() -> Self {
        service_kit::service::defaults()
    }
}

impl GraphSettings {
    pub fn store(&self) -> store::Store {
        store::Store::new(&self.graph_url, &self.graph_name)
    }
}

/// For tests: `GRAPH_URL`, or the FalkorDB `scripts/falkordb.sh` keeps on
/// this machine, started on first use (once per process).
#[doc(hidden)]
pub fn test_url() -> String {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("GRAPH_URL") {
            return url;
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/falkordb.sh");
        let run = |action: &str| {
            std::process::Command::new("bash")
                .args([script, action])
                .output()
                .unwrap_or_else(|e| panic!("run scripts/falkordb.sh {action}: {e}"))
        };
        let started = run("start");
        assert!(
            started.status.success(),
            "a graph test needs FalkorDB: scripts/falkordb.sh start failed: {}",
            String::from_utf8_lossy(&started.stderr)
        );
        String::from_utf8_lossy(&run("url").stdout)
            .trim()
            .to_owned()
    })
    .clone()
}

fn consume(tasks: &mut Tasks, _: &Databases, settings: &Settings) -> reliability::Result<()> {
    let common = &settings.common;
    let config = common.consumer_config(&contracts::topology::GRAPH_EDGES)?;
    let edges = apply::Edges::new(Arc::new(settings.service.store()), &config.name);
    tasks.spawn_consumer(Consumer::with_sink(&common.amqp_url, config, edges)?);
    let own = &settings.service.verify;
    if let Some((sources, every)) = own.scheduled()? {
        let store = Arc::new(settings.service.store());
        let verifier = verify::Verifier::new(store, sources, own.grace(), sources::verify::CHUNK);
        let stop = tasks.shutdown();
        tasks.spawn("verification", async move {
            verifier.run(every, true, stop).await;
            Ok(())
        });
    }
    Ok(())
}

/// `--rebuild-from`: the graph again from the given sources, as JSON.
pub async fn rebuild_from(settings: &Settings) -> anyhow::Result<serde_json::Value> {
    let own = &settings.service;
    Ok(match own.rebuild_with {
        RebuildWith::Rows => {
            let sources = sources::Sources::lazy(&own.rebuild_from)?;
            serde_json::to_value(reproject::reproject(own, &sources).await?)?
        }
        RebuildWith::History => {
            let sources = reliability::outbox::history_sources(&own.rebuild_from).await?;
            serde_json::to_value(rebuild::rebuild(own, &sources).await?)?
        }
    })
}
