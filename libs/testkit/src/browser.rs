//! Browser tests: Playwright (`playwright-core` from npm, installed by
//! `scripts/browser.sh` under `libs/operator/tests/browser/`) drives
//! Debian's chromium, headless. Where either is missing a test says so and
//! passes, except under `CONSOLE_BROWSER_TESTS=required` (CI), where it
//! fails.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the browser scripts and their `node_modules` live.
pub fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../operator/tests/browser")
}

/// What the browser needs, or why it cannot run.
fn missing() -> Option<String> {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !Path::new(&chromium).exists() {
        return Some(format!("no chromium at {chromium}"));
    }
    if !scripts().join("node_modules/playwright-core").exists() {
        return Some("no playwright-core in libs/operator/tests/browser/node_modules".into());
    }
    if let Err(e) = Command::new("node").arg("--version").output() {
        return Some(format!("no node: {e}"));
    }
    None
}

/// Whether a browser test can run here; `false` after saying why it is
/// skipped. Panics where CI requires it.
pub fn available() -> bool {
    let Some(why) = missing() else {
        return true;
    };
    crate::skipped(
        "CONSOLE_BROWSER_TESTS",
        &why,
        "scripts/browser.sh installs what they need",
    )
}

/// Runs `node SCRIPT ARGS…` in [`scripts`], bounded by coreutils'
/// `timeout` at `secs` (Playwright bounds each of its steps at 30 s);
/// returns whether it passed and what it printed.
pub async fn run(script: &str, args: Vec<String>, secs: u32) -> (bool, String) {
    let script = script.to_owned();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("timeout")
            .arg(secs.to_string())
            .arg("node")
            .arg(script)
            .args(args)
            .current_dir(scripts())
            .output()
    })
    .await
    .expect("the browser's thread")
    .expect("timeout and node run");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}
