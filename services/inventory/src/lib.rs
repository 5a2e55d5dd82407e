//! inventory: stock per sku (`POST /stock/adjustments`, `GET /products/{sku}`)
//! and the saga's reservation step: all lines or none, never oversold (I5),
//! committed when the order is confirmed, released when it is cancelled.

mod error;
pub mod http;
pub mod stock;

use service_kit::service::{self, Databases, Service, Tasks};
use sqlx::migrate::Migrator;

pub use error::{Error, Inventory};

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/inventory");

/// The inventory service, as the runtime runs it.
pub static SERVICE: Service = Service {
    name: contracts::source::INVENTORY,
    about: "Inventory service",
    port: 8082,
    migrations: &MIGRATIONS,
    routes: http::router,
    subscriptions: contracts::topology::ALL,
    consume,
};

pub type Settings = service::Settings<service::NoSettings>;

fn consume(tasks: &mut Tasks, dbs: &Databases, settings: &Settings) -> reliability::Result<()> {
    let sub = &contracts::topology::INVENTORY_STOCK;
    tasks.consume(dbs, &settings.common, sub, stock::Stock)
}
