//! projection: the order view (`GET /orders/{order_id}` on port 8084),
//! built only from events: status, totals, payment, reservation, refunds
//! and the timeline; and each order's and product's history in the order
//! it happened (`GET /history/...`, an ordered subscription). It can be
//! rebuilt from the sources' event history, and is verified against the
//! sources' current rows (`projection verify`, and on a schedule).

pub mod cli;
mod error;
pub mod history;
pub mod http;
pub mod rebuild;
pub mod verify;
pub mod views;

use std::time::Duration;

use reliability::service::{self, Databases, Service, ShutdownToken, Tasks};
use sqlx::migrate::Migrator;

pub use error::{Error, Projection};

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/projection");

/// The projection service, as the runtime runs it.
pub static SERVICE: Service<ProjectionSettings> = Service {
    name: "projection",
    about: "Projection service",
    port: 8084,
    migrations: &MIGRATIONS,
    routes: http::router,
    subscriptions: contracts::topology::ALL,
    consume,
};

pub type Settings = service::Settings<ProjectionSettings>;

#[derive(Debug, Clone, clap::Args)]
pub struct ProjectionSettings {
    /// Rebuild and exit: `name=owner-url` of each source database, e.g.
    /// `orders=postgres://commerce_owner@127.0.0.1/orders,inventory=…,payments=…`.
    #[arg(long, value_delimiter = ',')]
    pub rebuild_from: Vec<String>,
    /// The sources the consume role verifies the views against, on a
    /// schedule: `orders=URL,inventory=URL,payments=URL`, each opened as
    /// the owner role (empty: no scheduled verification; `projection
    /// verify` runs one pass).
    #[arg(long, env = "VERIFY_SOURCES", value_delimiter = ',')]
    pub verify_sources: Vec<String>,
    /// Seconds between two scheduled verification passes; each repairs what differs.
    #[arg(long, env = "VERIFY_INTERVAL_SECS", default_value_t = DEFAULT_VERIFY_INTERVAL_SECS)]
    pub verify_interval_secs: u64,
    /// How long an order's source rows must have been still before its
    /// view is held to them: the consumer's lag that is not yet drift.
    #[arg(long, env = "VERIFY_GRACE_SECS", default_value_t = DEFAULT_VERIFY_GRACE_SECS)]
    pub verify_grace_secs: u64,
}

const DEFAULT_VERIFY_INTERVAL_SECS: u64 = 600;
pub(crate) const DEFAULT_VERIFY_GRACE_SECS: u64 = 60;
/// Orders (and histories) a verification pass reads at a time.
pub const VERIFY_CHUNK: i64 = 500;

impl Default for ProjectionSettings {
    /// As with no environment: the defaults of the `#[arg]`s above.
    fn default() -> Self {
        reliability::service::defaults()
    }
}

fn consume(tasks: &mut Tasks, dbs: &Databases, settings: &Settings) -> reliability::Result<()> {
    let common = &settings.common;
    tasks.consume(
        dbs,
        common,
        &contracts::topology::PROJECTION_VIEWS,
        views::Views,
    )?;
    tasks.consume(
        dbs,
        common,
        &contracts::topology::PROJECTION_HISTORY,
        history::History,
    )?;
    let own = &settings.service;
    if !own.verify_sources.is_empty() && own.verify_interval_secs > 0 {
        let verifier = verify::Verifier::new(
            dbs.owner.clone(),
            verify::Sources::lazy(&own.verify_sources)?,
            Duration::from_secs(own.verify_grace_secs),
            VERIFY_CHUNK,
        );
        let (every, stop) = (
            Duration::from_secs(own.verify_interval_secs),
            tasks.shutdown(),
        );
        tasks.spawn("verification", async move {
            verifier.run(every, true, stop).await;
            Ok(())
        });
    }
    Ok(())
}

/// `--rebuild-from`: reset the projection and replay the given sources.
pub async fn rebuild_from(settings: &Settings) -> anyhow::Result<rebuild::RebuildReport> {
    let dbs = Databases::connect_lazy(
        &settings.database_url,
        &settings.common,
        "projection-rebuild",
    )?;
    service::migrate_with_retry(&dbs.owner, &MIGRATIONS, &ShutdownToken::new()).await?;
    let sources = reliability::outbox::history_sources(&settings.service.rebuild_from).await?;
    Ok(rebuild::rebuild(&dbs, &sources).await?)
}
