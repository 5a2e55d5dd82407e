//! projection: the order view (`GET /orders/{order_id}` on port 8084),
//! built only from events: status, totals, payment, reservation, refunds
//! and the timeline. It can be rebuilt from the sources' event history.

mod error;
pub mod http;
pub mod rebuild;
pub mod views;

use std::str::FromStr;

use clap::Parser;
use reliability::consumer::Consumer;
use reliability::service::{
    self, Application, CommonSettings, Databases, Role, ServiceSpec, ShutdownToken,
};
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;

pub use error::Error;

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/projection");

#[derive(Debug, Clone, Parser)]
#[command(version, about = "Projection service")]
pub struct Settings {
    /// What this process runs.
    #[arg(value_enum, default_value_t = Role::All)]
    pub role: Role,
    /// HTTP port (0 picks a free one).
    #[arg(long, env = "PROJECTION_PORT", default_value_t = 8084)]
    pub port: u16,
    /// The projection database (roles are set per connection).
    #[arg(
        long,
        env = "PROJECTION_DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/projection"
    )]
    pub database_url: String,
    /// Rebuild and exit: `name=owner-url` of each source database, e.g.
    /// `orders=postgres://commerce_owner@127.0.0.1/orders,inventory=…,payments=…`.
    #[arg(long, value_delimiter = ',')]
    pub rebuild_from: Vec<String>,
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
        name: "projection",
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
            views::consumer_config(common)?,
            views::Views,
        ));
        Ok(())
    })
    .await?;
    Ok(app)
}

/// `--rebuild-from`: reset the projection and replay the given sources.
pub async fn rebuild_from(settings: &Settings) -> anyhow::Result<rebuild::RebuildReport> {
    let dbs = Databases::connect_lazy(&settings.database_url, &settings.common)?;
    service::migrate_with_retry(&dbs.owner, &MIGRATIONS, &ShutdownToken::new()).await?;
    let mut sources = Vec::new();
    for item in &settings.rebuild_from {
        let (name, url) = item
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("expected name=url, got `{item}`"))?;
        sources.push((
            name.to_owned(),
            reliability::db::pool(PgConnectOptions::from_str(url)?, 2).await?,
        ));
    }
    Ok(rebuild::rebuild(&dbs, &sources).await?)
}
