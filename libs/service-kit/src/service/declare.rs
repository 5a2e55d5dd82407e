//! A service declared once ([`Service`]): its name, routes, consumers and
//! workers, and migrations, read by one runtime. Every service gets the
//! same [`Settings`] (the environment names follow the service's name),
//! the same `main` and the same start, so a service's `lib.rs` is its
//! declaration plus its domain.

use clap::{Args, CommandFactory, FromArgMatches, Parser, ValueEnum};
use sqlx::migrate::Migrator;
use utoipa_axum::router::OpenApiRouter;

use reliability::Result;
use reliability::broker::Subscription;
use reliability::consumer::{Consumer, Handler};

use super::{
    ApiState, Application, CommonSettings, Databases, Role, ServiceSpec, ShutdownToken, Tasks,
    init_tracing, launch, openapi,
};

/// For a service with no settings of its own.
#[derive(Debug, Clone, Default, Args)]
pub struct NoSettings {}

/// Everything the runtime needs to run any role of a service.
pub struct Service<X: Args + 'static = NoSettings> {
    /// The source of its events, its databases' default name, and the
    /// prefix of its variables (`orders`: `ORDERS_PORT`, `ORDERS_DATABASE_URL`).
    pub name: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// The default HTTP port.
    pub port: u16,
    /// Its own migrations (the reliability tables come first).
    pub migrations: &'static Migrator,
    /// Its documented routes, given the shared HTTP state.
    pub routes: fn(ApiState) -> OpenApiRouter,
    /// Every subscriber queue its relay must see exist before it publishes.
    pub subscriptions: &'static [Subscription],
    /// What runs when the role consumes: its consumers and workers.
    pub consume: fn(&mut Tasks, &Databases, &Settings<X>) -> Result<()>,
}

/// A service's settings: the shared ones, and `X`, its own.
#[derive(Debug, Clone, Parser)]
#[command(version)]
pub struct Settings<X: Args> {
    /// What this process runs.
    #[arg(value_enum, default_value_t = Role::All)]
    pub role: Role,
    /// HTTP port (0 picks a free one).
    #[arg(long)]
    pub port: u16,
    /// The service's database (roles are set per connection).
    #[arg(long)]
    pub database_url: String,
    #[command(flatten)]
    pub service: X,
    #[command(flatten)]
    pub common: CommonSettings,
}

impl<X: Args> Settings<X> {
    /// From the command line and the environment, with `service`'s
    /// variable names and defaults.
    pub fn from_env(service: &Service<X>) -> Self {
        let prefix = service.name.to_uppercase().replace('-', "_");
        // Once per process: clap keeps names and defaults as `&'static str`.
        let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
        let command = Self::command()
            .name(service.name)
            .about(service.about)
            .mut_arg("port", |a| {
                a.required(false)
                    .env(leak(format!("{prefix}_PORT")))
                    .default_value(leak(service.port.to_string()))
            })
            .mut_arg("database_url", |a| {
                a.required(false)
                    .env(leak(format!("{prefix}_DATABASE_URL")))
                    .default_value(leak(format!("postgres://127.0.0.1:5432/{}", service.name)))
            });
        // Last: the service's own variable names are known by now.
        let command = super::env_conventions(command);
        Self::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit())
    }
}

impl<X: Args + Default> Settings<X> {
    /// Every role, a free port, the database given at start (tests).
    pub fn local(common: CommonSettings) -> Self {
        Self {
            role: Role::All,
            port: 0,
            database_url: String::new(),
            service: X::default(),
            common,
        }
    }
}

impl Tasks {
    /// The consumer of `subscription` (its queue, bindings, lanes and fail
    /// points from `common`), applying with `handler` as the runtime role.
    pub fn consume<H: Handler>(
        &mut self,
        dbs: &Databases,
        common: &CommonSettings,
        subscription: &Subscription,
        handler: H,
    ) -> Result<()> {
        let config = common.consumer_config(subscription)?;
        self.spawn_consumer(Consumer::new(
            dbs.app.clone(),
            &common.amqp_url,
            config,
            handler,
        ));
        Ok(())
    }
}

/// Starts what `settings.role` asks for on `dbs`: a service's own pools
/// ([`Databases::connect_lazy`]) or a test's database.
pub async fn start<X: Args + Clone + Send + Sync>(
    service: &'static Service<X>,
    settings: Settings<X>,
    dbs: Databases,
    shutdown: ShutdownToken,
) -> Result<Application> {
    reliability::db::use_one_crypto_provider();
    let spec = ServiceSpec {
        name: service.name,
        role: settings.role,
        port: settings.port,
        common: &settings.common,
        migrations: service.migrations,
        routes: service.routes,
        subscriptions: service.subscriptions,
        own: std::sync::Arc::new(settings.service.clone()),
    };
    launch(spec, dbs, shutdown, |tasks, dbs| {
        (service.consume)(tasks, dbs, &settings)
    })
    .await
}

/// `--openapi` prints the document; otherwise the service's own pools,
/// and every part its role asks for until SIGTERM (or a part fails).
pub async fn run<X: Args + Clone + Send + Sync>(
    service: &'static Service<X>,
    settings: Settings<X>,
) -> Result<()> {
    if settings.common.openapi {
        let api = openapi(service.name, service.routes);
        println!("{}", serde_json::to_string_pretty(&api)?);
        return Ok(());
    }
    let role = settings
        .role
        .to_possible_value()
        .map_or_else(|| "all".to_owned(), |v| v.get_name().to_owned());
    let dbs = Databases::connect_lazy(
        &settings.database_url,
        &settings.common,
        &format!("{}-{role}", service.name),
    )?;
    let app = start(service, settings, dbs, reliability::shutdown::token()).await?;
    app.run_until_stopped().await
}

/// A service binary's whole `main`: logs, settings, [`run`].
pub async fn main<X: Args + Clone + Send + Sync>(service: &'static Service<X>) -> Result<()> {
    init_tracing();
    run(service, Settings::from_env(service)).await
}
