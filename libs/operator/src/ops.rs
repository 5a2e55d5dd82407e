//! Operators' views across every service at once: [`status`] (what is
//! stuck, where, since when) and [`explain`] (one business key's path
//! through every service), and [`outbox`] (a service's outbox and its DLQ
//! table). The `reliability` CLI prints them; tests call them directly.

use sqlx::PgPool;

use contracts::topology::Subscription;

pub mod charts;
pub mod commerce;
mod connections;
pub mod dead_letters;
pub mod explain;
mod management;
pub mod offsets;
pub mod outbox;
pub mod problems;
pub mod roles;
pub mod scrape;
pub mod status;
pub mod stuck;

/// Where the views look.
pub struct Estate {
    /// Each service's database, as the owner role (reads every tenant).
    pub databases: Vec<(String, PgPool)>,
    /// The broker; without it, queue columns stay empty.
    pub broker: Option<lapin::Connection>,
    /// Prefix of every consumer queue name, as the services were given it.
    pub queue_prefix: String,
    /// The events exchange, as the services were given it.
    pub exchange: String,
    /// The consumers to report on.
    pub subscriptions: &'static [Subscription],
    /// `ORDERED_PARTITIONS`, as the services were given it: the K of an
    /// ordered subscription when it is not the code's.
    pub ordered_partitions: String,
    /// RabbitMQ's management API (`http://user:pass@host:15672`), for
    /// unacked counts, which AMQP does not report.
    pub management_url: Option<String>,
}

impl Estate {
    /// The database of the service that owns `consumer` (`inventory.stock`
    /// lives in `inventory`).
    pub fn consumer_db(&self, consumer: &str) -> Option<&PgPool> {
        let service = consumer.split('.').next()?;
        self.database(service)
    }

    /// The database of `service`, as the owner role.
    pub fn database(&self, service: &str) -> Option<&PgPool> {
        self.databases
            .iter()
            .find(|(name, _)| name == service)
            .map(|(_, pool)| pool)
    }

    /// The queue `consumer` consumes, with the services' prefix.
    pub fn queue(&self, consumer: &str) -> String {
        format!("{}{consumer}", self.queue_prefix)
    }
}
