//! A world of its own for `make e2e` (docs/adr/0023): a PostgreSQL cluster
//! made with the installed server's own tools and a three-node RabbitMQ
//! cluster (own node names, ports, data directories, Erlang cookie and
//! epmd), all on spare ports under a scratch directory that is removed
//! afterwards. Scenarios restart, kill and freeze these; the developer's
//! servers are never stopped, restarted or reconfigured.
//!
//! As root (CI), PostgreSQL runs as the `postgres` user, since `initdb`
//! refuses root; elsewhere everything runs as the invoking user.

use crate::hosts::{Host, Link};
use crate::pooler::Pooler;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
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

struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    options: String,
    run_as: Option<&'static str>,
}

pub struct Node {
    pub name: String,
    pub amqp_port: u16,
    dist_port: u16,
    dir: PathBuf,
}

pub(crate) fn is_root() -> bool {
    // The euid, without a libc dependency: /proc/self is owned by it.
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

/// The installed PostgreSQL's server binaries: `PG_BINDIR`, Debian's
/// `/usr/lib/postgresql/<newest>/bin`, or `initdb` on the PATH.
fn pg_bindir() -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BINDIR") {
        return Ok(dir.into());
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    which_dir("initdb").ok_or_else(|| {
        anyhow::anyhow!("no PostgreSQL server tools (initdb): install postgresql, or set PG_BINDIR")
    })
}

/// RabbitMQ's own scripts (Debian's `/usr/lib/rabbitmq/bin`, which do not
/// switch user as the `/usr/sbin` wrappers do), `RABBITMQ_BINDIR`, or the PATH.
fn rabbit_bindir() -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("RABBITMQ_BINDIR") {
        return Ok(dir.into());
    }
    let debian = Path::new("/usr/lib/rabbitmq/bin");
    if debian.join("rabbitmq-server").exists() {
        return Ok(debian.into());
    }
    which_dir("rabbitmq-server").ok_or_else(|| {
        anyhow::anyhow!("no rabbitmq-server: install rabbitmq-server, or set RABBITMQ_BINDIR")
    })
}

fn which_dir(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).find(|dir| dir.join(program).is_file()))
}

pub(crate) fn check(out: std::io::Result<Output>, what: &str) -> anyhow::Result<String> {
    let out = out.map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stderr).trim(),
        String::from_utf8_lossy(&out.stdout).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
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
            options: format!(
                "-c port={} -c listen_addresses={listen} -c unix_socket_directories={} \
                 -c max_connections=300 -c fsync=off -c shared_buffers=128MB",
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

    fn pg_cmd(&self, tool: &str) -> Command {
        let program = self.pg.bin.join(tool);
        match self.pg.run_as {
            Some(user) => {
                let mut cmd = Command::new("runuser");
                cmd.args(["-u", user, "--"]).arg(program);
                cmd
            }
            None => Command::new(program),
        }
    }

    fn create_postgres(&self) -> anyhow::Result<()> {
        if let Some(user) = self.pg.run_as {
            check(
                Command::new("chown")
                    .args([user, &self.root.join("pg").display().to_string()])
                    .output(),
                "chown the world's PostgreSQL directory",
            )?;
        }
        check(
            self.pg_cmd("initdb")
                .arg("-D")
                .arg(&self.pg.data)
                .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
                .output(),
            "initdb",
        )?;
        if self.host.is_some() {
            use std::io::Write as _;
            std::fs::OpenOptions::new()
                .append(true)
                .open(self.pg.data.join("pg_hba.conf"))?
                .write_all(
                    format!(
                        "host all all {}/32 trust\n",
                        Host::client_addr(Link::Postgres)
                    )
                    .as_bytes(),
                )?;
        }
        self.pg_start()
    }

    fn pg_start(&self) -> anyhow::Result<()> {
        check(
            self.pg_cmd("pg_ctl")
                .arg("-D")
                .arg(&self.pg.data)
                .arg("-l")
                .arg(self.root.join("pg/postgresql.log"))
                .args(["-w", "-t", "60", "-o", &self.pg.options, "start"])
                .output(),
            "pg_ctl start",
        )
        .map(drop)
    }

    fn pg_stop_immediate(&self) -> anyhow::Result<()> {
        check(
            self.pg_cmd("pg_ctl")
                .arg("-D")
                .arg(&self.pg.data)
                .args(["-m", "immediate", "-w", "stop"])
                .output(),
            "pg_ctl stop -m immediate",
        )
        .map(drop)
    }

    /// The world's PostgreSQL dies as on a power cut (`-m immediate`: no
    /// checkpoint, every backend killed) and starts again.
    pub async fn pg_crash_restart(&'static self) -> anyhow::Result<()> {
        blocking(move || {
            self.pg_stop_immediate()?;
            self.pg_start()
        })
        .await
    }

    fn rabbit_cmd(&self, node: &Node, script: &str) -> Command {
        let mut cmd = Command::new(self.rabbit_bin.join(script));
        cmd.env("HOME", &self.root)
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_NODENAME", &node.name)
            .env("RABBITMQ_NODE_PORT", node.amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", node.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", node.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", node.dir.join("log"))
            .env("RABBITMQ_PID_FILE", node.dir.join("pid"))
            .env("RABBITMQ_CONFIG_FILE", node.dir.join("rabbitmq"))
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                node.dir.join("advanced.config"),
            )
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                node.dir.join("enabled_plugins"),
            )
            .env("RABBITMQ_CONF_ENV_FILE", node.dir.join("rabbitmq-env.conf"))
            .current_dir(&node.dir);
        cmd
    }

    fn create_rabbit(&self) -> anyhow::Result<()> {
        // A cookie of the world's own: the developer's nodes cannot be
        // reached with it, nor ours with theirs.
        let cookie = self.root.join(".erlang.cookie");
        std::fs::write(&cookie, format!("commerce-e2e-{}", std::process::id()))?;
        std::fs::set_permissions(&cookie, std::os::unix::fs::PermissionsExt::from_mode(0o400))?;
        let peers: String = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                format!(
                    "cluster_formation.classic_config.nodes.{} = {}\n",
                    i + 1,
                    n.name
                )
            })
            .collect();
        // Our own epmd, as a child we can kill: the one a node would start
        // by itself is a daemon no one owns.
        let epmd = Command::new("epmd")
            .args(["-port", &self.epmd_port.to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("start epmd: {e}"))?;
        std::fs::write(self.root.join("epmd.pid"), epmd.id().to_string())?;
        for node in &self.nodes {
            std::fs::create_dir_all(&node.dir)?;
            // Ordered subscriptions partition through it (docs/adr/0028).
            std::fs::write(
                node.dir.join("enabled_plugins"),
                "[rabbitmq_consistent_hash_exchange].\n",
            )?;
            std::fs::write(node.dir.join("rabbitmq-env.conf"), "")?;
            std::fs::write(
                node.dir.join("rabbitmq.conf"),
                format!(
                    "loopback_users = none\n\
                     cluster_formation.peer_discovery_backend = classic_config\n\
                     cluster_formation.randomized_startup_delay_range.min = 0\n\
                     cluster_formation.randomized_startup_delay_range.max = 1\n{peers}"
                ),
            )?;
        }
        for node in &self.nodes {
            self.node_launch(node)?;
        }
        for node in &self.nodes {
            self.node_await(node)?;
        }
        self.await_cluster(self.nodes.len())
    }

    fn node_launch(&self, node: &Node) -> anyhow::Result<()> {
        // Not piped: the detached VM keeps writing its console log, and a
        // pipe whose reader is gone would kill it on the first line.
        let console = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.dir.join("console.log"))?;
        let status = self
            .rabbit_cmd(node, "rabbitmq-server")
            .arg("-detached")
            .stdin(std::process::Stdio::null())
            .stdout(console.try_clone()?)
            .stderr(console)
            .status()?;
        anyhow::ensure!(status.success(), "start {}: {status}", node.name);
        Ok(())
    }

    /// Waits until the node has booted. `await_startup` gives up at once on
    /// a node not yet registered with epmd (its start script is still
    /// generating its configuration): asked again until [`BOOT`] is over.
    fn node_await(&self, node: &Node) -> anyhow::Result<()> {
        let deadline = Instant::now() + BOOT;
        loop {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .as_secs()
                .max(1);
            let tried = check(
                self.rabbit_cmd(node, "rabbitmqctl")
                    .args(["-n", &node.name, "-q", "--timeout"])
                    .arg(left.to_string())
                    .arg("await_startup")
                    .output(),
                &format!("{} to boot", node.name),
            );
            match tried {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_secs(1)),
            }
        }
    }

    /// Waits until `n` nodes run as one cluster.
    fn await_cluster(&self, n: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + BOOT;
        loop {
            let running = self
                .nodes
                .iter()
                .find_map(|node| {
                    self.ctl_blocking(node, &["cluster_status", "--formatter", "json"])
                        .ok()
                })
                .and_then(|out| serde_json::from_str::<serde_json::Value>(&out).ok())
                .and_then(|v| v["running_nodes"].as_array().map(Vec::len))
                .unwrap_or(0);
            if running >= n {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the world's RabbitMQ cluster: {running} of {n} nodes running after {BOOT:?}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn ctl_blocking(&self, node: &Node, args: &[&str]) -> anyhow::Result<String> {
        check(
            self.rabbit_cmd(node, "rabbitmqctl")
                .args(["-n", &node.name, "-q"])
                .args(args)
                .output(),
            &format!("rabbitmqctl -n {} {args:?}", node.name),
        )
    }

    /// `rabbitmqctl` against node `i` (0-based).
    pub async fn ctl(&'static self, i: usize, args: &[&str]) -> anyhow::Result<String> {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            self.ctl_blocking(&self.nodes[i], &args)
        })
        .await
    }

    /// Node `i`'s OS pid, from its pid file.
    fn node_pid(&self, node: &Node) -> Option<u32> {
        std::fs::read_to_string(node.dir.join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// `kill -9` of node `i`'s Erlang VM: no goodbye to its peers or clients.
    pub async fn kill_node(&'static self, i: usize) -> anyhow::Result<()> {
        blocking(move || {
            let node = &self.nodes[i];
            let pid = self
                .node_pid(node)
                .ok_or_else(|| anyhow::anyhow!("{} has no pid file", node.name))?;
            check(
                Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .output(),
                &format!("kill -9 {}", node.name),
            )?;
            let _ = std::fs::remove_file(node.dir.join("pid"));
            Ok(())
        })
        .await
    }

    /// Starts node `i` again and waits until it has rejoined the cluster.
    pub async fn start_node(&'static self, i: usize) -> anyhow::Result<()> {
        blocking(move || {
            let node = &self.nodes[i];
            self.node_launch(node)?;
            self.node_await(node)
        })
        .await
    }

    /// Starts every node that is not running, and the application of every
    /// node that runs without it (after a scenario, whatever it did),
    /// waiting until all run as one cluster.
    pub async fn heal(&'static self) -> anyhow::Result<Vec<String>> {
        blocking(move || {
            let mut healed = Vec::new();
            let mut stopped_apps = Vec::new();
            for node in &self.nodes {
                match self.ctl_blocking(node, &["eval", "rabbit:is_running()."]) {
                    Ok(running) if running == "true" => {}
                    Ok(_) => stopped_apps.push(node),
                    Err(_) => {
                        self.node_launch(node)?;
                        healed.push(node.name.clone());
                    }
                }
            }
            // Together: each application waits for its peers as it starts.
            std::thread::scope(|scope| {
                let starts: Vec<_> = stopped_apps
                    .iter()
                    .map(|node| scope.spawn(|| self.ctl_blocking(node, &["start_app"])))
                    .collect();
                starts
                    .into_iter()
                    .map(|s| {
                        s.join()
                            .map_err(|_| anyhow::anyhow!("start_app panicked"))?
                    })
                    .collect::<anyhow::Result<Vec<_>>>()
            })?;
            healed.extend(
                stopped_apps
                    .iter()
                    .map(|n| format!("{} (application)", n.name)),
            );
            for node in &self.nodes {
                self.node_await(node)?;
            }
            self.await_cluster(self.nodes.len())?;
            Ok(healed)
        })
        .await
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

/// Runs a blocking command off the async threads: the traffic of the
/// scenario keeps flowing while a node boots.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}
