//! A world of its own for `make e2e` (docs/adr/0023): a PostgreSQL cluster
//! made with the installed server's own tools and a three-node RabbitMQ
//! cluster (own node names, ports, data directories, Erlang cookie and
//! epmd), all on spare ports under a scratch directory that is removed
//! afterwards. Scenarios restart, kill and freeze these; the developer's
//! servers are never stopped, restarted or reconfigured.
//!
//! As root (CI), PostgreSQL runs as the `postgres` user, since `initdb`
//! refuses root; elsewhere everything runs as the invoking user.

mod postgres;
mod rabbit;

pub use rabbit::Node;

use crate::command::{blocking, check, is_root, port_free};
use crate::hosts::{Host, Link};
use crate::pooler::Pooler;
use postgres::{Postgres, pg_bindir};
use rabbit::rabbit_bindir;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// First port of the world (`E2E_WORLD_PORT`): broker nodes at +1..=3
/// (their Erlang distribution at +11..=13), PostgreSQL at +32, PgBouncer
/// at +33, epmd at +69.
pub const DEFAULT_PORT_BASE: u16 = 25400;
/// How long a broker node may take to boot, or the cluster to form.
const BOOT: Duration = Duration::from_secs(120);
const NODES: u16 = 3;

pub struct World {
    root: PathBuf,
    pg: Postgres,
    nodes: Vec<Node>,
    rabbit_bin: PathBuf,
    epmd_port: u16,
    /// The graph service's FalkorDB.
    falkordb_port: u16,
    /// Where the logs are copied when the world is removed.
    keep_logs: PathBuf,
    /// A separate host, where network namespaces can be made.
    host: Option<Host>,
    /// PgBouncer in front of PostgreSQL, in the `e2e-pgbouncer` profile.
    pooler: Option<Pooler>,
}

impl World {
    /// The world of this run (`E2E_WORLD_PORT`): where it lives, whether or
    /// not it has been made yet. `make e2e`'s runner, a child process,
    /// describes the world its parent made.
    pub fn describe(keep_logs: PathBuf) -> anyhow::Result<World> {
        let base = match std::env::var("E2E_WORLD_PORT") {
            Ok(p) => p.parse()?,
            Err(_) => DEFAULT_PORT_BASE,
        };
        // /tmp, not the checkout: the postgres user must reach it.
        let root = std::env::temp_dir().join(format!("commerce-e2e-world-{base}"));
        let rabbit_bin = rabbit_bindir()?;
        let run_as = is_root().then_some("postgres");
        let nodes = (1..=NODES)
            .map(|i| Node {
                name: format!("commerce-e2e-{i}@localhost"),
                amqp_port: base + i,
                dist_port: base + 10 + i,
                dir: root.join(format!("rabbit-{i}")),
            })
            .collect();
        let host = Host::unavailable().is_none().then(|| Host::new(base));
        // The host reaches PostgreSQL over its own link.
        let listen = match host {
            Some(_) => format!("127.0.0.1,{}", Host::server_addr(Link::Postgres)),
            None => "127.0.0.1".to_owned(),
        };
        let pooler = Pooler::from_env(&root, base + 33, listen.clone(), base + 32, run_as);
        let pg = Postgres {
            bin: pg_bindir()?,
            data: root.join("pg/data"),
            port: base + 32,
            // fsync off: the scenarios crash processes, not the kernel, so
            // what PostgreSQL wrote survives in the page cache either way.
            // wal_level=logical: the log relay's slots (E2E_RELAY_MODE=log).
            options: format!(
                "-c port={} -c listen_addresses={listen} -c unix_socket_directories={} \
                 -c max_connections=300 -c fsync=off -c shared_buffers=128MB \
                 -c wal_level=logical -c max_slot_wal_keep_size=1GB",
                base + 32,
                root.join("pg").display()
            ),
            run_as,
        };
        Ok(World {
            root,
            pg,
            nodes,
            rabbit_bin,
            epmd_port: base + 69,
            falkordb_port: base + 34,
            keep_logs,
            host,
            pooler,
        })
    }

    /// Makes the world (about 30-60 s, mostly the broker nodes booting).
    /// A world left by an interrupted run is removed first.
    pub fn create(&self) -> anyhow::Result<()> {
        let world = self;
        world.remove();
        let base = world.nodes[0].amqp_port - 1;
        let ports: Vec<u16> = world
            .nodes
            .iter()
            .flat_map(|n| [n.amqp_port, n.dist_port])
            .chain([world.pg.port, world.epmd_port, world.falkordb_port])
            .chain(world.pooler.as_ref().map(|p| p.port))
            .collect();
        // What a removed world held is let go within moments.
        let deadline = Instant::now() + Duration::from_secs(10);
        while ports.iter().any(|p| !port_free(*p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        if let Some(taken) = ports.iter().find(|p| !port_free(**p)) {
            anyhow::bail!(
                "port {taken} is taken: E2E_WORLD_PORT (now {base}) picks another range for the e2e world"
            );
        }
        std::fs::create_dir_all(world.root.join("pg"))?;
        if let Some(host) = &world.host {
            host.create()?;
        }
        world.create_postgres()?;
        if let Some(pooler) = &world.pooler {
            pooler.create()?;
        }
        world.falkordb("start")?;
        world.create_rabbit()
    }

    /// The graph's FalkorDB (scripts/falkordb.sh), its data in the world.
    fn falkordb(&self, action: &str) -> anyhow::Result<String> {
        check(
            Command::new("bash")
                .args(["scripts/falkordb.sh", action])
                .env("FALKORDB_PORT", self.falkordb_port.to_string())
                .env("FALKORDB_DIR", self.root.join("falkordb"))
                .output(),
            &format!("scripts/falkordb.sh {action}"),
        )
    }

    /// `kill -9` of the world's FalkorDB.
    pub fn kill_falkordb(&self) -> anyhow::Result<()> {
        let pid = std::fs::read_to_string(self.root.join("falkordb/falkordb.pid"))?;
        check(
            Command::new("kill").args(["-KILL", pid.trim()]).output(),
            "kill -9 FalkorDB",
        )?;
        Ok(())
    }

    /// Starts the world's FalkorDB again, on its data (its append-only log).
    pub async fn start_falkordb(&'static self) -> anyhow::Result<()> {
        blocking(move || self.falkordb("start").map(|_| ())).await
    }

    /// The FalkorDB log's warnings and errors (Redis marks them `#`), the
    /// last few, for a scenario the graph failed: whether the store
    /// refused a replayed command, or a rewrite failed, is in them.
    pub fn falkordb_warnings(&self) -> String {
        const KEPT: usize = 6;
        let log =
            std::fs::read_to_string(self.root.join("falkordb/falkordb.log")).unwrap_or_default();
        let warned: Vec<&str> = log
            .lines()
            // Less the known: the overcommit advice, and each process's
            // schema declaration replayed from the log and refused again.
            .filter(|l| {
                l.contains(" # ") && !l.contains("overcommit") && !l.contains("already exists")
            })
            .collect();
        let starts = log
            .lines()
            .filter(|l| l.contains("Server initialized"))
            .count();
        format!(
            "{} starts, {} warnings; the last: {}",
            starts,
            warned.len(),
            warned[warned.len().saturating_sub(KEPT)..].join(" | ")
        )
    }

    /// The world's FalkorDB, for the graph service (`GRAPH_URL`).
    pub fn graph_url(&self) -> String {
        format!("falkor://127.0.0.1:{}", self.falkordb_port)
    }

    /// A superuser URL of the world's PostgreSQL.
    pub fn database_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.pg.port)
    }

    /// PgBouncer's `host:port` (`DB_POOLER`), in the `e2e-pgbouncer` profile.
    pub fn pooler(&self) -> Option<&Pooler> {
        self.pooler.as_ref()
    }

    /// Every node, comma-separated, as `broker::connect` takes them.
    pub fn amqp_url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", n.amqp_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The separate host, if this machine can make one; else why not.
    pub fn host(&self) -> Result<&Host, String> {
        match &self.host {
            Some(host) if host.exists() => Ok(host),
            Some(_) => Err("the world's host was not made".into()),
            None => Err(Host::unavailable().unwrap_or_default()),
        }
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Stops everything the world started and removes its directory,
    /// keeping the logs. Also what `create` does with a world an
    /// interrupted run left.
    pub fn remove(&self) {
        if let Some(host) = &self.host {
            host.remove();
        }
        for node in &self.nodes {
            if let Some(pid) = self.node_pid(node) {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .output();
            }
        }
        if let Some(pooler) = &self.pooler {
            pooler.stop();
            let _ = std::fs::create_dir_all(&self.keep_logs);
            let _ = std::fs::copy(pooler.log(), self.keep_logs.join("pgbouncer.log"));
        }
        if self.pg.data.join("postmaster.pid").exists() {
            let _ = self.pg_stop_immediate();
        }
        let _ = self.falkordb("stop");
        let _ = std::fs::copy(
            self.root.join("falkordb/falkordb.log"),
            self.keep_logs.join("falkordb.log"),
        );
        if let Ok(pid) = std::fs::read_to_string(self.root.join("epmd.pid")) {
            let _ = Command::new("kill").args(["-KILL", pid.trim()]).output();
        }
        // One an Erlang tool started by itself (rabbitmqctl does, if ours
        // was gone): it obeys once no node is registered with it.
        let _ = Command::new("epmd")
            .args(["-port", &self.epmd_port.to_string(), "-kill"])
            .output();
        let _ = std::fs::create_dir_all(&self.keep_logs);
        let _ = std::fs::copy(
            self.root.join("pg/postgresql.log"),
            self.keep_logs.join("postgresql.log"),
        );
        for (i, node) in self.nodes.iter().enumerate() {
            let _ = std::fs::copy(
                node.dir.join("console.log"),
                self.keep_logs.join(format!("rabbit-{}-console.log", i + 1)),
            );
            let logs = node.dir.join("log");
            for entry in std::fs::read_dir(&logs).into_iter().flatten().flatten() {
                let _ = std::fs::copy(
                    entry.path(),
                    self.keep_logs.join(format!(
                        "rabbit-{}-{}",
                        i + 1,
                        entry.file_name().to_string_lossy()
                    )),
                );
            }
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
