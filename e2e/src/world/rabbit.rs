//! The world's RabbitMQ: three nodes with their own names, ports, data
//! directories, Erlang cookie and epmd, formed into one cluster, and the
//! node losses and heals the scenarios ask for.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{BOOT, World};
use crate::command::{blocking, check, which_dir};

pub struct Node {
    pub name: String,
    pub amqp_port: u16,
    pub(super) dist_port: u16,
    pub(super) dir: PathBuf,
}

/// RabbitMQ's own scripts (Debian's `/usr/lib/rabbitmq/bin`, which do not
/// switch user as the `/usr/sbin` wrappers do), `RABBITMQ_BINDIR`, or the PATH.
pub(super) fn rabbit_bindir() -> anyhow::Result<PathBuf> {
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

impl World {
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

    pub(super) fn create_rabbit(&self) -> anyhow::Result<()> {
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
    pub(super) fn node_pid(&self, node: &Node) -> Option<u32> {
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
}
