//! orders: places orders (`POST /orders`, idempotent), serves them, and owns
//! the saga's outcome: an order ends `confirmed` when its payment is
//! captured and `cancelled` when stock or payment fails (invariant I6).
//!
//! This crate is also the template for a new service: `lib.rs` wires the
//! parts, `http.rs` holds the routes and their SQL, `saga.rs` the consumer,
//! `domain.rs` the validated types, `error.rs` the one error enum.

pub mod domain;
mod error;
pub mod http;
pub mod saga;

use clap::Parser;
use reliability::consumer::Consumer;
use reliability::service::{
    self, Application, CommonSettings, Databases, Role, ServiceSpec, ShutdownToken,
};
use sqlx::migrate::Migrator;

pub use error::Error;

/// This service's tables (the reliability tables come first, ADR 0005).
pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/orders");

#[derive(Debug, Clone, Parser)]
#[command(version, about = "Orders service")]
pub struct Settings {
    /// What this process runs.
    #[arg(value_enum, default_value_t = Role::All)]
    pub role: Role,
    /// HTTP port (0 picks a free one).
    #[arg(long, env = "ORDERS_PORT", default_value_t = 8081)]
    pub port: u16,
    /// The orders database (roles are set per connection).
    #[arg(
        long,
        env = "ORDERS_DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/orders"
    )]
    pub database_url: String,
    #[command(flatten)]
    pub common: CommonSettings,
}

/// Starts what `settings.role` asks for on `dbs`: a service's own pools
/// (`Databases::connect_lazy`) or a test's database.
pub async fn build(
    settings: Settings,
    dbs: Databases,
    shutdown: ShutdownToken,
) -> anyhow::Result<Application> {
    let common = &settings.common;
    let spec = ServiceSpec {
        name: contracts::source::ORDERS,
        role: settings.role,
        port: settings.port,
        common,
        migrations: &MIGRATIONS,
        routes: http::router,
        subscriptions: contracts::topology::ALL,
    };
    let app = service::launch(spec, dbs, shutdown, |tasks, dbs| {
        tasks.spawn_consumer(Consumer::new(
            dbs.app.clone(),
            &common.amqp_url,
            saga::consumer_config(common)?,
            saga::Saga,
        ));
        Ok(())
    })
    .await?;
    Ok(app)
}
