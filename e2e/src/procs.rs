//! Real processes for the e2e runner: each service role runs as its own
//! process so one part can be killed (`kill -9`) and restarted alone, or
//! started with a fail point that aborts it at an exact place.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use testkit::wait_until;

/// One process of the stack.
pub struct Proc {
    pub name: String,
    bin: PathBuf,
    args: Vec<String>,
    /// Its API port, for the roles that serve HTTP.
    pub http: Option<u16>,
    /// Port of `/healthz`, `/readyz` and `/metrics`: its `OPS_PORT`. No
    /// API port serves `/metrics`.
    pub ops: Option<u16>,
    child: Option<Child>,
    /// Times it was started (restarts included).
    pub starts: u32,
    /// Started with fail points armed.
    armed: bool,
    /// What it runs under (`ip netns exec <host>`), and its own settings on
    /// top of the stack's: a process on another host.
    wrap: Vec<String>,
    env: Vec<(String, String)>,
}

/// The whole stack as processes, all sharing one environment.
pub struct Cluster {
    pub procs: BTreeMap<String, Proc>,
    env: Vec<(String, String)>,
    logs: PathBuf,
    /// The ops port the next process gets.
    next_ops: u16,
}

impl Cluster {
    /// Processes get ops ports from `ops_base` up.
    pub fn new(env: Vec<(String, String)>, logs: PathBuf, ops_base: u16) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&logs)?;
        Ok(Self {
            procs: BTreeMap::new(),
            env,
            logs,
            next_ops: ops_base,
        })
    }

    /// Registers `name` = `bin args…` (not started), with an ops port of
    /// its own.
    pub fn add(&mut self, name: &str, bin: PathBuf, args: &[&str], http: Option<u16>) {
        self.next_ops += 1;
        let ops = Some(self.next_ops);
        let p = Proc {
            name: name.to_owned(),
            bin,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            http,
            ops,
            child: None,
            starts: 0,
            armed: false,
            wrap: Vec::new(),
            env: Vec::new(),
        };
        self.procs.insert(name.to_owned(), p);
    }

    /// Registers `name` = `bin args…` run under `wrap` (another host's
    /// `ip netns exec`), with `env` on top of the stack's settings (the
    /// servers' addresses as that host sees them). It has no ops port: the
    /// runner cannot reach the host's loopback.
    pub fn add_on(
        &mut self,
        name: &str,
        wrap: Vec<String>,
        env: Vec<(String, String)>,
        bin: PathBuf,
        args: &[&str],
    ) {
        self.add(name, bin, args, None);
        let p = self.procs.get_mut(name).expect("just added");
        p.ops = None;
        p.wrap = wrap;
        p.env = env;
    }

    /// The settings every process shares.
    pub fn env(&self) -> &[(String, String)] {
        &self.env
    }

    /// Starts `name`, with `fail_points` (e.g. `relay.after_confirm=abort`) if given.
    pub fn start(&mut self, name: &str, fail_points: Option<&str>) -> anyhow::Result<()> {
        self.start_with(name, fail_points, &[])
    }

    /// Starts `name` with settings of its own on top of the stack's (a
    /// short deadline, say); `restore` puts it back without them.
    pub fn start_with(
        &mut self,
        name: &str,
        fail_points: Option<&str>,
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let log = self.log(name)?;
        let p = self.procs.get_mut(name).context("no such process")?;
        let mut cmd = match p.wrap.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&p.bin);
                cmd
            }
            None => Command::new(&p.bin),
        };
        cmd.args(&p.args)
            .envs(self.env.iter().cloned())
            .envs(p.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        cmd.env("RELIABILITY_FAILPOINTS", fail_points.unwrap_or(""));
        if let Some(ops) = p.ops {
            cmd.env("OPS_PORT", ops.to_string());
        }
        cmd.envs(env.iter().copied());
        p.child = Some(
            cmd.spawn()
                .with_context(|| format!("start {}", p.bin.display()))?,
        );
        p.starts += 1;
        p.armed = fail_points.is_some_and(|f| !f.is_empty()) || !env.is_empty();
        Ok(())
    }

    /// Puts `names` back as a scenario found them: running, without fail
    /// points, whatever the scenario did or where it stopped.
    pub fn restore(&mut self, names: &[String]) -> anyhow::Result<Vec<String>> {
        let mut restarted = Vec::new();
        for name in names {
            let armed = self.procs.get(name).is_some_and(|p| p.armed);
            if armed || self.exited(name) {
                self.kill9(name);
                self.start(name, None)?;
                restarted.push(name.clone());
            }
        }
        Ok(restarted)
    }

    pub fn start_all(&mut self) -> anyhow::Result<()> {
        let names: Vec<String> = self.procs.keys().cloned().collect();
        for name in names {
            self.start(&name, None)?;
        }
        Ok(())
    }

    /// SIGKILL, as `kill -9`: no cleanup, no goodbye to the broker.
    pub fn kill9(&mut self, name: &str) {
        if let Some(mut child) = self.procs.get_mut(name).and_then(|p| p.child.take()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether `name` has exited (a fail point aborted it, say).
    pub fn exited(&mut self, name: &str) -> bool {
        match self.procs.get_mut(name).and_then(|p| p.child.as_mut()) {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// Waits until `name` died by itself.
    pub async fn wait_exit(&mut self, name: &str, deadline: Duration) {
        let start = std::time::Instant::now();
        while !self.exited(name) {
            assert!(
                start.elapsed() < deadline,
                "{name} did not exit within {deadline:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Where `name`'s `/metrics` answers: its ops port.
    pub fn metrics_port(&self, name: &str) -> Option<u16> {
        self.procs.get(name).and_then(|p| p.ops)
    }

    /// Where `name`'s `/readyz` answers: its API port if it serves (a
    /// build from before the ops port had only that one), else its ops
    /// port.
    fn ready_port(&self, name: &str) -> Option<u16> {
        self.procs.get(name).and_then(|p| p.http.or(p.ops))
    }

    /// Waits until every process answers `/readyz` (relays with their
    /// topology declared, consumers connected) and every process lives.
    pub async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let served: Vec<String> = self
            .procs
            .values()
            .filter(|p| p.http.or(p.ops).is_some())
            .map(|p| p.name.clone())
            .collect();
        let served: Vec<&str> = served.iter().map(String::as_str).collect();
        self.ready(&served).await?;
        let names: Vec<String> = self.procs.keys().cloned().collect();
        for name in names {
            anyhow::ensure!(
                !self.exited(&name),
                "{name} exited; see {}",
                self.logs.join(format!("{name}.log")).display()
            );
        }
        Ok(())
    }

    /// Waits until each of `names` answers `/readyz` (the others may be down).
    pub async fn ready(&self, names: &[&str]) -> anyhow::Result<()> {
        let http = reqwest::Client::new();
        for name in names {
            let port = self
                .ready_port(name)
                .with_context(|| format!("{name} has no ops port"))?;
            wait_until(
                Duration::from_secs(60),
                &format!("{name} ready on :{port}"),
                || async {
                    http.get(format!("http://127.0.0.1:{port}/readyz"))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success())
                },
            )
            .await;
        }
        Ok(())
    }

    /// Peak resident set (KiB) of each running process since its last start.
    pub fn peak_rss_kib(&self) -> BTreeMap<String, u64> {
        self.procs
            .values()
            .filter_map(|p| {
                let pid = p.child.as_ref()?.id();
                Some((p.name.clone(), peak_rss_kib(&pid.to_string())?))
            })
            .collect()
    }

    /// The resident set (KiB) of `name` now, if it runs.
    /// The OS pid of every process that runs.
    pub fn pids(&self) -> BTreeMap<String, u32> {
        self.procs
            .values()
            .filter_map(|p| Some((p.name.clone(), p.child.as_ref()?.id())))
            .collect()
    }

    pub fn rss_kib(&self, name: &str) -> Option<u64> {
        let pid = self.procs.get(name)?.child.as_ref()?.id();
        status_kib(&pid.to_string(), "VmRSS:")
    }

    /// Sends `signal` (`STOP`, `CONT`…) to `name`, if it runs.
    pub fn signal(&self, name: &str, signal: &str) -> anyhow::Result<()> {
        let pid = self
            .procs
            .get(name)
            .and_then(|p| p.child.as_ref())
            .map(Child::id)
            .with_context(|| format!("{name} is not running"))?;
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()?;
        anyhow::ensure!(status.success(), "kill -{signal} {name}: {status}");
        Ok(())
    }

    /// Whether `name` is stopped (SIGSTOP, or a `freeze` fail point).
    pub fn frozen(&self, name: &str) -> bool {
        self.procs
            .get(name)
            .and_then(|p| p.child.as_ref())
            .and_then(|c| std::fs::read_to_string(format!("/proc/{}/stat", c.id())).ok())
            // The state follows the command in parentheses: `pid (comm) T …`.
            .and_then(|stat| {
                stat.rsplit_once(") ")
                    .map(|(_, rest)| rest.starts_with('T'))
            })
            .unwrap_or(false)
    }

    pub fn stop_all(&mut self) {
        let names: Vec<String> = self.procs.keys().cloned().collect();
        for name in names {
            if let Some(mut child) = self.procs.get_mut(&name).and_then(|p| p.child.take()) {
                // SIGTERM first: the graceful path; then make sure.
                let _ = Command::new("kill")
                    .arg("-TERM")
                    .arg(child.id().to_string())
                    .status();
                for _ in 0..50 {
                    if !matches!(child.try_wait(), Ok(None)) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    fn log(&self, name: &str) -> anyhow::Result<File> {
        Ok(OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("{name}.log")))?)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// `VmHWM` of `/proc/{pid}/status` (`pid` may be `self`): the peak resident
/// set in KiB.
pub fn peak_rss_kib(pid: &str) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

/// A KiB figure of `/proc/{pid}/status`.
fn status_kib(pid: &str, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}
