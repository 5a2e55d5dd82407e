//! A separate host in e2e's world (docs/adr/0023): a network namespace with
//! two veth links to the world's servers, one carrying the broker and the
//! other PostgreSQL, so that a scenario can cut the host off from one and
//! not the other, then heal it.
//!
//! A cut takes the link's root end down: the host's packets vanish, nothing
//! answers with a reset, as in a partition (the kernel here has no netem to
//! drop them more finely). Needs root and `ip netns`; where either is
//! missing the host scenarios are SKIP.

use std::process::Command;

/// Which of the host's links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    Broker,
    Postgres,
}

impl Link {
    fn letter(self) -> char {
        match self {
            Self::Broker => 'b',
            Self::Postgres => 'p',
        }
    }

    /// The /30 of the link: `.1` is the servers' end, `.2` the host's.
    fn net(self) -> &'static str {
        match self {
            Self::Broker => "10.231.1",
            Self::Postgres => "10.232.1",
        }
    }
}

pub struct Host {
    ns: String,
    base: u16,
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    anyhow::ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

impl Host {
    /// The world's host (one is enough for a cut-off replica beside its twin).
    pub fn new(base: u16) -> Self {
        Self {
            ns: format!("commerce-e2e-{base}-h1"),
            base,
        }
    }

    /// Why no host can be made here, if none can.
    pub fn unavailable() -> Option<String> {
        if !crate::command::is_root() {
            return Some("network namespaces need root".into());
        }
        match Command::new("ip").args(["netns", "list"]).output() {
            Ok(out) if out.status.success() => None,
            Ok(out) => Some(format!(
                "ip netns: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Some(format!("ip netns: {e}")),
        }
    }

    /// Whether this host exists (made by the runner's parent process).
    pub fn exists(&self) -> bool {
        std::path::Path::new("/run/netns").join(&self.ns).exists()
    }

    /// The servers' address on `link`, as the host reaches them.
    pub fn server_addr(link: Link) -> String {
        format!("{}.1", link.net())
    }

    /// The host's own address on `link`.
    pub fn client_addr(link: Link) -> String {
        format!("{}.2", link.net())
    }

    fn root_end(&self, link: Link) -> String {
        // Interface names are at most 15 bytes.
        format!("ce2e{}{}", self.base, link.letter())
    }

    pub fn create(&self) -> anyhow::Result<()> {
        self.remove();
        ip(&["netns", "add", &self.ns])?;
        ip(&["-n", &self.ns, "link", "set", "lo", "up"])?;
        for link in [Link::Broker, Link::Postgres] {
            let (root, inside) = (self.root_end(link), format!("eth{}", link.letter()));
            ip(&[
                "link", "add", &root, "type", "veth", "peer", "name", &inside, "netns", &self.ns,
            ])?;
            ip(&["addr", "add", &format!("{}.1/30", link.net()), "dev", &root])?;
            ip(&["link", "set", &root, "up"])?;
            ip(&[
                "-n",
                &self.ns,
                "addr",
                "add",
                &format!("{}.2/30", link.net()),
                "dev",
                &inside,
            ])?;
            ip(&["-n", &self.ns, "link", "set", &inside, "up"])?;
        }
        Ok(())
    }

    /// The command prefix that runs a program on this host.
    pub fn exec_prefix(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.ns]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }

    /// Cuts the host off from what `link` carries.
    pub fn cut(&self, link: Link) -> anyhow::Result<()> {
        ip(&["link", "set", &self.root_end(link), "down"])
    }

    pub fn heal(&self, link: Link) -> anyhow::Result<()> {
        ip(&["link", "set", &self.root_end(link), "up"])
    }

    /// Removes the namespace (its links go with it). Quiet if it is gone.
    pub fn remove(&self) {
        let _ = ip(&["netns", "del", &self.ns]);
        for link in [Link::Broker, Link::Postgres] {
            let _ = ip(&["link", "del", &self.root_end(link)]);
        }
    }
}
