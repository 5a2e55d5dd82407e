//! inventory: stock per sku (`POST /stock/adjustments`, `GET /products/{sku}`)
//! and the saga's reservation step: all lines or none, never oversold (I5),
//! committed when the order is confirmed, released when it is cancelled.

pub mod domain;
mod error;
pub mod http;
pub mod stock;

use clap::Parser;
use reliability::consumer::Consumer;
use reliability::service::{
    self, Application, CommonSettings, Databases, Role, ServiceSpec, ShutdownToken,
};
use sqlx::migrate::Migrator;

pub use error::Error;

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/inventory");

#[derive(Debug, Clone, Parser)]
#[command(version, about = "Inventory service")]
pub struct Settings {
    /// What this process runs.
    #[arg(value_enum, default_value_t = Role::All)]
    pub role: Role,
    /// HTTP port (0 picks a free one).
    #[arg(long, env = "INVENTORY_PORT", default_value_t = 8082)]
    pub port: u16,
    /// The inventory database (roles are set per connection).
    #[arg(
        long,
        env = "INVENTORY_DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/inventory"
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
        name: contracts::source::INVENTORY,
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
            stock::consumer_config(common)?,
            stock::Stock,
        ));
        Ok(())
    })
    .await?;
    Ok(app)
}
