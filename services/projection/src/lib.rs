//! projection: the order view (`GET /orders/{order_id}` on port 8084),
//! built only from events: status, totals, payment, reservation, refunds
//! and the timeline; and each order's and product's history in the order
//! it happened (`GET /history/...`, an ordered subscription). It can be
//! rebuilt from the sources' event history.

mod error;
pub mod history;
pub mod http;
pub mod rebuild;
pub mod views;

use reliability::service::{self, Databases, Service, ShutdownToken, Tasks};
use sqlx::migrate::Migrator;

pub use error::{Error, Projection};

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/projection");

/// The projection service, as the runtime runs it.
pub static SERVICE: Service<RebuildSettings> = Service {
    name: "projection",
    about: "Projection service",
    port: 8084,
    migrations: &MIGRATIONS,
    routes: http::router,
    subscriptions: contracts::topology::ALL,
    consume,
};

pub type Settings = service::Settings<RebuildSettings>;

#[derive(Debug, Clone, Default, clap::Args)]
pub struct RebuildSettings {
    /// Rebuild and exit: `name=owner-url` of each source database, e.g.
    /// `orders=postgres://commerce_owner@127.0.0.1/orders,inventory=…,payments=…`.
    #[arg(long, value_delimiter = ',')]
    pub rebuild_from: Vec<String>,
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
    )
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
