//! __SERVICE__: generated from `templates/service` (docs/template.md).
//!
//! It owns items: `POST /items` (idempotent) writes an item and an
//! `ItemCreated` event in one transaction; `GET /items/{item_id}` reads it;
//! the `__SERVICE__.audit` consumer applies each `ItemCreated` exactly once.
//! Replace the items with your domain, keep the wiring.

pub mod audit;
mod error;
pub mod http;

use clap::Parser;
use reliability::consumer::Consumer;
use reliability::service::{
    self, Application, CommonSettings, Databases, Role, ServiceSpec, ShutdownToken,
};
use sqlx::migrate::Migrator;

pub use error::Error;

/// The name of this service: the source of its events.
pub const SOURCE: &str = "__SERVICE__";

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/__SERVICE__");

#[derive(Debug, Clone, Parser)]
#[command(version, about = "__SERVICE__ service")]
pub struct Settings {
    /// What this process runs.
    #[arg(value_enum, default_value_t = Role::All)]
    pub role: Role,
    /// HTTP port (0 picks a free one).
    #[arg(long, env = "__ENV___PORT", default_value_t = __PORT__)]
    pub port: u16,
    /// This service's database (roles are set per connection).
    #[arg(
        long,
        env = "__ENV___DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/__SERVICE__"
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
        name: SOURCE,
        role: settings.role,
        port: settings.port,
        common,
        migrations: &MIGRATIONS,
        routes: http::router,
        subscriptions: &[audit::SUBSCRIPTION],
    };
    let app = service::launch(spec, dbs, shutdown, |tasks, dbs| {
        tasks.spawn_consumer(Consumer::new(
            dbs.app.clone(),
            &common.amqp_url,
            audit::consumer_config(common)?,
            audit::Audit,
        ));
        Ok(())
    })
    .await?;
    Ok(app)
}
