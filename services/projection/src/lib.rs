//! projection: the order view (`GET /orders/{order_id}` on port 8084),
//! built from events: status, totals, payment, reservation, refunds and
//! the timeline; and each order's and product's history in the order it
//! happened (`GET /history/...`, an ordered subscription). The views can
//! be re-projected from the sources' current rows at any age, or rebuilt
//! from their event history, and are verified against the rows
//! (`projection verify`, and on a schedule).

pub mod cli;
mod error;
pub mod facts;
pub mod history;
pub mod http;
pub mod rebuild;
pub mod reproject;
pub mod verify;
pub mod views;

use service_kit::service::{self, Databases, Service, ShutdownToken, Tasks};
use sources::RebuildWith;
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
    /// What a rebuild reads: `rows`, the sources' current rows, in place
    /// beside the live consumer (the order views at any age; the ordered
    /// histories are left as they are), or `history`, a reset and then
    /// every event the outboxes and their archives still hold (90 days).
    #[arg(long, value_enum, default_value_t = RebuildWith::Rows)]
    pub rebuild_with: RebuildWith,
    /// The scheduled verification pass (docs/adr/0035).
    #[command(flatten)]
    pub verify: sources::VerifySettings,
}

impl Default for ProjectionSettings {
    /// As with no environment: the defaults of the `#[arg]`s above.
    fn default() -> Self {
        service_kit::service::defaults()
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
    let own = &settings.service.verify;
    if let Some((sources, every)) = own.scheduled()? {
        let verifier = verify::Verifier::new(
            dbs.owner.clone(),
            sources,
            own.grace(),
            sources::verify::CHUNK,
        );
        let stop = tasks.shutdown();
        tasks.spawn("verification", async move {
            verifier.run(every, true, stop).await;
            Ok(())
        });
    }
    Ok(())
}

/// `--rebuild-from`: the views again from the given sources, as JSON.
pub async fn rebuild_from(settings: &Settings) -> anyhow::Result<serde_json::Value> {
    let dbs = Databases::connect_lazy(
        &settings.database_url,
        &settings.common,
        "projection-rebuild",
    )?;
    service::migrate_with_retry(&dbs.owner, &MIGRATIONS, &ShutdownToken::new()).await?;
    let own = &settings.service;
    Ok(match own.rebuild_with {
        RebuildWith::Rows => {
            let sources = sources::Sources::lazy(&own.rebuild_from)?;
            serde_json::to_value(reproject::reproject(&dbs.owner, &sources).await?)?
        }
        RebuildWith::History => {
            let sources = reliability::outbox::history_sources(&own.rebuild_from).await?;
            serde_json::to_value(rebuild::rebuild(&dbs, &sources).await?)?
        }
    })
}
