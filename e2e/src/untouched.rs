//! Proof that `make e2e` left the developer's own PostgreSQL and RabbitMQ
//! alone: a connection to each held open for the whole run (a restart
//! would have cut it), PostgreSQL's start time, and every setting it reads
//! from its files, `postgresql.auto.conf` (ALTER SYSTEM) included, the
//! same at the end as at the start.

use std::str::FromStr;

use lapin::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection as _};

pub struct Untouched {
    pg: Option<(PgConnection, Snapshot)>,
    broker: Option<Connection>,
    /// Why a server could not be watched (not running here).
    pub unwatched: Vec<String>,
}

#[derive(PartialEq, Debug)]
struct Snapshot {
    started: String,
    backend: i32,
    settings: String,
}

const SNAPSHOT: &str = "SELECT pg_postmaster_start_time()::text, pg_backend_pid(), \
     coalesce((SELECT md5(string_agg(sourcefile || ':' || name || '=' || coalesce(setting, ''), ',' \
     ORDER BY sourcefile, seqno)) FROM pg_file_settings), '') || ' max_connections=' \
     || current_setting('max_connections')";

async fn snapshot(conn: &mut PgConnection) -> anyhow::Result<Snapshot> {
    let (started, backend, settings): (String, i32, String) =
        sqlx::query_as(SNAPSHOT).fetch_one(conn).await?;
    Ok(Snapshot {
        started,
        backend,
        settings,
    })
}

impl Untouched {
    /// Starts watching the servers at these URLs (the developer's, read
    /// before the world's replace them in the environment).
    pub async fn watch(database_url: &str, amqp_url: &str) -> Untouched {
        let mut unwatched = Vec::new();
        let pg = async {
            let mut conn = PgConnectOptions::from_str(database_url)?
                .application_name("e2e-untouched")
                .connect()
                .await?;
            let snap = snapshot(&mut conn).await?;
            anyhow::Ok((conn, snap))
        }
        .await
        .map_err(|e| unwatched.push(format!("PostgreSQL at {database_url}: {e:#}")))
        .ok();
        let broker = reliability::broker::connect(amqp_url, "e2e-untouched")
            .await
            .map_err(|e| unwatched.push(format!("RabbitMQ: {e}")))
            .ok();
        Untouched {
            pg,
            broker,
            unwatched,
        }
    }

    /// What changed on the watched servers; empty if nothing did.
    pub async fn verify(self) -> Vec<String> {
        let mut changed = Vec::new();
        if let Some((mut conn, before)) = self.pg {
            match snapshot(&mut conn).await {
                Ok(after) if after == before => {}
                Ok(after) => changed.push(format!(
                    "the developer's PostgreSQL changed: {before:?} -> {after:?}"
                )),
                Err(e) => changed.push(format!(
                    "the developer's PostgreSQL dropped a connection held since the start (restarted?): {e}"
                )),
            }
            let _ = conn.close().await;
        }
        if let Some(conn) = self.broker {
            let alive = async {
                let channel = reliability::broker::bounded(conn.create_channel()).await?;
                reliability::broker::bounded(channel.close(200, "checked".into())).await
            };
            if let Err(e) = alive.await {
                changed.push(format!(
                    "the developer's RabbitMQ dropped a connection held since the start (restarted?): {e}"
                ));
            }
            let _ = reliability::broker::bounded(conn.close(200, "checked".into())).await;
        }
        changed
    }
}
