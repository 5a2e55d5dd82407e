//! Starting a service and keeping it running: migrations, [`launch`] of
//! the parts a role asks for, and the [`Tasks`] that stop together.

use std::time::Duration;

use axum::routing::get;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use utoipa_axum::router::OpenApiRouter;

use maintenance::{self, MaintenanceConfig};
use reliability::broker::Subscription;
use reliability::consumer::{Apply, Consumer};
use reliability::health::Health;
use reliability::relay::{Relay, RelayConfig};
use reliability::trace;
use reliability::{Error, Result, db};

use super::{
    ApiState, CommonSettings, Databases, LOG_MODE_SWEEP, Readiness, RelayMode, Role, ShutdownToken,
    bind, bind_ops, document, http_app, ops_routes, serve_with,
};

/// Runs migrations, retrying while the database is not reachable yet.
pub async fn migrate_with_retry(
    owner: &PgPool,
    service: &sqlx::migrate::Migrator,
    shutdown: &CancellationToken,
) -> Result<()> {
    let mut delay = Duration::from_millis(200);
    loop {
        match db::migrate(owner, Some(service)).await {
            Ok(()) => return Ok(()),
            Err(Error::Database(e)) if !shutdown.is_cancelled() => {
                tracing::warn!(error = %e, retry_in = ?delay, "database not reachable for migrations; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
}

/// The background tasks of one process. If any ends with an error the
/// others are stopped too: a half-running service is worse than a restart.
pub struct Tasks {
    set: JoinSet<(String, Result<()>)>,
    shutdown: CancellationToken,
    health: Health,
    /// The management API where each consumer's bindings are read.
    bindings_at: Option<String>,
}

impl Tasks {
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            set: JoinSet::new(),
            shutdown,
            health: Health::default(),
            bindings_at: None,
        }
    }

    /// Each consumer spawned from now on has its bindings read at `url`
    /// (the broker's management API) for `/readyz` ([`crate::bindings`]).
    pub fn check_bindings_at(&mut self, url: &str) {
        self.bindings_at = Some(url.to_owned()).filter(|u| !u.is_empty());
    }

    /// What this process's parts report to `/readyz`.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    pub fn shutdown(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    pub fn spawn<F>(&mut self, name: &str, task: F)
    where
        F: Future<Output = Result<()>> + Send + 'static,
    {
        let name = name.to_owned();
        self.set.spawn(async move { (name, task.await) });
    }

    /// The log relay (docs/adr/0038), and its slot's gauges.
    fn spawn_log_relay(
        &mut self,
        dbs: &Databases,
        common: &CommonSettings,
        config: RelayConfig,
    ) -> Result<()> {
        let url = dbs.replication_url.clone().ok_or_else(|| {
            Error::Config("RELAY_MODE=log needs a replication URL (RELAY_REPLICATION_URL)".into())
        })?;
        let relay = Relay::new(dbs.relay.clone(), &common.amqp_url, config);
        let config = log_relay::LogRelayConfig::new(&url);
        let slot = config.slot.clone();
        let log = log_relay::LogRelay::new(relay, config).with_health(self.health.clone());
        let stop = self.shutdown.clone();
        self.spawn("log relay", async move {
            log.run(stop).await;
            Ok(())
        });
        let (pool, stop) = (dbs.relay.clone(), self.shutdown.clone());
        self.spawn("log relay slot", async move {
            log_relay::watch_slot(&pool, &slot, stop).await;
            Ok(())
        });
        Ok(())
    }

    /// The outbox relay of `source` (as the relay role) and the maintenance
    /// jobs (as the owner).
    pub fn spawn_relay(
        &mut self,
        dbs: &Databases,
        common: &CommonSettings,
        source: &str,
        subscriptions: &[Subscription],
    ) -> Result<()> {
        let mut config = RelayConfig::new(source, &common.exchange);
        config.topology = subscriptions
            .iter()
            .map(|s| common.queue_spec(s))
            .collect::<Result<_>>()?;
        config.fail_points = common.fail_points()?;
        config.backoff_step = Duration::from_millis(common.relay.backoff_ms);
        config.confirm_timeout = Duration::from_millis(common.relay.confirm_timeout_ms);
        config.max_attempts = common.relay.max_attempts;
        if common.relay.mode == RelayMode::Log {
            self.spawn_log_relay(dbs, common, config.clone())?;
            // The polling relay sweeps for what the log does not show.
            config.listens = false;
            config.poll_interval = LOG_MODE_SWEEP;
        }
        let relay =
            Relay::new(dbs.relay.clone(), &common.amqp_url, config).with_health(self.health());
        let stop = self.shutdown.clone();
        self.spawn("relay", async move { relay.run(stop).await });
        let (owner, stop) = (dbs.owner.clone(), self.shutdown.clone());
        self.spawn("maintenance", async move {
            maintenance::run(owner, MaintenanceConfig::default(), stop).await;
            Ok(())
        });
        Ok(())
    }

    pub fn spawn_consumer<A: Apply>(&mut self, consumer: Consumer<A>) {
        let consumer = consumer.with_health(self.health());
        let stop = self.shutdown.clone();
        let config = consumer.config();
        if let Some(url) = self.bindings_at.clone() {
            let watch = crate::bindings::watch(
                config.name.clone(),
                config.queue.clone(),
                url,
                crate::bindings::BINDINGS_EVERY,
                self.health(),
                stop.clone(),
            );
            self.set.spawn(async move {
                watch.await;
                ("bindings".to_owned(), Ok(()))
            });
        }
        let name = format!("consumer {}", config.name);
        self.spawn(&name, async move { consumer.run(stop).await });
    }

    /// Waits until shutdown (or a task fails), then for every task to stop.
    pub async fn wait(mut self) -> Result<()> {
        let mut first_error = None;
        while let Some(joined) = self.set.join_next().await {
            let (name, result) = joined.unwrap_or_else(|source| {
                let task = "a task".to_owned();
                (task.clone(), Err(Error::Panicked { task, source }))
            });
            match result {
                Ok(()) => tracing::info!(task = %name, "stopped"),
                Err(e) => {
                    tracing::error!(task = %name, error = %e, "failed; stopping the process");
                    first_error.get_or_insert(e);
                }
            }
            self.shutdown.cancel();
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// What a service brings to [`launch`].
pub struct ServiceSpec<'a> {
    /// The service's name: the source of its events.
    pub name: &'static str,
    pub role: Role,
    /// HTTP port (0 picks a free one).
    pub port: u16,
    pub common: &'a CommonSettings,
    /// The service's own migrations (the reliability tables come first).
    pub migrations: &'static sqlx::migrate::Migrator,
    /// The service's documented routes, given the shared HTTP state.
    pub routes: fn(ApiState) -> OpenApiRouter,
    /// Every subscriber queue its relay must see exist before it publishes
    /// (the commerce services: `contracts::topology::ALL`).
    pub subscriptions: &'static [Subscription],
    /// The service's own settings, handed to its routes ([`ApiState::own`]).
    pub own: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

/// A started service: its ports and its tasks.
pub struct Application {
    service: &'static str,
    port: u16,
    ops_port: u16,
    tasks: Tasks,
}

impl Application {
    /// The HTTP port, when the role serves.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where `/healthz`, `/readyz` (with its detail) and `/metrics` answer,
    /// on `OPS_BIND_ADDRESS`.
    pub fn ops_port(&self) -> u16 {
        self.ops_port
    }

    /// Until SIGTERM (or the shutdown token), or until a part fails.
    pub async fn run_until_stopped(self) -> Result<()> {
        let result = self.tasks.wait().await;
        trace::shutdown(self.service);
        result
    }
}

/// Starts the parts of a service its role asks for: migrations, the HTTP
/// server (with the contract's stack and ops routes), the outbox relay and
/// maintenance, and whatever `consumers` adds (when the role consumes).
pub async fn launch(
    spec: ServiceSpec<'_>,
    dbs: Databases,
    shutdown: ShutdownToken,
    consumers: impl FnOnce(&mut Tasks, &Databases) -> Result<()>,
) -> Result<Application> {
    let common = spec.common;
    let mut tasks = Tasks::new(shutdown.clone());
    tasks.check_bindings_at(&common.management_url);
    // A weak secret or an unreadable key set stops the start, before anything runs.
    let jwt = match spec.role.serves() {
        true => Some(common.auth.load(&common.bind_address).await?),
        false => None,
    };
    if spec.role.migrates() {
        migrate_with_retry(&dbs.owner, spec.migrations, &shutdown).await?;
    }
    let metrics = reliability::metrics::install();
    reliability::metrics::describe(crate::metrics::CATALOGUE);
    reliability::metrics::build_info(spec.name, &format!("{:?}", spec.role).to_lowercase());
    match common.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) {
        Some(endpoint) => trace::export(spec.name, Some(endpoint)).map_err(Error::Config)?,
        None if trace::wanted_by_env() => trace::export(spec.name, None).map_err(Error::Config)?,
        None => {}
    }
    let ready = Readiness {
        pool: dbs.app.clone(),
        amqp_url: common.amqp_url.clone(),
        health: tasks.health(),
    };
    let mut port = 0;
    if let Some(jwt) = jwt {
        let listener = bind(common, spec.port).await?;
        port = local_port(&listener)?;
        let reads = crate::rate_limit::ReadBudget {
            keys: jwt.clone(),
            limiter: crate::rate_limit::RateLimiter::new(common.read_rate_limit()),
        };
        let state = ApiState::new(dbs.app.clone(), jwt)
            .with_rate_limit(common.rate_limit())
            .with_admission(common.admission()?)
            .with_own(spec.own.clone());
        let (routes, mut api) = (spec.routes)(state).split_for_parts();
        document(&mut api, spec.name);
        let api = std::sync::Arc::new(api);
        let routes = routes
            .layer(axum::middleware::from_fn_with_state(
                reads,
                crate::rate_limit::read_budget,
            ))
            .route(
                "/openapi.json",
                get(move || std::future::ready(axum::Json(api.as_ref().clone()))),
            );
        let app = http_app(spec.name, routes, ready.clone());
        tasks.spawn(
            "http",
            serve_with(listener, app, shutdown.clone(), common.server_limits()),
        );
        tracing::info!(service = spec.name, port, "listening");
    }
    let mut ops_port = 0;
    if spec.role.serves() || spec.role.relays() || spec.role.consumes() {
        // Every role is observable, on a port of its own that no API shares:
        // the metrics name tenants and count their traffic.
        let wanted = common.ops_port.unwrap_or(match spec.port {
            0 => 0,
            p => p.saturating_add(ops_offset(spec.role)),
        });
        let listener = bind_ops(common, wanted).await?;
        ops_port = local_port(&listener)?;
        tasks.spawn(
            "ops http",
            serve_with(
                listener,
                ops_routes(ready, metrics),
                shutdown.clone(),
                common.server_limits(),
            ),
        );
        tracing::info!(service = spec.name, role = ?spec.role, address = %common.ops_bind_address, ops_port, "health and metrics at /healthz /readyz /metrics");
        // Only a role that runs: `migrate` must exit once it is done.
        let pools = vec![
            ("app", dbs.app.clone()),
            ("relay", dbs.relay.clone()),
            ("owner", dbs.owner.clone()),
        ];
        tasks.spawn(
            "process gauges",
            reliability::metrics::process::sample(pools, shutdown.clone()),
        );
    }
    if spec.role.relays() {
        tasks.spawn_relay(&dbs, common, spec.name, spec.subscriptions)?;
    }
    if spec.role.consumes() {
        consumers(&mut tasks, &dbs)?;
    }
    Ok(Application {
        service: spec.name,
        port,
        ops_port,
        tasks,
    })
}

fn local_port(listener: &TcpListener) -> Result<u16> {
    Ok(listener
        .local_addr()
        .map_err(|source| Error::Bind {
            address: "the listener's address".into(),
            source,
        })?
        .port())
}

/// Added to a service's port for a role's ops port unless `OPS_PORT` says:
/// no two roles of a host share one, and the console finds each.
pub fn ops_offset(role: Role) -> u16 {
    match (role.serves(), role.relays()) {
        (true, _) => 3000,
        (_, true) => 1000,
        _ => 2000,
    }
}
