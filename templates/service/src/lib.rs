//! __SERVICE__: generated from `templates/service` (docs/template.md).
//!
//! It owns items: `POST /items` (idempotent) writes an item and an
//! `ItemCreated` event in one transaction; `GET /items/{item_id}` reads it;
//! the `__SERVICE__.audit` consumer applies each `ItemCreated` exactly once.
//! Replace the items with your domain, keep the wiring.

pub mod audit;
mod error;
pub mod http;

use service_kit::service::{self, Databases, Service, Tasks};
use sqlx::migrate::Migrator;

pub use error::{Error, Items};

/// This service's tables (the reliability tables come first).
pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/__SERVICE__");

/// The service, declared once: the runtime reads its name (the source of
/// its events and the prefix of its variables, `__ENV___PORT` and
/// `__ENV___DATABASE_URL`), routes, consumers and migrations.
pub static SERVICE: Service = Service {
    name: "__SERVICE__",
    about: "__SERVICE__ service",
    port: __PORT__,
    migrations: &MIGRATIONS,
    routes: http::router,
    subscriptions: &[audit::SUBSCRIPTION],
    consume,
};

/// Its settings: the shared ones only (`service::Settings<YourSettings>`
/// adds a `clap::Args` struct of its own, as payments does).
pub type Settings = service::Settings<service::NoSettings>;

/// What runs when the role consumes: its consumers (and any worker).
fn consume(tasks: &mut Tasks, dbs: &Databases, settings: &Settings) -> reliability::Result<()> {
    tasks.consume(dbs, &settings.common, &audit::SUBSCRIPTION, audit::Audit)
}
