//! Database plumbing: the three roles, the reliability migrations, pools.
//!
//! Roles (docs/adr/0003): `commerce_owner` owns tables, runs migrations and
//! maintenance (BYPASSRLS: it archives every tenant's rows); `commerce_app` is
//! the services' runtime role, subject to row-level security; `commerce_relay`
//! reads and marks every tenant's outbox rows and has no other grant.

use std::time::Duration;

use sqlx::migrate::{Migration, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};

use crate::Result;

pub mod scram;

pub const OWNER_ROLE: &str = "commerce_owner";
pub const APP_ROLE: &str = "commerce_app";
pub const RELAY_ROLE: &str = "commerce_relay";
/// The log relay's replication connections (docs/adr/0038): REPLICATION,
/// and no privilege on any table; streaming a publication needs none.
pub const WAL_ROLE: &str = "commerce_wal";

/// The reliability tables, versions 1 to 999. A service's own migrations
/// start at 1000 so both live in one `_sqlx_migrations` history.
pub static RELIABILITY_MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/reliability");

/// The reliability migrations followed by a service's own.
pub fn migrator_with(service: &Migrator) -> Migrator {
    let mut all: Vec<Migration> = RELIABILITY_MIGRATIONS.iter().cloned().collect();
    all.extend(service.iter().cloned());
    all.sort_by_key(|m| m.version);
    Migrator::with_migrations(all)
}

/// Runs the reliability migrations and then `service`'s, as the owner role.
/// Without a service (`reliability setup`), versions a service applied
/// already are expected and left alone.
pub async fn migrate(owner_pool: &PgPool, service: Option<&Migrator>) -> Result<()> {
    match service {
        Some(m) => migrator_with(m).run(owner_pool).await?,
        None => {
            let mut reliability_only =
                Migrator::with_migrations(RELIABILITY_MIGRATIONS.iter().cloned().collect());
            reliability_only.set_ignore_missing(true);
            reliability_only.run(owner_pool).await?;
        }
    }
    Ok(())
}

/// Creates the roles if missing. Needs a superuser connection (roles
/// are cluster-wide). Safe to run concurrently and repeatedly.
pub async fn ensure_roles(superuser: &PgPool) -> Result<()> {
    let mut conn = superuser.acquire().await?;
    // Two processes creating the same role race on pg_authid's unique index.
    conn.execute("SELECT pg_advisory_lock(7310001)").await?;
    let result = conn
        .execute(
            "DO $$ BEGIN
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'commerce_owner') THEN
                 CREATE ROLE commerce_owner LOGIN BYPASSRLS CREATEDB;
               END IF;
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'commerce_app') THEN
                 CREATE ROLE commerce_app LOGIN NOBYPASSRLS;
               END IF;
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'commerce_relay') THEN
                 CREATE ROLE commerce_relay LOGIN NOBYPASSRLS;
               END IF;
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'commerce_wal') THEN
                 CREATE ROLE commerce_wal LOGIN REPLICATION NOBYPASSRLS;
               END IF;
             END $$",
        )
        .await;
    let bounded = match result {
        Ok(_) => bound_abandoned_work(&mut conn).await,
        Err(e) => Err(e.into()),
    };
    conn.execute("SELECT pg_advisory_unlock(7310001)").await?;
    bounded
}

/// Server-side bounds on work a process abandoned without ending it (I9,
/// docs/adr/0022), per role, so they hold whatever the client does: a
/// process frozen inside a transaction (SIGSTOP, a paused VM, a GC-like
/// stall) keeps its row and advisory locks only until the server ends its
/// session, and a host that vanished is found by TCP keepalives.
///
/// - `commerce_app` (HTTP, consumers, the payments worker) never waits on
///   the network inside a transaction: idle in one for 15 s is abandoned;
///   no statement of ours runs 30 s; a wait for a lock another session
///   holds (a row, an aggregate's advisory lock) gives up after 5 s with
///   55P03, which every caller retries at no cost: a worker behind a stuck
///   holder is freed to answer 503 or take other work instead of queueing.
/// - `commerce_relay` holds its claim across the publish and its confirms
///   (ADR 0001, bounded at 10 s each): 60 s for both. It claims with
///   `SKIP LOCKED` and should never wait for a lock; if it ever does, 10 s.
/// - `commerce_owner` (migrations, maintenance, the operator's commands):
///   idle 60 s; no statement or lock bound, a migration may take long and
///   `sqlx migrate` would not retry one that gave up.
/// - every role: keepalive probes after 30 s idle, every 10 s, 3 missed
///   and the server drops the connection (about 1 minute).
pub const ROLE_BOUNDS: &[(&str, &str, &str)] = &[
    (APP_ROLE, "idle_in_transaction_session_timeout", "15s"),
    (APP_ROLE, "statement_timeout", "30s"),
    (APP_ROLE, "lock_timeout", "5s"),
    (RELAY_ROLE, "idle_in_transaction_session_timeout", "60s"),
    (RELAY_ROLE, "statement_timeout", "60s"),
    (RELAY_ROLE, "lock_timeout", "10s"),
    (OWNER_ROLE, "idle_in_transaction_session_timeout", "60s"),
];
const KEEPALIVES: &[(&str, &str)] = &[
    ("tcp_keepalives_idle", "30"),
    ("tcp_keepalives_interval", "10"),
    ("tcp_keepalives_count", "3"),
];

async fn bound_abandoned_work(conn: &mut sqlx::PgConnection) -> Result<()> {
    let keepalives = [OWNER_ROLE, APP_ROLE, RELAY_ROLE]
        .into_iter()
        .flat_map(|role| KEEPALIVES.iter().map(move |(k, v)| (role, *k, *v)));
    for (role, setting, value) in ROLE_BOUNDS.iter().copied().chain(keepalives) {
        // Role, setting and value are the constants above, never input.
        conn.execute(sqlx::AssertSqlSafe(format!(
            "ALTER ROLE {role} SET {setting} = '{value}'"
        )))
        .await?;
    }
    Ok(())
}

/// Creates `database` owned by the owner role unless it exists.
pub async fn ensure_database(superuser: &PgPool, database: &str) -> Result<()> {
    if !database
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(crate::Error::Config(format!(
            "database name `{database}` must be [A-Za-z0-9_]"
        )));
    }
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)")
            .bind(database)
            .fetch_one(superuser)
            .await?;
    if !exists {
        // Checked above to be a plain identifier: nothing to inject.
        let sql = format!("CREATE DATABASE {database} OWNER {OWNER_ROLE}");
        match superuser.execute(sqlx::AssertSqlSafe(sql)).await {
            Ok(_) => {}
            // Lost a race with another creator: the database is there.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The stack's roles' password, where PostgreSQL asks for one (`make deps`
/// writes it to `.env`); unset or empty: none (trust or peer).
pub const ROLE_PASSWORD_ENV: &str = "DB_ROLE_PASSWORD";

pub fn role_password() -> Option<String> {
    std::env::var(ROLE_PASSWORD_ENV)
        .ok()
        .filter(|p| !p.is_empty())
}

/// The session setting, and its value, by which a relay says it numbers
/// each aggregate's events (docs/adr/0028): the outbox shows its rows to
/// no other relay (migration `0012_relays_that_number.sql`), so a relay of
/// an older release left running in a rolling upgrade claims nothing.
pub const RELAY_NUMBERS: (&str, &str) = ("reliability.relay", "numbers");

/// `options` with [`RELAY_NUMBERS`]: for a relay's own URL
/// (`RELAY_DATABASE_URL`) as for the one made from the service's.
pub fn numbering_relay(options: PgConnectOptions) -> PgConnectOptions {
    options.options([RELAY_NUMBERS])
}

/// Connection options for `role` on `base`'s server and database, with
/// `DB_ROLE_PASSWORD` when set (never `base`'s password: that is another
/// role's). The relay role's sessions carry [`RELAY_NUMBERS`] from their
/// start, so it costs no statement.
pub fn options_for_role(base: &PgConnectOptions, role: &str) -> PgConnectOptions {
    use_one_crypto_provider();
    let mut options = base.clone().username(role);
    if role == RELAY_ROLE {
        options = numbering_relay(options);
    }
    match role_password() {
        Some(password) => options.password(&password),
        None => options,
    }
}

/// Gives the roles `DB_ROLE_PASSWORD`, when it is set.
pub async fn set_role_passwords(superuser: &PgPool) -> Result<bool> {
    let Some(password) = role_password() else {
        return Ok(false);
    };
    for role in [OWNER_ROLE, APP_ROLE, RELAY_ROLE, WAL_ROLE] {
        set_role_password(superuser, role, &password).await?;
    }
    Ok(true)
}

/// Sets `role`'s password as a SCRAM verifier computed here: the server
/// never sees the password, so its log cannot hold it.
pub async fn set_role_password(superuser: &PgPool, role: &str, password: &str) -> Result<()> {
    let sql = alter_role_password(superuser, role, &scram::new_verifier(password)).await?;
    superuser.execute(sqlx::AssertSqlSafe(sql)).await?;
    Ok(())
}

/// The `ALTER ROLE` statement that gives `role` the verifier `secret`.
/// ALTER ROLE takes no bind parameters: quoted server-side.
pub async fn alter_role_password(superuser: &PgPool, role: &str, secret: &str) -> Result<String> {
    Ok(
        sqlx::query_scalar("SELECT format('ALTER ROLE %I PASSWORD %L', $1::text, $2::text)")
            .bind(role)
            .bind(secret)
            .fetch_one(superuser)
            .await?,
    )
}

/// Makes aws-lc-rs the process's TLS crypto provider, once, before any
/// TLS client is built: rustls picks one by itself only when exactly one is
/// compiled in, and panics at the first handshake otherwise. A build that
/// links a second one (the graph's Neo4j driver brings ring, and Cargo
/// unifies the features of one build) would fail every TLS connection to
/// PostgreSQL. Every connecting function of the library calls it first.
pub fn use_one_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An error means one is installed already, which is all we need.
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    });
}

/// How long a connection given back with work unfinished (a transaction
/// dropped without its commit, a statement abandoned half way) may take to
/// answer before it is closed instead of pooled (docs/adr/0022, amended).
pub const RELEASE_BOUND: Duration = Duration::from_secs(5);

/// The options every pool of ours starts from: a connection given back with
/// work unfinished must answer within [`RELEASE_BOUND`] or is closed.
///
/// Why: sqlx tests each connection it is given back with a ping that has
/// no bound of its own, and sets no read timeout or keepalive on the
/// socket. A connection dropped mid-statement because its host lost the
/// link (the apply's bound gave up on it) waited in that ping until TCP's
/// retransmission gave up or got through, minutes, holding a pool slot.
/// A connection given back clean (a commit, a plain query) has nothing
/// queued and costs nothing here.
pub fn pool_options() -> PgPoolOptions {
    use sqlx::Connection;
    PgPoolOptions::new().after_release(|conn, _| {
        Box::pin(async move {
            // Nothing queued: released after its commit or its answer.
            if !conn.should_flush() {
                return Ok(true);
            }
            match tokio::time::timeout(RELEASE_BOUND, conn.ping()).await {
                Ok(Ok(())) => Ok(true),
                Ok(Err(e)) => Err(e),
                // An error closes it without a goodbye, which could wait too.
                Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("given back unfinished, no answer within {RELEASE_BOUND:?}: closed"),
                ))),
            }
        })
    })
}

/// A pool with the settings every service uses.
pub async fn pool(options: PgConnectOptions, max_connections: u32) -> Result<PgPool> {
    use_one_crypto_provider();
    Ok(pool_options()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await?)
}

/// A value out of its column's range (SQLSTATE 22003, e.g. a `bigint`
/// sum that would overflow): the input's fault, so a 422, not a 500.
pub fn is_out_of_range(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db) if db.code().as_deref() == Some("22003"))
}

/// Why `pool` gets no connection, in an operator's words. The pool's own
/// error says only that it waited (`PoolTimedOut`), so a connection of
/// our own, outside the pool, asks the server, whose refusal names the
/// cause: no connection slots left (53300, the server's or the database's
/// or the role's limit), starting or in recovery, our credentials refused.
pub async fn why_no_connection(pool: &PgPool) -> String {
    use sqlx::Connection;
    let options = pool.connect_options();
    let bound = Duration::from_secs(2);
    match tokio::time::timeout(bound, sqlx::PgConnection::connect_with(&options)).await {
        Err(_) => format!("the server does not answer a new connection within {bound:?}"),
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            format!(
                "the server takes new connections, but this process's pool has none free ({} of {} open)",
                pool.size(),
                pool.options().get_max_connections()
            )
        }
        Ok(Err(sqlx::Error::Database(e))) => {
            let code = e.code().unwrap_or_default();
            let cause = match &*code {
                "53300" => "the server has no connection slots left",
                c if c.starts_with("57P") => "the server is shutting down, starting or in recovery",
                c if c.starts_with("28") => "the server refused our credentials",
                _ => "the server refused a new connection",
            };
            format!("{cause} ({code}: {})", e.message())
        }
        Ok(Err(e)) => format!("cannot connect to the server: {e}"),
    }
}

/// The database is unreachable, restarting or out of resources: a
/// dependency down, not the fault of the request or the message. HTTP
/// answers 503 with `Retry-After`; a consumer waits and retries.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        // A connection cut mid-handshake (e.g. the answer to TLS negotiation
        // never comes) surfaces as a protocol error.
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // 08: connection exception; 57P01-03: shutdown, crash, cannot
            // connect now (starting or in recovery); 53: insufficient
            // resources (disk full, out of memory, too many connections);
            // 28: the server refused our own credentials (a password
            // rotated on one side only, a role not created yet): our
            // configuration, never the message's fault, so no event may
            // be dead-lettered for it.
            code.starts_with("08")
                || code.starts_with("28")
                || code.starts_with("53")
                || matches!(&*code, "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Worth trying again at no cost to a message's attempts: the database
/// unavailable, or a conflict the server settled by ending one side, which
/// says nothing about the message (I9): a serialization failure (40001), a
/// deadlock (40P01), a lock wait past `lock_timeout` (55P03), a session
/// ended for idling (25P03 in a transaction, 57P05 outside one: a frozen
/// process woken up), the database being dropped under it (57P04), or a
/// statement sent into a transaction an earlier failure aborted (25P02):
/// the connection's state, never the message's. No connection of ours goes
/// back to a pool in an aborted transaction (`TenantTx::begin_locked`), so
/// 25P02 means a bug of that kind, and a message must not pay for it.
pub fn is_retryable_at_no_cost(e: &sqlx::Error) -> bool {
    is_unavailable(e)
        || matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|code| {
            code.starts_with("57P") || matches!(&*code, "40001" | "40P01" | "55P03" | "25P03" | "25P02")
        }))
}
