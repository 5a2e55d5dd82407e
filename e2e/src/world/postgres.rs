//! The world's PostgreSQL: a cluster made with the installed server's own
//! tools, started, and crashed as on a power cut.

use std::path::PathBuf;
use std::process::Command;

use super::World;
use crate::command::{blocking, check, which_dir};
use crate::hosts::{Host, Link};

pub(super) struct Postgres {
    pub(super) bin: PathBuf,
    pub(super) data: PathBuf,
    pub(super) port: u16,
    pub(super) options: String,
    pub(super) run_as: Option<&'static str>,
}

/// The installed PostgreSQL's server binaries: `PG_BINDIR`, Debian's
/// `/usr/lib/postgresql/<newest>/bin`, or `initdb` on the PATH.
pub(super) fn pg_bindir() -> anyhow::Result<PathBuf> {
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

impl World {
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

    pub(super) fn create_postgres(&self) -> anyhow::Result<()> {
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

    pub(super) fn pg_stop_immediate(&self) -> anyhow::Result<()> {
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
}
