//! What every service binary shares, so a service is only its routes,
//! handlers, consumers and domain SQL:
//!
//! - [`CommonSettings`]: broker, exchange, JWT secret, role URLs (clap + env);
//! - [`Databases`]: one pool per role, from the service's database URL;
//! - [`http_app`]: the HTTP stack of the contract (64 KiB body limit, JSON
//!   errors for 404/413/500, request id, trace context, per-route metrics)
//!   plus `/healthz`, `/readyz`, `/metrics`;
//! - [`Tasks`]: the server, relay, consumers and maintenance of one process,
//!   stopped together on SIGTERM or when one of them fails;
//! - [`Role`]: run everything (the default) or one part, so a part can be
//!   killed and restarted alone.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRef, MatchedPath, Request, State};
use axum::http::{HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use utoipa_axum::router::OpenApiRouter;

use crate::auth::{AuthSettings, JwtKeys};
use crate::broker::{QueueSpec, Subscription};
use crate::consumer::{Consumer, ConsumerConfig, Handler};
use crate::failpoint::FailPoints;
use crate::health::Health;
use crate::http::ApiError;
use crate::idempotency::IdempotencyConfig;
use crate::maintenance::{self, MaintenanceConfig};
use crate::rate_limit::{RateLimit, RateLimiter};
use crate::relay::{Relay, RelayConfig};
use crate::trace::{self, TraceContext};
use crate::{Error, Result, db};

/// What every long-running part of a service watches to stop.
pub use tokio_util::sync::CancellationToken as ShutdownToken;

/// Largest request body any route accepts (the contract's 413 limit).
pub const BODY_LIMIT: usize = 64 * 1024;

/// A string that never prints (JWT secret, passwords).
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

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
    #[arg(long, env = "EVENTS_EXCHANGE", default_value = "commerce.events")]
    pub exchange: String,
    /// How bearer tokens are verified.
    #[command(flatten)]
    pub auth: AuthSettings,
    /// Full URL for the runtime role; default: the service's database URL as `commerce_app`.
    #[arg(long, env = "APP_DATABASE_URL")]
    pub app_database_url: Option<String>,
    /// Full URL for the relay role; default: the service's database URL as `commerce_relay`.
    #[arg(long, env = "RELAY_DATABASE_URL")]
    pub relay_database_url: Option<String>,
    /// Full URL for the owner role (migrations, maintenance); default: as `commerce_owner`.
    #[arg(long, env = "OWNER_DATABASE_URL")]
    pub owner_database_url: Option<String>,
    /// Crash points for tests, e.g. `relay.after_confirm=abort` (see `failpoint`).
    #[arg(long, env = "RELIABILITY_FAILPOINTS", default_value = "")]
    pub fail_points: String,
    /// Prefix of every consumer queue name (tests and side-by-side stacks
    /// on one broker keep theirs apart with it).
    #[arg(long, env = "QUEUE_PREFIX", default_value = "")]
    pub queue_prefix: String,
    /// Relay backoff step in ms: a failed publish waits `min(attempts+1, 8)` steps.
    #[arg(long, env = "RELAY_BACKOFF_MS", default_value_t = 30_000)]
    pub relay_backoff_ms: u64,
    /// How long the relay waits for the broker's confirms of a batch (and
    /// so holds its claim), in ms. Unconfirmed rows stay pending and cost no
    /// attempt.
    #[arg(long, env = "RELAY_CONFIRM_TIMEOUT_MS", default_value_t = 10_000)]
    pub relay_confirm_timeout_ms: u64,
    /// Failed publishes after which an outbox row moves to the DLQ table.
    #[arg(long, env = "RELAY_MAX_ATTEMPTS", default_value_t = 10)]
    pub relay_max_attempts: i32,
    /// Lanes of each consumer in this process: each applies its own
    /// deliveries beside the others (docs/adr/0010). More processes may
    /// consume the same queues too.
    #[arg(long, env = "CONSUMER_LANES", default_value_t = 4)]
    pub consumer_lanes: usize,
    /// Port of `/healthz`, `/readyz` and `/metrics` for a process that
    /// serves no HTTP API (roles `relay` and `consume`); default: the
    /// service's port + 1000 (relay) or + 2000 (consume). Roles that serve
    /// answer them on the service's port.
    #[arg(long, env = "OPS_PORT")]
    pub ops_port: Option<u16>,
    /// Writes (idempotent POSTs) per second each tenant may make to this
    /// process, sustained; over it: 429 with `Retry-After`. 0: no limit.
    #[arg(long, env = "RATE_LIMIT_PER_SEC", default_value_t = 1000)]
    pub rate_limit_per_sec: u32,
    /// Writes a tenant may make at once above the sustained rate.
    #[arg(long, env = "RATE_LIMIT_BURST", default_value_t = 2000)]
    pub rate_limit_burst: u32,
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
}

impl CommonSettings {
    /// Local defaults, as with no environment at all.
    pub fn local() -> Self {
        Self {
            amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            exchange: "commerce.events".into(),
            auth: AuthSettings::default(),
            app_database_url: None,
            relay_database_url: None,
            owner_database_url: None,
            fail_points: String::new(),
            queue_prefix: String::new(),
            relay_backoff_ms: 30_000,
            relay_confirm_timeout_ms: 10_000,
            relay_max_attempts: 10,
            consumer_lanes: 4,
            ops_port: None,
            rate_limit_per_sec: 1000,
            rate_limit_burst: 2000,
            http_header_timeout_secs: 10,
            http_request_timeout_secs: 30,
            openapi: false,
            bind_address: "127.0.0.1".into(),
        }
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

    pub fn fail_points(&self) -> Result<FailPoints> {
        FailPoints::parse(&self.fail_points)
    }

    /// The queue of `sub` on the events exchange, its name prefixed.
    pub fn queue_spec(&self, sub: &Subscription) -> QueueSpec {
        QueueSpec::for_subscription(sub, &self.exchange, &self.queue_prefix)
    }

    /// The consumer of `sub` (the topology declares it once for both sides),
    /// its lanes and fail points from these settings.
    pub fn consumer_config(&self, sub: &Subscription) -> Result<ConsumerConfig> {
        let mut config = ConsumerConfig::new(sub.consumer, &self.exchange, sub.bindings);
        config.queue = self.queue_spec(sub);
        config.lanes = self.consumer_lanes.max(1);
        config.fail_points = self.fail_points()?;
        Ok(config)
    }
}

/// The state every service's HTTP routes need: the runtime pool, the
/// idempotency settings and the token keys. Use it as the router state, or
/// embed it and delegate `FromRef`.
#[derive(Debug, Clone)]
pub struct ApiState {
    pub pool: PgPool,
    pub idempotency: IdempotencyConfig,
    pub jwt: JwtKeys,
}

impl ApiState {
    pub fn new(pool: PgPool, jwt: JwtKeys) -> Self {
        Self {
            idempotency: IdempotencyConfig::new(pool.clone()),
            pool,
            jwt,
        }
    }

    #[must_use]
    pub fn with_rate_limit(mut self, limit: RateLimit) -> Self {
        self.idempotency.rate_limit = RateLimiter::new(limit);
        self
    }
}

impl FromRef<ApiState> for IdempotencyConfig {
    fn from_ref(s: &ApiState) -> Self {
        s.idempotency.clone()
    }
}

impl FromRef<ApiState> for JwtKeys {
    fn from_ref(s: &ApiState) -> Self {
        s.jwt.clone()
    }
}

impl FromRef<ApiState> for PgPool {
    fn from_ref(s: &ApiState) -> Self {
        s.pool.clone()
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

/// One pool per role on the service's database.
#[derive(Debug, Clone)]
pub struct Databases {
    pub app: PgPool,
    pub relay: PgPool,
    pub owner: PgPool,
}

impl Databases {
    /// Pools that connect on first use, so a service starts (and reports
    /// not ready) while its database is down.
    pub fn connect_lazy(database_url: &str, common: &CommonSettings) -> Result<Self> {
        let role = |over: &Option<String>, role: &str| -> Result<PgConnectOptions> {
            match over {
                Some(url) => Ok(PgConnectOptions::from_str(url)?),
                None => Ok(db::options_for_role(
                    &PgConnectOptions::from_str(database_url)?,
                    role,
                )),
            }
        };
        let pool = |opts: PgConnectOptions, max| {
            PgPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(Duration::from_secs(5))
                .connect_lazy_with(opts)
        };
        Ok(Self {
            app: pool(role(&common.app_database_url, db::APP_ROLE)?, 16),
            relay: pool(role(&common.relay_database_url, db::RELAY_ROLE)?, 6),
            owner: pool(role(&common.owner_database_url, db::OWNER_ROLE)?, 2),
        })
    }
}

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
}

impl Tasks {
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            set: JoinSet::new(),
            shutdown,
            health: Health::default(),
        }
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
        config.topology = subscriptions.iter().map(|s| common.queue_spec(s)).collect();
        config.fail_points = common.fail_points()?;
        config.backoff_step = Duration::from_millis(common.relay_backoff_ms);
        config.confirm_timeout = Duration::from_millis(common.relay_confirm_timeout_ms);
        config.max_attempts = common.relay_max_attempts;
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

    pub fn spawn_consumer<H: Handler>(&mut self, consumer: Consumer<H>) {
        let consumer = consumer.with_health(self.health());
        let stop = self.shutdown.clone();
        let name = format!("consumer {}", consumer.config().name);
        self.spawn(&name, async move { consumer.run(stop).await });
    }

    /// Waits until shutdown (or a task fails), then for every task to stop.
    pub async fn wait(mut self) -> Result<()> {
        let mut first_error = None;
        while let Some(joined) = self.set.join_next().await {
            let (name, result) = joined.unwrap_or_else(|e| {
                (
                    "task".to_owned(),
                    Err(Error::Config(format!("task panicked: {e}"))),
                )
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
}

/// A started service: its ports and its tasks.
pub struct Application {
    port: u16,
    ops_port: u16,
    tasks: Tasks,
}

impl Application {
    /// The HTTP port, when the role serves.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where `/healthz`, `/readyz` and `/metrics` answer: the HTTP port when
    /// the role serves, else the ops port.
    pub fn ops_port(&self) -> u16 {
        self.ops_port
    }

    /// Until SIGTERM (or the shutdown token), or until a part fails.
    pub async fn run_until_stopped(self) -> Result<()> {
        self.tasks.wait().await
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
    // A weak secret or an unreadable key set stops the start, before anything runs.
    let jwt = match spec.role.serves() {
        true => Some(common.auth.load(&common.bind_address).await?),
        false => None,
    };
    if spec.role.migrates() {
        migrate_with_retry(&dbs.owner, spec.migrations, &shutdown).await?;
    }
    let metrics = crate::metrics::install();
    crate::metrics::build_info(spec.name, &format!("{:?}", spec.role).to_lowercase());
    let ready = Readiness {
        pool: dbs.app.clone(),
        amqp_url: common.amqp_url.clone(),
        health: tasks.health(),
    };
    let (mut port, mut ops_port) = (0, 0);
    if let Some(jwt) = jwt {
        let listener = bind(common, spec.port).await?;
        port = local_port(&listener)?;
        ops_port = port;
        let state = ApiState::new(dbs.app.clone(), jwt).with_rate_limit(common.rate_limit());
        let (routes, mut api) = (spec.routes)(state).split_for_parts();
        document(&mut api, spec.name);
        let api = std::sync::Arc::new(api);
        let routes = routes.route(
            "/openapi.json",
            get(move || std::future::ready(axum::Json(api.as_ref().clone()))),
        );
        let app = http_app(routes, ready, metrics);
        tasks.spawn(
            "http",
            serve_with(listener, app, shutdown.clone(), common.server_limits()),
        );
        tracing::info!(service = spec.name, port, "listening");
    } else if spec.role.relays() || spec.role.consumes() {
        // Every role is observable: a relay-only or consumer-only process
        // serves the ops routes on a port of its own.
        let offset = if spec.role.relays() { 1000 } else { 2000 };
        let wanted = common.ops_port.unwrap_or(match spec.port {
            0 => 0,
            p => p.saturating_add(offset),
        });
        let listener = bind(common, wanted).await?;
        ops_port = local_port(&listener)?;
        let app = ops_routes(ready, metrics);
        tasks.spawn(
            "ops http",
            serve_with(listener, app, shutdown.clone(), common.server_limits()),
        );
        tracing::info!(service = spec.name, role = ?spec.role, ops_port, "health and metrics at /healthz /readyz /metrics");
    }
    if spec.role.relays() {
        tasks.spawn_relay(&dbs, common, spec.name, spec.subscriptions)?;
    }
    if spec.role.consumes() {
        consumers(&mut tasks, &dbs)?;
    }
    Ok(Application {
        port,
        ops_port,
        tasks,
    })
}

fn local_port(listener: &TcpListener) -> Result<u16> {
    Ok(listener
        .local_addr()
        .map_err(|e| Error::Config(e.to_string()))?
        .port())
}

/// The OpenAPI document of a service's routes, without a database (for
/// `<service> --openapi` and CI).
pub fn openapi(name: &str, routes: fn(ApiState) -> OpenApiRouter) -> utoipa::openapi::OpenApi {
    let pool = PgPoolOptions::new().connect_lazy_with(PgConnectOptions::new());
    let (_, mut api) =
        routes(ApiState::new(pool, JwtKeys::from_secret(b"unused"))).split_for_parts();
    document(&mut api, name);
    api
}

/// What is the same on every route, written once: bearer authentication,
/// the `Idempotency-Key` header of every POST, and the contract's error
/// responses with their shared body.
pub fn document(api: &mut utoipa::openapi::OpenApi, name: &str) {
    use utoipa::openapi::path::{HttpMethod, ParameterBuilder, ParameterIn};
    use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
    use utoipa::openapi::{
        ContentBuilder, ObjectBuilder, Ref, RefOr, Required, ResponseBuilder, Type,
    };

    api.info.title = format!("{name} service");
    api.info.version = env!("CARGO_PKG_VERSION").to_owned();
    api.info.description = Some(
        "Every route needs `Authorization: Bearer <JWT>` (HS256, integer claims `tenant_id` and `exp`). \
         Errors are `{\"error\": {\"code\", \"message\"}}`."
            .to_owned(),
    );
    let components = api.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            Http::builder()
                .scheme(HttpAuthScheme::Bearer)
                .bearer_format("JWT")
                .build(),
        ),
    );
    let schemas: Vec<(String, RefOr<utoipa::openapi::schema::Schema>)> = {
        let mut v = Vec::new();
        <crate::http::ErrorBody as utoipa::ToSchema>::schemas(&mut v);
        v.push((
            <crate::http::ErrorBody as utoipa::ToSchema>::name().into_owned(),
            <crate::http::ErrorBody as utoipa::PartialSchema>::schema(),
        ));
        v
    };
    components.schemas.extend(schemas);
    let error = |description: &str| {
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build()
    };
    for item in api.paths.paths.values_mut() {
        for (method, op) in [
            (HttpMethod::Get, item.get.as_mut()),
            (HttpMethod::Post, item.post.as_mut()),
        ] {
            let Some(op) = op else { continue };
            op.security = Some(vec![SecurityRequirement::new(
                "bearer",
                Vec::<String>::new(),
            )]);
            let mut errors = vec![("401", "missing, expired or badly signed token")];
            if method == HttpMethod::Post {
                op.parameters.get_or_insert_with(Vec::new).push(RefOr::T(
                    ParameterBuilder::new()
                        .name("Idempotency-Key")
                        .parameter_in(ParameterIn::Header)
                        .required(Required::True)
                        .description(Some("1 to 255 visible ASCII characters; a replay returns the stored response with `Idempotent-Replayed: true`"))
                        .schema(Some(ObjectBuilder::new().schema_type(Type::String).min_length(Some(1)).max_length(Some(255)).pattern(Some("^[\\x21-\\x7E]+$"))))
                        .build(),
                ));
                errors.extend([
                    (
                        "400",
                        "malformed JSON, or a missing or invalid Idempotency-Key",
                    ),
                    ("409", "the Idempotency-Key was used with another body"),
                    ("413", "the body is larger than 64 KiB"),
                    ("422", "well-formed but invalid input"),
                    (
                        "425",
                        "a request with this Idempotency-Key is still in flight; see Retry-After",
                    ),
                    (
                        "429",
                        "over the tenant's rate limit; nothing was run, see Retry-After",
                    ),
                ]);
            } else {
                errors.push(("404", "no such resource for this tenant"));
            }
            errors.extend([
                ("408", "the request took longer than the server allows"),
                ("500", "internal error (logged; never shown)"),
                (
                    "503",
                    "a dependency (the database) is unavailable; see Retry-After",
                ),
            ]);
            for (status, description) in errors {
                op.responses
                    .responses
                    .entry(status.to_owned())
                    .or_insert_with(|| RefOr::T(error(description)));
            }
        }
    }
}

/// Binds the HTTP listener (port 0 picks a free port: tests).
pub async fn bind(common: &CommonSettings, port: u16) -> Result<TcpListener> {
    TcpListener::bind((common.bind_address.as_str(), port))
        .await
        .map_err(|e| Error::Config(format!("bind {}:{port}: {e}", common.bind_address)))
}

/// How long the server gives a client, so that a slow or idle one cannot
/// hold a connection (or, through it, anything else) for long.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// To send a request's headers, counted from when the server waits for
    /// them; an idle keep-alive connection is closed after it too.
    pub header_read: Duration,
    /// For a whole request, body and handler included: past it the handler
    /// is dropped (its transaction rolls back) and the client gets 408.
    pub request: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(10),
            request: Duration::from_secs(30),
        }
    }
}

/// Serves `app` until `shutdown`, then lets requests in flight finish (at
/// most `limits.request`).
pub async fn serve(listener: TcpListener, app: Router, shutdown: CancellationToken) -> Result<()> {
    serve_with(listener, app, shutdown, ServerLimits::default()).await
}

/// [`serve`] with explicit limits.
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
    limits: ServerLimits,
) -> Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::server::graceful::GracefulShutdown;
    use hyper_util::service::TowerToHyperService;

    let app = app.layer(middleware::from_fn_with_state(
        limits.request,
        request_deadline,
    ));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let graceful = GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, most likely: let some close.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection closed with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.request, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight at shutdown were cut off");
    }
    Ok(())
}

/// A request that outlives its deadline is dropped: its transaction rolls
/// back and its Idempotency-Key stays free.
async fn request_deadline(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request took too long (a slow body, or a slow dependency)",
        )
        .into_response(),
    }
}

/// What `/readyz` checks: the database, the broker, and every part of the
/// process (relay, consumers) that reports to `health`.
#[derive(Clone)]
pub struct Readiness {
    pub pool: PgPool,
    pub amqp_url: String,
    pub health: Health,
}

/// `/healthz`, `/readyz` and `/metrics`: what every process role serves.
pub fn ops_routes(ready: Readiness, metrics: PrometheusHandle) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|| async { axum::Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/readyz", get(readyz))
        .with_state(ready)
        .merge(crate::metrics::router(metrics))
}

/// The service's routes wrapped in the contract's HTTP stack, plus
/// `/healthz`, `/readyz` and `/metrics`.
pub fn http_app(routes: Router, ready: Readiness, metrics: PrometheusHandle) -> Router {
    let request_id = HeaderName::from_static("x-request-id");
    let ops = ops_routes(ready, metrics);
    routes
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed on this route")
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn(record_metrics))
        .layer(middleware::from_fn(trace_context))
        .merge(ops)
        .layer(
            TraceLayer::new_for_http().make_span_with(|req: &Request| {
                let route = req.extensions().get::<MatchedPath>().map_or("", |p| p.as_str());
                let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
                tracing::info_span!("request", method = %req.method(), route, request_id = id,
                                    tenant_id = tracing::field::Empty, trace_id = tracing::field::Empty)
            }),
        )
        .layer(CatchPanicLayer::custom(|_| ApiError::internal(&"handler panicked").into_response()))
        .layer(PropagateRequestIdLayer::new(request_id.clone()))
        .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
}

async fn readyz(State(r): State<Readiness>) -> Response {
    let db = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query("SELECT 1").execute(&r.pool),
    )
    .await;
    let db_ok = matches!(db, Ok(Ok(_)));
    let broker_ok = broker_reachable(&r.amqp_url).await;
    let (parts_ok, parts) = r.health.report();
    let status = if db_ok && broker_ok && parts_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        axum::Json(serde_json::json!({"database": db_ok, "broker": broker_ok, "parts": parts})),
    )
        .into_response()
}

/// A TCP connect to the broker's host and port: cheap enough for every probe.
async fn broker_reachable(amqp_url: &str) -> bool {
    let rest = amqp_url.split_once("://").map_or(amqp_url, |(_, r)| r);
    let host_port = rest
        .rsplit_once('@')
        .map_or(rest, |(_, r)| r)
        .split('/')
        .next()
        .unwrap_or("");
    let host_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    };
    matches!(
        tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect(host_port)
        )
        .await,
        Ok(Ok(_))
    )
}

/// `http_requests_total{method,route,status}` and
/// `http_request_duration_seconds{method,route}`, by matched route so that
/// ids in paths do not explode the label set.
async fn record_metrics(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().to_string();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!(crate::metrics::HTTP_REQUESTS, "method" => method.clone(), "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!(crate::metrics::HTTP_REQUEST_DURATION, "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Continues the caller's `traceparent` or starts a trace; events written
/// while handling the request carry it on.
async fn trace_context(req: Request, next: Next) -> Response {
    let header = req
        .headers()
        .get(trace::HEADER)
        .and_then(|v| v.to_str().ok());
    let ctx = TraceContext::continue_from(header);
    tracing::Span::current().record("trace_id", ctx.trace_id());
    trace::scope(ctx, next.run(req)).await
}

/// Logs as JSON when `LOG_FORMAT=json`, else human-readable; `RUST_LOG`
/// filters (default `info`).
pub fn init_tracing() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if std::env::var("LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
