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

use service_kit::service::{self, Databases, Service, ShutdownToken, Tasks};
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
