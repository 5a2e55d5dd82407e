//! payments: the saga's payment step and refunds. On `InventoryReserved` a
//! payment is recorded; the provider worker charges it with a stable
//! idempotency key, outside any transaction, and emits `PaymentCaptured` or
//! `PaymentFailed`. `POST /refunds` accepts a refund up to what was
//! captured; the worker carries it out once and emits `RefundIssued` (I4).

pub mod charges;
mod error;
pub mod http;
pub mod provider;
pub mod worker;

use std::time::Duration;

use clap::Parser;
use reliability::consumer::Consumer;
use reliability::service::{
    self, Application, CommonSettings, Databases, Role, ServiceSpec, ShutdownToken,
};
use sqlx::migrate::Migrator;

pub use error::Error;

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/payments");

#[derive(Debug, Clone, Parser)]
#[command(version, about = "Payments service")]
pub struct Settings {
    /// What this process runs (`consume` includes the provider worker).
    #[arg(value_enum, default_value_t = Role::All)]
    pub role: Role,
    /// HTTP port (0 picks a free one).
    #[arg(long, env = "PAYMENTS_PORT", default_value_t = 8083)]
    pub port: u16,
    /// The payments database (roles are set per connection).
    #[arg(
        long,
        env = "PAYMENTS_DATABASE_URL",
        default_value = "postgres://127.0.0.1:5432/payments"
    )]
    pub database_url: String,
    /// The payment provider's base URL.
    #[arg(long, env = "PSP_URL", default_value = "http://127.0.0.1:8090")]
    pub psp_url: String,
    /// Timeout of one provider call, in milliseconds.
    #[arg(long, env = "PSP_TIMEOUT_MS", default_value_t = 3000)]
    pub psp_timeout_ms: u64,
    /// How long a provider call may take before another try may start, in seconds.
    #[arg(long, env = "PSP_LEASE_SECS", default_value_t = 30)]
    pub psp_lease_secs: u64,
    /// Provider calls in flight at once in this process (64 keeps ~200
    /// calls/s going at 300 ms each).
    #[arg(long, env = "PSP_MAX_IN_FLIGHT", default_value_t = 64)]
    pub psp_max_in_flight: usize,
    /// Of those, at most this many for one tenant.
    #[arg(long, env = "PSP_TENANT_IN_FLIGHT", default_value_t = 16)]
    pub psp_tenant_in_flight: usize,
    /// A payment undecided this long fails (the order is cancelled) and
    /// whatever it may have charged is refunded by key, in seconds.
    #[arg(long, env = "PSP_DEADLINE_SECS", default_value_t = 900)]
    pub psp_deadline_secs: u64,
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
        name: contracts::source::PAYMENTS,
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
            charges::consumer_config(common)?,
            charges::Charges,
        ));
        let psp = provider::Psp::new(
            &settings.psp_url,
            Duration::from_millis(settings.psp_timeout_ms),
        );
        let config = worker::WorkerConfig {
            lease: Duration::from_secs(settings.psp_lease_secs),
            max_in_flight: settings.psp_max_in_flight.max(1),
            tenant_share: settings.psp_tenant_in_flight.max(1),
            deadline: Duration::from_secs(settings.psp_deadline_secs),
            ..Default::default()
        };
        reliability::metrics::describe(worker::METRICS);
        let worker = worker::Worker::new(dbs.app.clone(), psp, config, common.fail_points()?);
        let stop = tasks.shutdown();
        tasks.spawn("provider worker", async move { worker.run(stop).await });
        Ok(())
    })
    .await?;
    Ok(app)
}
