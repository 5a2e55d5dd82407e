//! What a service is told: [`CommonSettings`] from the environment, its
//! [`Role`], and the [`Databases`] (one pool per role) they lead to.

use std::str::FromStr;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::admission::AdmissionLimits;
use crate::auth::{AuthSettings, JwtKeys};
use crate::rate_limit::{READ_RATE_LIMIT, RateLimit};
use reliability::broker::{QueueSpec, Subscription};
use reliability::consumer::ConsumerConfig;
use reliability::failpoint::FailPoints;
use reliability::{Error, Result, db};

use super::ServerLimits;

pub use crate::defaults::defaults;

mod relay;
pub use relay::{LOG_MODE_SWEEP, RelayMode, RelaySettings};

/// Settings every service has, each from its environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonSettings {
    /// The RabbitMQ broker.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// The topic exchange every event is published to.
    #[arg(long, env = "EVENTS_EXCHANGE", default_value = contracts::EXCHANGE)]
    pub exchange: String,
    /// How bearer tokens are verified.
    #[command(flatten)]
    pub auth: AuthSettings,
    /// Full URL for the runtime role; default: the service's database URL as `commerce_app`.
    #[arg(long, env = "APP_DATABASE_URL")]
    pub app_database_url: Option<String>,
    /// Full URL for the owner role (migrations, maintenance); default: as `commerce_owner`.
    #[arg(long, env = "OWNER_DATABASE_URL")]
    pub owner_database_url: Option<String>,
    /// A pooler in transaction mode (`host:port`; PgBouncer 1.21 or later,
    /// with `max_prepared_statements` set) in place of the host and port of
    /// the runtime role's URL. The relay and owner roles always connect
    /// direct: they hold sessions (LISTEN, the migrator's advisory lock).
    /// docs/adr/0026.
    #[arg(long, env = "DB_POOLER")]
    pub db_pooler: Option<String>,
    /// Crash points for tests, e.g. `relay.after_confirm=abort` (see `failpoint`).
    #[arg(long, env = "RELIABILITY_FAILPOINTS", default_value = "")]
    pub fail_points: String,
    /// Prefix of every consumer queue name (tests and side-by-side stacks
    /// on one broker keep theirs apart with it).
    #[arg(long, env = "QUEUE_PREFIX", default_value = "")]
    pub queue_prefix: String,
    /// RabbitMQ's management API (`http://user:password@host:15672`): each
    /// consumer holds its bindings to the broker's there, and `/readyz`
    /// names one the broker lost. Empty: not checked (the API may belong
    /// to another broker than `AMQP_URL`'s; `make up` sets the local one's).
    #[arg(
        long,
        env = "RABBITMQ_MANAGEMENT_URL",
        default_value = "",
        hide_env_values = true
    )]
    pub management_url: String,
    /// Partitions of ordered subscriptions in place of the code's K:
    /// `consumer=K,...` (e.g. `projection.history=8`). The step of a K
    /// change without a rebuild (docs/runbooks.md); every process of the
    /// stack must run with the same value.
    #[arg(long, env = "ORDERED_PARTITIONS", default_value = "")]
    pub ordered_partitions: String,
    /// How the outbox reaches the broker.
    #[command(flatten)]
    pub relay: RelaySettings,
    /// Lanes of each consumer in this process: each applies its own
    /// deliveries beside the others (docs/adr/0010). More processes may
    /// consume the same queues too.
    #[arg(long, env = "CONSUMER_LANES", default_value_t = 4)]
    pub consumer_lanes: usize,
    /// How long, in ms, a lane's group may wait to join the commit of
    /// another lane that has one in flight (docs/adr/0039). 0: never.
    #[arg(long, env = "CONSUMER_GATHER_WAIT_MS", default_value_t = reliability::consumer::GATHER_WAIT.as_millis() as u64)]
    pub consumer_gather_wait_ms: u64,
    /// How long, in ms, a whole history waits for a number skipped (docs/adr/0040).
    #[arg(long, env = "CONSUMER_GAP_WAIT_MS", default_value_t = reliability::consumer::GAP_WAIT.as_millis() as u64)]
    pub consumer_gap_wait_ms: u64,
    /// Connections of the runtime role's pool per process (HTTP handlers,
    /// consumer lanes, the payments worker). Every process of every replica
    /// holds its own pools: their sum must stay under PostgreSQL's
    /// `max_connections` (100 by default), or behind a pooler.
    #[arg(long, env = "DB_POOL_SIZE", default_value_t = 16)]
    pub db_pool_size: u32,
    /// Connections of the relay role's pool per process: the relay's window
    /// (a claim per batch in flight), its LISTEN and its gauges.
    #[arg(long, env = "DB_RELAY_POOL_SIZE", default_value_t = 6)]
    pub db_relay_pool_size: u32,
    /// Connections of the owner role's pool per process: migrations and
    /// maintenance.
    #[arg(long, env = "DB_OWNER_POOL_SIZE", default_value_t = 2)]
    pub db_owner_pool_size: u32,
    /// Port of `/healthz`, `/readyz` (with its detail) and `/metrics`, on
    /// `OPS_BIND_ADDRESS`; default: the service's port plus 3000 for a
    /// role that serves (its API port answers only `/healthz` and a bare
    /// `/readyz`), 1000 for relay, 2000 for consume.
    #[arg(long, env = "OPS_PORT")]
    pub ops_port: Option<u16>,
    /// Writes (idempotent POSTs) per second each tenant may make to this
    /// process, sustained; over it: 429 with `Retry-After`. 0: no limit.
    #[arg(long, env = "RATE_LIMIT_PER_SEC", default_value_t = 1000)]
    pub rate_limit_per_sec: u32,
    /// Work in flight (accepted, not yet decided: an order before it is
    /// confirmed or cancelled) a tenant may have; at it, the routes that
    /// start such work answer 429 with `Retry-After` from the rate its work
    /// is decided (docs/adr/0027). 0: no bound.
    #[arg(long, env = "ADMISSION_MAX_IN_FLIGHT", default_value_t = 1000)]
    pub admission_max_in_flight: u32,
    /// Tenants with a bound of their own: `tenant=bound,...` (e.g. `7=100,9=5000`).
    #[arg(long, env = "ADMISSION_TENANT_MAX_IN_FLIGHT", default_value = "")]
    pub admission_tenant_max_in_flight: String,
    /// How old, in ms, the count of a tenant's work in flight may be;
    /// each serving process counts at most this often per tenant.
    #[arg(long, env = "ADMISSION_REFRESH_MS", default_value_t = 500)]
    pub admission_refresh_ms: u64,
    /// Seconds after which undecided work is stuck: it no longer counts
    /// against its tenant's bound, and shows in `status` and in
    /// `admission_stuck_work`.
    #[arg(long, env = "ADMISSION_STUCK_AFTER_SECS", default_value_t = crate::admission::STUCK_AFTER_SECS)]
    pub admission_stuck_after_secs: u64,
    /// A bound derived from the pipeline, in ms: a tenant may have in
    /// flight what is being decided of its work in this long (at least 32,
    /// at most its fixed bound). 0: the fixed bound alone.
    #[arg(long, env = "ADMISSION_HORIZON_MS", default_value_t = 0)]
    pub admission_horizon_ms: u64,
    /// Writes a tenant may make at once above the sustained rate.
    #[arg(long, env = "RATE_LIMIT_BURST", default_value_t = 2000)]
    pub rate_limit_burst: u32,
    /// Reads (GET, HEAD) per second each tenant may make to this process,
    /// sustained: a budget of their own, apart from writes'; over it: 429
    /// with `Retry-After`, before the handler runs. 0: no limit.
    #[arg(long, env = "READ_RATE_LIMIT_PER_SEC", default_value_t = READ_RATE_LIMIT.per_sec)]
    pub read_rate_limit_per_sec: u32,
    /// Reads a tenant may make at once above the sustained rate.
    #[arg(long, env = "READ_RATE_LIMIT_BURST", default_value_t = READ_RATE_LIMIT.burst)]
    pub read_rate_limit_burst: u32,
    /// Seconds a client has to send a request's headers; an idle
    /// keep-alive connection is closed after as long.
    #[arg(long, env = "HTTP_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    pub http_header_timeout_secs: u64,
    /// Seconds a whole request may take (body and handler); past it: 408.
    #[arg(long, env = "HTTP_REQUEST_TIMEOUT_SECS", default_value_t = 30)]
    pub http_request_timeout_secs: u64,
    /// Print the service's OpenAPI document and exit.
    #[arg(long)]
    pub openapi: bool,
    /// Address the HTTP server binds (0.0.0.0 in containers).
    #[arg(long, env = "BIND_ADDRESS", default_value = "127.0.0.1")]
    pub bind_address: String,
    /// Address the ops port binds (`/metrics`, `/readyz` with its detail):
    /// loopback, so that only this host's scraper reads what the metrics
    /// say of tenants; 0.0.0.0 where a scraper in another container or
    /// host must reach it, behind that network's own walls.
    #[arg(long, env = "OPS_BIND_ADDRESS", default_value = "127.0.0.1")]
    pub ops_bind_address: String,
    /// An OpenTelemetry collector's OTLP/HTTP base URL (e.g.
    /// `http://127.0.0.1:4318`), over the variables. Spans are exported
    /// (with the `otel` feature) when this is given or the standard
    /// variables ask: `OTEL_EXPORTER_OTLP_ENDPOINT` or
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp`;
    /// the SDK reads the rest of `OTEL_*` (protocol, default http/protobuf;
    /// headers; timeout; service name; sampler).
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
}

impl CommonSettings {
    /// Local defaults, as with no environment at all ([`defaults`]): tests
    /// and tools that start from `local()` run with exactly what an empty
    /// environment gives a process.
    pub fn local() -> Self {
        defaults()
    }

    /// The token keys and rules, for minting in tests and tools (a serving
    /// process loads them with [`AuthSettings::load`], which also checks
    /// the secret and fetches a key set).
    pub fn jwt_keys(&self) -> JwtKeys {
        self.auth.keys()
    }

    pub fn server_limits(&self) -> ServerLimits {
        ServerLimits {
            header_read: Duration::from_secs(self.http_header_timeout_secs.max(1)),
            request: Duration::from_secs(self.http_request_timeout_secs.max(1)),
        }
    }

    pub fn rate_limit(&self) -> RateLimit {
        RateLimit {
            per_sec: self.rate_limit_per_sec,
            burst: self.rate_limit_burst,
        }
    }

    pub fn read_rate_limit(&self) -> RateLimit {
        RateLimit {
            per_sec: self.read_rate_limit_per_sec,
            burst: self.read_rate_limit_burst,
        }
    }

    pub fn admission(&self) -> Result<AdmissionLimits> {
        Ok(AdmissionLimits {
            stuck_after: Duration::from_secs(self.admission_stuck_after_secs),
            horizon: Duration::from_millis(self.admission_horizon_ms),
            ..AdmissionLimits::parse(
                self.admission_max_in_flight,
                &self.admission_tenant_max_in_flight,
                Duration::from_millis(self.admission_refresh_ms),
            )?
        })
    }

    pub fn fail_points(&self) -> Result<FailPoints> {
        FailPoints::parse(&self.fail_points)
    }

    /// The queue of `sub` on the events exchange, its name prefixed, its
    /// partitions as `ORDERED_PARTITIONS` says if it names `sub`.
    pub fn queue_spec(&self, sub: &Subscription) -> Result<QueueSpec> {
        let mut spec = QueueSpec::for_subscription(sub, &self.exchange, &self.queue_prefix);
        if let Some(k) = reliability::broker::partitions_override(&self.ordered_partitions, sub)? {
            spec.partitions = k;
        }
        Ok(spec)
    }

    /// The consumer of `sub` (the topology declares it once for both sides),
    /// its lanes and fail points from these settings.
    pub fn consumer_config(&self, sub: &Subscription) -> Result<ConsumerConfig> {
        let mut config = ConsumerConfig::new(sub.consumer, &self.exchange, sub.bindings);
        config.queue = self.queue_spec(sub)?;
        config.lanes = self.consumer_lanes.max(1);
        config.gather_wait = std::time::Duration::from_millis(self.consumer_gather_wait_ms);
        config.gap_wait = std::time::Duration::from_millis(self.consumer_gap_wait_ms);
        config.fail_points = self.fail_points()?;
        Ok(config)
    }
}

/// Which part of a service a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Role {
    /// Migrate, then serve HTTP, relay, consume and maintain.
    #[default]
    All,
    /// HTTP only.
    Serve,
    /// The outbox relay and maintenance only.
    Relay,
    /// The consumers (and, in payments, the provider worker) only.
    Consume,
    /// Run the migrations and exit.
    Migrate,
}

impl Role {
    pub fn serves(self) -> bool {
        matches!(self, Self::All | Self::Serve)
    }
    pub fn relays(self) -> bool {
        matches!(self, Self::All | Self::Relay)
    }
    pub fn consumes(self) -> bool {
        matches!(self, Self::All | Self::Consume)
    }
    pub fn migrates(self) -> bool {
        matches!(self, Self::All | Self::Migrate)
    }
}

/// One pool per role on the service's database. Only `app` may go through
/// a pooler (`DB_POOLER`); `relay` and `owner` are sessions of their own,
/// so whatever needs one (LISTEN) takes it from them.
#[derive(Debug, Clone)]
pub struct Databases {
    pub app: PgPool,
    pub relay: PgPool,
    pub owner: PgPool,
    /// The log relay's replication connection (`RELAY_MODE=log` only).
    pub replication_url: Option<String>,
}

impl Databases {
    /// Pools that connect on first use, so a service starts (and reports
    /// not ready) while its database is down. Every session carries
    /// `application` (e.g. `orders-consume`) as its `application_name`: in
    /// `pg_stat_activity`, who holds what, and in the bench, what each
    /// role costs PostgreSQL.
    pub fn connect_lazy(
        database_url: &str,
        common: &CommonSettings,
        application: &str,
    ) -> Result<Self> {
        let role = |over: &Option<String>, role: &str| -> Result<PgConnectOptions> {
            let options = match over {
                Some(url) if role == db::RELAY_ROLE => {
                    db::numbering_relay(PgConnectOptions::from_str(url)?)
                }
                Some(url) => PgConnectOptions::from_str(url)?,
                None => db::options_for_role(&PgConnectOptions::from_str(database_url)?, role),
            };
            Ok(options.application_name(application))
        };
        let pool = |opts: PgConnectOptions, max| {
            db::pool_options()
                .max_connections(max)
                .acquire_timeout(Duration::from_secs(5))
                .connect_lazy_with(opts)
        };
        let mut app = role(&common.app_database_url, db::APP_ROLE)?;
        if let Some(pooler) = &common.db_pooler {
            let (host, port) = pooler
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                .ok_or_else(|| Error::Config(format!("DB_POOLER is host:port, not {pooler:?}")))?;
            app = app.host(host).port(port);
        }
        Ok(Self {
            app: pool(app, common.db_pool_size),
            relay: pool(
                role(&common.relay.database_url, db::RELAY_ROLE)?,
                common.db_relay_pool_size,
            ),
            owner: pool(
                role(&common.owner_database_url, db::OWNER_ROLE)?,
                common.db_owner_pool_size,
            ),
            replication_url: match common.relay.mode {
                RelayMode::Log => Some(common.relay.replication_url(database_url)?),
                RelayMode::Poll => None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `local()` is an empty environment's parse: the defaults written in
    /// the `#[arg]`s, never this process's environment. It wrote each
    /// default a second time, by hand, before.
    #[test]
    fn local_is_what_an_empty_environment_parses_to() {
        let local = CommonSettings::local();
        assert_eq!(local.amqp_url, "amqp://guest:guest@127.0.0.1:5672/%2f");
        assert_eq!(local.exchange, contracts::EXCHANGE);
        assert_eq!((local.db_pool_size, local.consumer_lanes), (16, 4));
        assert_eq!(local.read_rate_limit(), READ_RATE_LIMIT);
        assert_eq!(local.auth.jwt_max_lifetime_secs, 86_400);
        assert!(local.auth.jwt_secret.is_none() && local.app_database_url.is_none());
        assert!(!local.openapi);
    }

    #[tokio::test]
    async fn only_the_runtime_role_goes_through_the_pooler() {
        let common = CommonSettings {
            db_pooler: Some("10.0.0.7:6432".into()),
            ..CommonSettings::local()
        };
        let dbs =
            Databases::connect_lazy("postgres://u@127.0.0.1:5432/orders", &common, "t").unwrap();
        let at = |p: &PgPool| {
            let o = p.connect_options();
            (
                o.get_host().to_owned(),
                o.get_port(),
                o.get_database().map(str::to_owned),
            )
        };
        let orders = Some("orders".to_owned());
        assert_eq!(at(&dbs.app), ("10.0.0.7".into(), 6432, orders.clone()));
        assert_eq!(at(&dbs.relay), ("127.0.0.1".into(), 5432, orders.clone()));
        assert_eq!(at(&dbs.owner), ("127.0.0.1".into(), 5432, orders));
        assert_eq!(dbs.app.connect_options().get_username(), db::APP_ROLE);

        let bad = CommonSettings {
            db_pooler: Some("pgbouncer".into()),
            ..CommonSettings::local()
        };
        let err = Databases::connect_lazy("postgres://u@127.0.0.1/orders", &bad, "t").unwrap_err();
        assert!(err.to_string().contains("DB_POOLER is host:port"), "{err}");
    }
}
