//! Running the commands a world is made of: their output checked, their
//! programs found, the blocking ones kept off the async threads. Shared by
//! the world, its servers and the pooler, which import nothing of each
//! other for it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Output;

pub(crate) fn is_root() -> bool {
    // The euid, without a libc dependency: /proc/self is owned by it.
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

pub(crate) fn which_dir(program: &str) -> Option<PathBuf> {
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

pub(crate) fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Runs a blocking command off the async threads: the traffic of the
/// scenario keeps flowing while a node boots.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}
