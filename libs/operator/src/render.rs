//! Text for people, JSON lines for scripts.

use chrono::{DateTime, Utc};
use operator::ops::explain::Explanation;
use operator::ops::status::Status;

/// Rows as JSON lines, or as `field: value` blocks for a person.
pub fn print<T: serde::Serialize>(json: bool, rows: &[T]) -> anyhow::Result<()> {
    for row in rows {
        let value = serde_json::to_value(row)?;
        if json {
            println!("{value}");
            continue;
        }
        match value {
            serde_json::Value::Object(fields) => {
                let width = fields.keys().map(String::len).max().unwrap_or(0);
                for (k, v) in fields {
                    println!("{k:>width$}  {}", plain(&v));
                }
                println!();
            }
            other => println!("{other}"),
        }
    }
    if rows.is_empty() && !json {
        println!("(none)");
    }
    Ok(())
}

fn plain(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// "12s ago", "3m ago", "2h ago", "4d ago".
fn ago(at: Option<DateTime<Utc>>) -> String {
    let Some(at) = at else {
        return "never".to_owned();
    };
    let s = (Utc::now() - at).num_seconds().max(0);
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m ago", s / 60),
        3600..86400 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

pub fn status(json: bool, status: &Status) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(status)?);
        return Ok(());
    }
    println!(
        "{:<12} {:>8} {:>12} {:>9} {:>6}",
        "OUTBOX", "pending", "oldest (s)", "attempts", "dlq"
    );
    for line in &status.outbox {
        match (&line.status, &line.error) {
            (Some(s), _) => println!(
                "{:<12} {:>8} {:>12} {:>9} {:>6}",
                line.service,
                s.pending,
                opt(s.oldest_pending_seconds.map(|v| format!("{v:.1}"))),
                opt(s.max_attempts),
                s.dlq
            ),
            (None, e) => println!("{:<12} unreachable: {}", line.service, opt(e.as_deref())),
        }
    }
    println!(
        "\n{:<12} {:>9} {:>15}",
        "CONNECTIONS", "database", "server / max"
    );
    for c in &status.connections {
        println!(
            "{:<12} {:>9} {:>15}",
            c.service,
            c.database,
            format!("{} / {}", c.server, c.server_max)
        );
    }
    println!(
        "\n{:<18} {:>7} {:>8} {:>10} {:>5} {:>7} {:>10}  last applied",
        "CONSUMER", "ready", "unacked", "consumers", "dlq", "parked", "applied"
    );
    for c in &status.consumers {
        println!(
            "{:<18} {:>7} {:>8} {:>10} {:>5} {:>7} {:>10}  {}",
            c.consumer,
            opt(c.ready),
            opt(c.unacked),
            opt(c.consumers),
            opt(c.dlq),
            opt(c.parked),
            opt(c.applied),
            ago(c.last_applied_at)
        );
    }
    println!(
        "\n{:<12} {:<20} {:>14} {:>14}",
        "MAINTENANCE", "step", "last success", "last failure"
    );
    for m in &status.maintenance {
        println!(
            "{:<12} {:<20} {:>14} {:>14}",
            m.service,
            m.run.step,
            ago(m.run.last_success_at),
            ago(m.run.last_failure_at)
        );
    }
    if status.maintenance.is_empty() {
        println!("(no maintenance has run yet)");
    }
    if !status.admission.is_empty() {
        println!(
            "\n{:<12} {:>10} {:>10} {:>8} {:>8}",
            "ADMISSION", "tenant", "in flight", "stuck", "bound"
        );
        for a in &status.admission {
            let bound = if a.bound == 0 {
                "none".to_owned()
            } else {
                a.bound.to_string()
            };
            println!(
                "{:<12} {:>10} {:>10} {:>8} {:>8}",
                a.service, a.tenant_id, a.in_flight, a.stuck, bound
            );
        }
    }
    if let Some(failed) = status.refunds_failed.as_ref().filter(|f| f.count > 0) {
        println!(
            "\nREFUNDS      {} ended failed in the last 24 h, the latest {:.0} s ago",
            failed.count,
            failed.latest_seconds_ago.unwrap_or(0.0)
        );
    }
    if !status.bindings_checked {
        println!("\n(bindings not checked: RabbitMQ's management API did not answer)");
    }
    println!();
    if status.problems.is_empty() {
        println!("nothing stuck");
    }
    for p in &status.problems {
        println!("problem: {p}");
    }
    Ok(())
}

pub fn explanation(json: bool, e: &Explanation) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(e)?);
        return Ok(());
    }
    println!("{} {} of tenant {}", e.key, e.id, e.tenant_id);
    if e.rows.is_empty() {
        println!("  no rows in any service (wrong tenant or id?)");
    }
    for r in &e.rows {
        let status = r.row.get("status").map_or_else(String::new, plain);
        println!("  {:<11} {:<14} {status}", r.service, r.table);
    }
    if !e.provider.is_empty() {
        println!("provider (by key)");
    }
    for p in &e.provider {
        let theirs = match (&p.provider, &p.error) {
            (_, Some(err)) => err.clone(),
            (None, None) => "nothing under this key".to_owned(),
            (Some(rec), None) => {
                let field = |f: &str| rec.get(f).map_or_else(String::new, plain);
                match rec.get("refunded_cents") {
                    Some(back) => format!(
                        "{} {} cents, {} refunded",
                        field("status"),
                        field("amount_cents"),
                        plain(back)
                    ),
                    None => format!("{} {} cents", field("status"), field("amount_cents")),
                }
            }
        };
        println!("  {:<34} ours {:<10} provider {theirs}", p.key, p.ours);
    }
    println!("events");
    for ev in &e.events {
        println!(
            "  {}#{} {} ({}{})",
            ev.source,
            ev.id,
            ev.event_type,
            ev.at,
            match ev.attempts {
                0 => String::new(),
                n => format!(", {n} failed attempt(s)"),
            }
        );
        for d in &ev.deliveries {
            println!(
                "      -> {:<18} {}{}",
                d.consumer,
                d.state,
                d.applied_at.map_or_else(String::new, |at| format!(" {at}"))
            );
        }
    }
    match &e.stuck {
        Some(why) => println!("stuck: {why}"),
        None => println!("nothing stuck: every event reached every subscriber"),
    }
    Ok(())
}
