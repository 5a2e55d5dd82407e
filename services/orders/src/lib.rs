//! orders: places orders (`POST /orders`, idempotent), serves them, and owns
//! the saga's outcome: an order ends `confirmed` when its payment is
//! captured and `cancelled` when stock or payment fails (invariant I6).
//!
//! `lib.rs` declares the service, `http.rs` holds the routes and their SQL,
//! `saga.rs` the consumer, `domain.rs` the validated types, `error.rs` the
//! one error enum.

pub mod domain;
mod error;
pub mod http;
pub mod saga;

use service_kit::service::{self, Databases, Service, Tasks};
use sqlx::migrate::Migrator;

pub use error::{Error, Orders};

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/orders");

/// The orders service, as the runtime runs it.
pub static SERVICE: Service = Service {
    name: contracts::source::ORDERS,
    about: "Orders service",
    port: 8081,
    migrations: &MIGRATIONS,
    routes: http::router,
    subscriptions: contracts::topology::ALL,
    consume,
};

pub type Settings = service::Settings<service::NoSettings>;

fn consume(tasks: &mut Tasks, dbs: &Databases, settings: &Settings) -> reliability::Result<()> {
    let sub = &contracts::topology::ORDERS_SAGA;
    tasks.consume(dbs, &settings.common, sub, saga::Saga)
}
