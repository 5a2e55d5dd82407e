//! The `e2e-pgbouncer` profile's own row (docs/adr/0026): the suite's
//! traffic really went through PgBouncer in transaction mode, for the
//! runtime role only, on few server connections.

use e2e::pooler::{Pooler, SERVER_POOL};

use crate::report::Row;
use crate::run::LAYOUT;
use e2e::check::Verdict;

/// Read before the stack stops, while its clients are still connected.
pub fn row(pooler: &Pooler, database_url: &str, secs: std::time::Instant) -> Row {
    let mut violations = Vec::new();
    if let Err(e) = listens_direct(database_url, &mut violations) {
        violations.push(format!("PostgreSQL's sessions: {e:#}"));
    }
    let faults = match observe(pooler, &mut violations) {
        Ok(faults) => faults,
        Err(e) => {
            violations.push(format!("PgBouncer's admin console: {e:#}"));
            String::new()
        }
    };
    Row {
        name: "the runtime role went through PgBouncer (transaction mode)",
        faults,
        verdict: Verdict {
            violations,
            ..Verdict::default()
        },
        secs: secs.elapsed().as_secs_f64(),
        skipped: None,
    }
}

fn observe(pooler: &Pooler, violations: &mut Vec<String>) -> anyhow::Result<String> {
    let num = |row: &std::collections::HashMap<String, String>, col: &str| -> u64 {
        row.get(col).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let stats = pooler.show("STATS")?;
    let mut xacts = 0;
    // The graph's database holds no state of its own (ADR 0030).
    for svc in e2e::cluster::services()
        .into_iter()
        .filter(|s| *s != "graph")
    {
        let db = format!("{}_{svc}", LAYOUT.name);
        let n = stats
            .iter()
            .find(|r| r.get("database") == Some(&db))
            .map_or(0, |r| num(r, "total_xact_count"));
        if n == 0 {
            violations.push(format!("no transaction of {db} went through PgBouncer"));
        }
        xacts += n;
    }
    let clients = pooler.show("CLIENTS")?;
    for role in ["commerce_relay", "commerce_owner"] {
        let n = clients
            .iter()
            .filter(|c| c.get("user").is_some_and(|u| u == role))
            .count();
        if n > 0 {
            violations.push(format!(
                "{n} connections of {role} went through PgBouncer: it must connect direct (LISTEN, session locks)"
            ));
        }
    }
    let app_clients = clients
        .iter()
        .filter(|c| c.get("user").is_some_and(|u| u == "commerce_app"))
        .count();
    let mut servers = 0;
    for pool in pooler.show("POOLS")? {
        if pool.get("user").is_none_or(|u| u != "commerce_app") {
            continue;
        }
        let held: u64 = ["sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login"]
            .iter()
            .map(|c| num(&pool, c))
            .sum();
        if held > u64::from(SERVER_POOL) {
            violations.push(format!(
                "{} holds {held} server connections, over its pool of {SERVER_POOL}",
                pool.get("database").map_or("?", String::as_str)
            ));
        }
        servers += held;
    }
    Ok(format!(
        "{xacts} transactions of the runtime role through PgBouncer; now {app_clients} client connections on {servers} server connections (at most {SERVER_POOL} per database)"
    ))
}

/// A LISTEN through a transaction-mode pooler hears nothing: the session
/// that listened goes back to the pool. Every listener must be a session of
/// its own, on the relay role (the payments worker's wake-up included).
fn listens_direct(database_url: &str, violations: &mut Vec<String>) -> anyhow::Result<()> {
    let out = std::process::Command::new("psql")
        .args([database_url, "-Atc"])
        .arg(
            "SELECT datname || ' ' || usename || ' ' || query FROM pg_stat_activity \
             WHERE query ILIKE 'LISTEN %'",
        )
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sessions = String::from_utf8_lossy(&out.stdout);
    for s in sessions.lines().filter(|s| !s.contains(" commerce_relay ")) {
        violations.push(format!("a LISTEN not on the relay role's own session: {s}"));
    }
    let worker = format!("{}_payments commerce_relay", LAYOUT.name);
    if !sessions
        .lines()
        .any(|s| s.starts_with(&worker) && s.contains("payments_work"))
    {
        violations.push("the payments worker does not LISTEN on a session of its own".into());
    }
    Ok(())
}
