//! PgBouncer in transaction mode in front of the world's PostgreSQL
//! (`make e2e-pgbouncer`, docs/adr/0026): the services' runtime role
//! connects through it (`DB_POOLER`), the relay and owner roles direct.
//!
//! The binary comes from `E2E_PGBOUNCER` (`scripts/pgbouncer.sh` finds or
//! builds one: 1.21 or later, for `max_prepared_statements`). It is copied
//! into the world, since as root it runs as the `postgres` user (PgBouncer
//! refuses root), who may not reach the checkout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::command::check;

/// Server connections per database and role: what every client of the
/// runtime role in every process shares. A frozen client's transaction
/// holds one until PostgreSQL's idle-in-transaction bound (15 s) ends it.
pub const SERVER_POOL: u32 = 16;
/// Seconds a client may wait for a server connection before PgBouncer
/// answers with an error (the pool is full of slow or frozen holders):
/// the same as the idle-in-transaction bound that frees them.
pub const QUERY_WAIT_SECS: u32 = 15;

pub struct Pooler {
    /// The binary as given.
    source: PathBuf,
    dir: PathBuf,
    pub port: u16,
    listen: String,
    pg_port: u16,
    run_as: Option<&'static str>,
}

impl Pooler {
    /// The pooler of the world, if `E2E_PGBOUNCER` names a binary.
    pub fn from_env(
        root: &Path,
        port: u16,
        listen: String,
        pg_port: u16,
        run_as: Option<&'static str>,
    ) -> Option<Self> {
        let source = std::env::var_os("E2E_PGBOUNCER").filter(|s| !s.is_empty())?;
        Some(Self {
            source: source.into(),
            dir: root.join("pgbouncer"),
            port,
            listen,
            pg_port,
            run_as,
        })
    }

    fn binary(&self) -> PathBuf {
        self.dir.join("pgbouncer")
    }

    /// Writes its configuration and starts it, daemonized.
    pub fn create(&self) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        std::fs::copy(&self.source, self.binary())
            .map_err(|e| anyhow::anyhow!("copy {}: {e}", self.source.display()))?;
        // Trust, as the world's PostgreSQL: the names must still be listed.
        std::fs::write(
            self.dir.join("users.txt"),
            [
                "postgres",
                "commerce_app",
                "commerce_relay",
                "commerce_owner",
            ]
            .map(|u| format!("\"{u}\" \"\"\n"))
            .concat(),
        )?;
        let dir = self.dir.display();
        std::fs::write(
            self.dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n\
                 * = host=127.0.0.1 port={pg}\n\
                 [pgbouncer]\n\
                 listen_addr = {listen}\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {dir}/users.txt\n\
                 admin_users = postgres\n\
                 pool_mode = transaction\n\
                 ; sqlx names every statement it prepares: PgBouncer keeps\n\
                 ; them per client and prepares them on whichever server\n\
                 ; connection the client's transaction gets.\n\
                 max_prepared_statements = 200\n\
                 ; sqlx sends it at start-up; PgBouncer would refuse it.\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 max_client_conn = 2000\n\
                 default_pool_size = {pool}\n\
                 query_wait_timeout = {wait}\n\
                 ; ADR 0022's keepalives: behind the pooler, PostgreSQL's own\n\
                 ; watch the pooler, so the pooler watches the clients.\n\
                 tcp_keepalive = 1\n\
                 tcp_keepidle = 30\n\
                 tcp_keepintvl = 10\n\
                 tcp_keepcnt = 3\n\
                 logfile = {dir}/pgbouncer.log\n\
                 pidfile = {dir}/pgbouncer.pid\n",
                pg = self.pg_port,
                listen = self.listen,
                port = self.port,
                pool = SERVER_POOL,
                wait = QUERY_WAIT_SECS,
            ),
        )?;
        if let Some(user) = self.run_as {
            check(
                Command::new("chown")
                    .args(["-R", user, &self.dir.display().to_string()])
                    .output(),
                "chown the world's PgBouncer directory",
            )?;
        }
        let mut cmd = match self.run_as {
            Some(user) => {
                let mut cmd = Command::new("runuser");
                cmd.args(["-u", user, "--"]).arg(self.binary());
                cmd
            }
            None => Command::new(self.binary()),
        };
        check(
            cmd.arg("-d").arg(self.dir.join("pgbouncer.ini")).output(),
            "start PgBouncer",
        )?;
        Ok(())
    }

    /// `SHOW <what>` on PgBouncer's admin console: a row per line, each a
    /// column name to value map.
    pub fn show(&self, what: &str) -> anyhow::Result<Vec<HashMap<String, String>>> {
        let out = check(
            Command::new("psql")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args([
                    "-U",
                    "postgres",
                    "-d",
                    "pgbouncer",
                    "-A",
                    "-P",
                    "footer=off",
                    "-c",
                ])
                .arg(format!("SHOW {what}"))
                .output(),
            &format!("PgBouncer: SHOW {what}"),
        )?;
        let mut lines = out.lines();
        let header: Vec<&str> = lines.next().unwrap_or_default().split('|').collect();
        Ok(lines
            .map(|l| {
                header
                    .iter()
                    .zip(l.split('|'))
                    .map(|(k, v)| ((*k).to_owned(), v.to_owned()))
                    .collect()
            })
            .collect())
    }

    pub fn stop(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill").args(["-KILL", pid.trim()]).output();
        }
    }

    pub fn log(&self) -> PathBuf {
        self.dir.join("pgbouncer.log")
    }
}
