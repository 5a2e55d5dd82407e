//! The run's table: a row per scenario, the rows every run ends with (the
//! views against their sources, the developer's servers untouched), and
//! the verdict.

use std::time::Instant;

use e2e::check::{Dbs, Verdict};
use e2e::untouched::Untouched;

pub(crate) struct Row {
    pub(crate) name: &'static str,
    pub(crate) faults: String,
    pub(crate) verdict: Verdict,
    pub(crate) secs: f64,
    /// Why the scenario could not run here: never a PASS.
    pub(crate) skipped: Option<String>,
}

/// The views the whole run derived, against their sources (ADR 0035).
pub(crate) async fn verified_row(dbs: &Dbs) -> Row {
    let t0 = Instant::now();
    let violations = dbs
        .views_verified()
        .await
        .unwrap_or_else(|e| vec![format!("verify: {e:#}")]);
    Row {
        name: "derived views equal their sources (projection verify)",
        faults: "every order view and ordered history of the run, once quiet".into(),
        verdict: Verdict {
            violations,
            ..Verdict::default()
        },
        secs: t0.elapsed().as_secs_f64(),
        skipped: None,
    }
}

/// The last row: the developer's PostgreSQL and RabbitMQ as the run found them.
pub(crate) async fn untouched_row(watch: Untouched) -> Row {
    let t0 = Instant::now();
    let unwatched = watch.unwatched.clone();
    let changed = watch.verify().await;
    let verdict = Verdict {
        violations: changed,
        ..Verdict::default()
    };
    Row {
        name: "the developer's PostgreSQL and RabbitMQ left untouched",
        faults:
            "a connection to each held for the whole run; start time and file settings compared"
                .into(),
        verdict,
        secs: t0.elapsed().as_secs_f64(),
        skipped: (!unwatched.is_empty())
            .then(|| format!("not running here: {}", unwatched.join("; "))),
    }
}

/// Prints the table; says whether any row failed, and whether any was skipped.
pub(crate) fn report(rows: &[Row], total: f64) -> (bool, bool) {
    println!();
    println!(
        "{:<62} {:>6} {:>5} {:>5} {:>6} {:>5} {:>4} {:>4} {:>5}  verdict",
        "scenario", "orders", "conf", "canc", "events", "dups", "lost", "dlq", "secs"
    );
    let mut failed = false;
    for r in rows {
        let lost = r
            .verdict
            .violations
            .iter()
            .filter(|v| v.starts_with("I1"))
            .count();
        let ok = r.verdict.violations.is_empty();
        failed |= !ok;
        let verdict = match (&r.skipped, ok) {
            (_, false) => "FAIL",
            (Some(_), true) => "SKIP",
            (None, true) => "PASS",
        };
        println!(
            "{:<62} {:>6} {:>5} {:>5} {:>6} {:>5} {:>4} {:>4} {:>5.1}  {}",
            r.name,
            r.verdict.orders,
            r.verdict.confirmed,
            r.verdict.cancelled,
            r.verdict.events,
            r.verdict.duplicates,
            lost,
            r.verdict.dead_letters,
            r.secs,
            verdict
        );
        println!("    faults: {}", r.faults);
    }
    for r in rows.iter().filter(|r| !r.verdict.violations.is_empty()) {
        println!("\n{} violated:", r.name);
        for v in &r.verdict.violations {
            println!("  {v}");
        }
    }
    let passed = rows
        .iter()
        .filter(|r| r.verdict.violations.is_empty() && r.skipped.is_none())
        .count();
    let skipped = rows
        .iter()
        .filter(|r| r.verdict.violations.is_empty() && r.skipped.is_some())
        .count();
    println!(
        "\ncolumns: dups = duplicate deliveries absorbed (I2), lost = committed events never applied (I1), dlq = messages in DLQs (only injected poison allowed)"
    );
    println!(
        "e2e: {passed} passed, {} failed, {skipped} skipped in {total:.0}s",
        rows.len() - passed - skipped
    );
    (failed, skipped > 0)
}
