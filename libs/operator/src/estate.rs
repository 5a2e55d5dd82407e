//! Where `status` and `explain` look: the services' databases, the broker
//! and its management API, as the services were configured.

use std::time::Duration;

use operator::ops;
use service_kit::admission::AdmissionLimits;

use crate::target::{self, Broker};

#[derive(clap::Args)]
pub struct Estate {
    #[command(flatten)]
    broker: Broker,
    /// Prefix of every consumer queue name, as the services are given it.
    #[arg(long, env = "QUEUE_PREFIX", default_value = "")]
    queue_prefix: String,
    /// The events exchange, as the services are given it.
    #[arg(long, env = "EVENTS_EXCHANGE", default_value = contracts::EXCHANGE)]
    exchange: String,
    /// Partitions of ordered subscriptions, as the services are given them
    /// (`consumer=K,...`; default: the code's K).
    #[arg(long, env = "ORDERED_PARTITIONS", default_value = "")]
    ordered_partitions: String,
    /// RabbitMQ's management API, for unacked counts (optional).
    #[arg(
        long,
        env = "RABBITMQ_MANAGEMENT_URL",
        default_value = service_kit::bindings::MANAGEMENT_URL,
        hide_env_values = true
    )]
    management_url: String,
    /// The services to look at (default: every one of services/roster.txt).
    #[arg(long, value_delimiter = ',', default_values_t = contracts::roster::names().into_iter().map(str::to_owned))]
    services: Vec<String>,
}

impl Estate {
    /// Opens what answers; what does not shows up as a problem.
    pub async fn open(self) -> anyhow::Result<ops::Estate> {
        for sub in contracts::topology::ALL {
            reliability::broker::partitions_override(&self.ordered_partitions, sub)?;
        }
        let mut databases = Vec::new();
        for service in &self.services {
            let options = target::service_options(service)?;
            let pool = reliability::db::pool_options()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(3))
                .connect_lazy_with(options);
            databases.push((service.clone(), pool));
        }
        let broker = match self.broker.connect().await {
            Ok(conn) => Some(conn),
            Err(e) => {
                eprintln!("broker unreachable ({e:#}): queue columns stay empty");
                None
            }
        };
        Ok(ops::Estate {
            databases,
            broker,
            queue_prefix: self.queue_prefix,
            exchange: self.exchange,
            subscriptions: contracts::topology::ALL,
            ordered_partitions: self.ordered_partitions,
            management_url: Some(self.management_url),
        })
    }
}

/// The services' admission settings, as they read them: `status` shows
/// each tenant against its bound.
#[derive(clap::Args)]
pub struct Admission {
    /// The services' bound of work in flight per tenant (as they read it).
    #[arg(long, env = "ADMISSION_MAX_IN_FLIGHT", default_value_t = 1000)]
    admission_max_in_flight: u32,
    /// Tenants with a bound of their own: `tenant=bound,...`.
    #[arg(long, env = "ADMISSION_TENANT_MAX_IN_FLIGHT", default_value = "")]
    admission_tenant_max_in_flight: String,
    /// Seconds after which undecided work is stuck (as they read it).
    #[arg(long, env = "ADMISSION_STUCK_AFTER_SECS", default_value_t = service_kit::admission::STUCK_AFTER_SECS)]
    admission_stuck_after_secs: u64,
}

impl Admission {
    pub fn limits(&self) -> anyhow::Result<AdmissionLimits> {
        Ok(AdmissionLimits {
            stuck_after: Duration::from_secs(self.admission_stuck_after_secs),
            ..AdmissionLimits::parse(
                self.admission_max_in_flight,
                &self.admission_tenant_max_in_flight,
                Duration::ZERO,
            )?
        })
    }
}
