//! `reliability`: the operator's tool over every service database and the
//! broker. `status`, `explain` and `console` look across all of them; `outbox`,
//! `queue`, `offsets`, `park`, `idempotency` and `maintenance` act on one. Database
//! URLs come from the environment the services read (`<SERVICE>_DATABASE_URL`),
//! so with `make up` none is needed. Every command that changes something
//! takes `--dry-run` and asks first (or `--yes`).

mod console_args;
mod estate;
mod outbox;
mod park;
mod queue;
mod render;
mod target;

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use operator::ops;
use reliability::{TenantId, broker, db};
use service_kit::auth::JwtKeys;
use sqlx::postgres::PgConnectOptions;

use estate::{Admission, Estate};
use target::{Broker, DEFAULT_AMQP_URL, Db};

#[derive(Parser)]
#[command(version, about, propagate_version = true)]
struct Cli {
    /// Print JSON (one object per line) instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the roles, then each database with the reliability tables; and
    /// declare every subscriber queue of the topology, so that events wait
    /// for a consumer that has never run.
    Setup {
        /// A superuser connection (creates roles and databases).
        #[arg(
            long,
            env = "ADMIN_DATABASE_URL",
            default_value = "postgres://postgres@127.0.0.1:5432/postgres"
        )]
        admin_url: String,
        /// The broker whose topology to declare.
        #[arg(
            long,
            env = "AMQP_URL",
            default_value = DEFAULT_AMQP_URL
        )]
        amqp_url: String,
        /// The events exchange.
        #[arg(long, env = "EVENTS_EXCHANGE", default_value = contracts::EXCHANGE)]
        exchange: String,
        /// Prefix of every queue name, as the services are given it.
        #[arg(long, env = "QUEUE_PREFIX", default_value = "")]
        queue_prefix: String,
        /// Databases to create and migrate, e.g. orders inventory.
        databases: Vec<String>,
    },
    /// One screen across every service and the broker: outbox pending,
    /// oldest and DLQ per service; ready, unacked, DLQ and last apply per
    /// consumer queue; each maintenance step's last run; and what is stuck.
    Status {
        #[command(flatten)]
        estate: Estate,
        #[command(flatten)]
        admission: Admission,
        /// Exit 1 when anything needs an operator (the problems listed),
        /// for cron and probes; without it, status always exits 0.
        #[arg(long)]
        check: bool,
    },
    /// The operator's web page: what is stuck, where and since when, an
    /// order's story, and the buttons that fix it (docs/console.md).
    Console {
        #[command(flatten)]
        estate: Estate,
        #[command(flatten)]
        admission: Admission,
        #[command(flatten)]
        console: console_args::Settings,
    },
    /// Where something is in the system, and where it is stuck.
    Explain {
        #[command(subcommand)]
        what: Explain,
    },
    /// One service's outbox and its DLQ table.
    Outbox {
        #[command(flatten)]
        db: Db,
        #[command(subcommand)]
        command: outbox::OutboxCommand,
    },
    /// A consumer queue's dead letters; deleting queues.
    Queue {
        #[command(flatten)]
        broker: Broker,
        #[command(subcommand)]
        command: queue::QueueCommand,
    },
    /// Consumer progress per source and tenant, in one service's database.
    Offsets {
        #[command(flatten)]
        db: Db,
        #[command(subcommand)]
        command: outbox::OffsetsCommand,
    },
    /// An ordered subscription's parked aggregates, in one service's
    /// database: list, unpark (replay in order, then resume), skip.
    Park {
        #[command(flatten)]
        db: Db,
        #[command(subcommand)]
        command: park::ParkCommand,
    },
    /// Idempotency-Keys stored in one service's database.
    Idempotency {
        #[command(flatten)]
        db: Db,
        #[command(subcommand)]
        command: outbox::IdempotencyCommand,
    },
    /// Archival, partitions and clean-up of one service's database.
    Maintenance {
        #[command(flatten)]
        db: Db,
        #[command(subcommand)]
        command: outbox::MaintenanceCommand,
    },
    /// Print a development token for a tenant.
    Token {
        /// The HS256 secret the services verify with.
        #[arg(
            long,
            env = "JWT_SECRET",
            default_value = "dev-secret-change-me",
            hide_env_values = true
        )]
        secret: String,
        /// The tenant the token is for.
        #[arg(long)]
        tenant: i64,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 86400)]
        ttl_secs: u64,
    },
    /// Every metric the reliability library exports, with its labels and
    /// HELP text (payments adds `psp_calls_in_flight` and `psp_call_duration_seconds`).
    Metrics,
    /// Shell completions, e.g. `reliability completions bash > ~/.local/share/bash-completion/completions/reliability`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand)]
enum Explain {
    /// An order's rows in every service, each event that names it, and for
    /// each event whether every subscriber applied it.
    Order {
        /// The order id, as the API returns it.
        id: i64,
        /// The tenant that owns it.
        #[arg(long)]
        tenant: i64,
        /// The payment provider, asked for its record of each payment and
        /// refund by key.
        #[arg(long, env = "PSP_URL", default_value = "http://127.0.0.1:8090")]
        psp_url: String,
        #[command(flatten)]
        estate: Estate,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // A passive declare of a missing queue is an answer here, not an
        // error worth lapin's log line.
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,lapin=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let matches = service_kit::service::env_conventions(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let json = cli.json;
    match cli.command {
        Command::Setup {
            admin_url,
            amqp_url,
            exchange,
            queue_prefix,
            databases,
        } => {
            let admin_opts = PgConnectOptions::from_str(&admin_url).context("parse admin URL")?;
            let admin = db::pool(admin_opts.clone(), 1)
                .await
                .context("connect as superuser")?;
            db::ensure_roles(&admin).await.context("create roles")?;
            if db::set_role_passwords(&admin)
                .await
                .context("set the roles' password")?
            {
                println!("roles: password from {} set", db::ROLE_PASSWORD_ENV);
            }
            for name in databases {
                db::ensure_database(&admin, &name)
                    .await
                    .with_context(|| format!("create database {name}"))?;
                let owner = db::pool(
                    db::options_for_role(&admin_opts.clone().database(&name), db::OWNER_ROLE),
                    1,
                )
                .await?;
                db::migrate(&owner, None)
                    .await
                    .with_context(|| format!("migrate {name}"))?;
                println!("database {name}: ready");
            }
            let queues: Vec<broker::QueueSpec> = contracts::topology::ALL
                .iter()
                .map(|sub| broker::QueueSpec::for_subscription(sub, &exchange, &queue_prefix))
                .collect();
            let conn = broker::connect(&amqp_url, "reliability-setup")
                .await
                .context("connect to the broker")?;
            let channel = broker::bounded(conn.create_channel()).await?;
            broker::bounded(broker::declare_topology(&channel, &queues))
                .await
                .context("declare the subscriber queues")?;
            let _ = conn.close(200, "setup done".into()).await;
            for q in &queues {
                println!("queue {}: bound to {}", q.queue, q.bindings.join(", "));
            }
        }
        Command::Status {
            estate,
            admission,
            check,
        } => {
            let limits = admission.limits()?;
            let estate = estate.open().await?;
            let mut status = ops::status::status(&estate).await;
            ops::status::admission(&estate, ops::commerce::WORK_IN_FLIGHT, &limits, &mut status)
                .await;
            render::status(json, &status)?;
            if check && !status.problems.is_empty() {
                eprintln!("{} problem(s)", status.problems.len());
                std::process::exit(1);
            }
        }
        Command::Explain {
            what:
                Explain::Order {
                    id,
                    tenant,
                    psp_url,
                    estate,
                },
        } => {
            let estate = estate.open().await?;
            let mut explanation = ops::explain::explain(
                &estate,
                TenantId::new(tenant)?,
                "order_id",
                id,
                ops::commerce::ORDER_TABLES,
            )
            .await?;
            ops::explain::related_rows(&estate, ops::commerce::ORDER_RELATED, &mut explanation)
                .await?;
            ops::explain::provider_view(
                &estate,
                &psp_url,
                ops::commerce::ORDER_PROVIDER_ITEMS,
                &mut explanation,
            )
            .await?;
            render::explanation(json, &explanation)?;
        }
        Command::Console {
            estate,
            admission,
            console,
        } => {
            console
                .serve(estate.open().await?, admission.limits()?)
                .await?
        }
        Command::Outbox { db, command } => outbox::outbox(&db.pool().await?, command, json).await?,
        Command::Offsets { db, command } => {
            outbox::offsets(&db.pool().await?, command, json).await?
        }
        Command::Park { db, command } => park::run(&db.pool().await?, command, json).await?,
        Command::Idempotency { db, command } => {
            outbox::idempotency(&db.pool().await?, command, json).await?;
        }
        Command::Maintenance { db, command } => {
            outbox::maintenance(&db.pool().await?, command, json).await?;
        }
        Command::Queue { broker, command } => {
            queue::run(&broker.connect().await?, command, json).await?
        }
        Command::Token {
            secret,
            tenant,
            ttl_secs,
        } => {
            let tenant = TenantId::new(tenant)?;
            println!(
                "{}",
                JwtKeys::from_secret(secret.as_bytes()).mint(tenant, Duration::from_secs(ttl_secs))
            );
        }
        Command::Metrics => {
            let rows: Vec<serde_json::Value> = reliability::metrics::CATALOGUE
                .iter()
                .chain(service_kit::metrics::CATALOGUE)
                .map(|m| {
                    serde_json::json!({"name": m.name, "kind": format!("{:?}", m.kind).to_lowercase(),
                                       "labels": m.labels.join(","), "help": m.help})
                })
                .collect();
            render::print(json, &rows)?;
        }
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "reliability",
                &mut std::io::stdout(),
            );
        }
    }
    Ok(())
}
