//! payments: the saga's payment step and refunds. On `InventoryReserved` a
//! payment is recorded; the provider worker charges it with a stable
//! idempotency key, outside any transaction, and emits `PaymentCaptured` or
//! `PaymentFailed`. `POST /refunds` accepts a refund up to what was
//! captured; the worker carries it out once and emits `RefundIssued` (I4).

pub mod charges;
pub mod cli;
mod error;
pub mod http;
pub mod provider;
#[macro_use]
mod refunded;
pub mod reconcile;
pub mod worker;

use std::time::Duration;

use service_kit::service::{self, Databases, Service, Tasks};
use sqlx::migrate::Migrator;

pub use error::{Error, Payments};

pub static MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/payments");

/// The payments service, as the runtime runs it (`consume` includes the
/// provider worker).
pub static SERVICE: Service<PspSettings> = Service {
    name: contracts::source::PAYMENTS,
    about: "Payments service",
    port: 8083,
    migrations: &MIGRATIONS,
    routes: http::router,
    subscriptions: contracts::topology::ALL,
    consume,
};

pub type Settings = service::Settings<PspSettings>;

/// How payments calls the provider.
#[derive(Debug, Clone, clap::Args)]
pub struct PspSettings {
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
    /// The provider's processing bound, in seconds: a look-up by key that
    /// finds nothing is final only for requests sent longer ago than this.
    #[arg(long, env = "PSP_LOOKUP_GRACE_SECS", default_value_t = 120)]
    pub psp_lookup_grace_secs: u64,
    /// Reconciliation against the provider's lists: how often, in seconds
    /// (0: never in this process; `payments reconcile` runs it once).
    #[arg(long, env = "PSP_RECONCILE_INTERVAL_SECS", default_value_t = 300)]
    pub psp_reconcile_interval_secs: u64,
    /// How far back each reconciliation reads the provider's lists, in hours.
    #[arg(long, env = "PSP_RECONCILE_WINDOW_HOURS", default_value_t = 48)]
    pub psp_reconcile_window_hours: u64,
}

impl Default for PspSettings {
    /// As with no environment: the defaults of the `#[arg]`s above.
    fn default() -> Self {
        service_kit::service::defaults()
    }
}

fn consume(tasks: &mut Tasks, dbs: &Databases, settings: &Settings) -> reliability::Result<()> {
    let (common, psp) = (&settings.common, &settings.service);
    let timeout = Duration::from_millis(psp.psp_timeout_ms);
    let config = worker::WorkerConfig {
        lease: Duration::from_secs(psp.psp_lease_secs),
        max_in_flight: psp.psp_max_in_flight.max(1),
        tenant_share: psp.psp_tenant_in_flight.max(1),
        deadline: Duration::from_secs(psp.psp_deadline_secs),
        grace: Duration::from_secs(psp.psp_lookup_grace_secs),
        ..Default::default()
    };
    // A call still running when its lease ends would race the next try.
    if timeout >= config.lease {
        return Err(reliability::Error::Config(format!(
            "PSP_TIMEOUT_MS ({} ms) must be below PSP_LEASE_SECS ({} s): a call may not outlive its lease",
            psp.psp_timeout_ms, psp.psp_lease_secs
        )));
    }
    // A request stalled on our side is fenced at its lease end; "nothing
    // under the key" must come after that (docs/adr/0011, amended).
    if config.grace <= config.lease {
        return Err(reliability::Error::Config(format!(
            "PSP_LOOKUP_GRACE_SECS ({} s) must be above PSP_LEASE_SECS ({} s): a request may land until its lease ends",
            psp.psp_lookup_grace_secs, psp.psp_lease_secs
        )));
    }
    tasks.consume(
        dbs,
        common,
        &contracts::topology::PAYMENTS_CHARGES,
        charges::Charges,
    )?;
    let client = provider::Psp::new(&psp.psp_url, timeout);
    reliability::metrics::describe(worker::METRICS);
    let worker = worker::Worker::new(
        dbs.app.clone(),
        client.clone(),
        config,
        common.fail_points()?,
    )
    .listen_on(dbs.relay.clone());
    let stop = tasks.shutdown();
    tasks.spawn("provider worker", async move { worker.run(stop).await });
    if psp.psp_reconcile_interval_secs > 0 {
        let reconciler = reconcile::Reconciler::new(
            dbs.owner.clone(),
            client,
            Duration::from_secs(psp.psp_reconcile_window_hours * 3600),
        );
        let (every, stop) = (
            Duration::from_secs(psp.psp_reconcile_interval_secs),
            tasks.shutdown(),
        );
        tasks.spawn("reconciliation", async move {
            reconciler.run(every, stop).await;
            Ok(())
        });
    }
    Ok(())
}
