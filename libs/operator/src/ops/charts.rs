//! The last hour per minute, read from the outboxes themselves (the
//! `processed_at` index): orders decided per second, and each outbox's lag
//! (the longest wait from commit to the broker's confirm). No sampler of
//! ours keeps a history: PostgreSQL already has it, until maintenance
//! archives the rows (a week after publishing).

use serde::Serialize;
use sqlx::PgPool;

use reliability::Result;

/// One minute's value, for each of the last 60, the oldest first.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    pub title: String,
    pub points: Vec<f64>,
}

const MINUTES: usize = 60;

/// `value` per minute of the rows published in the last hour, of
/// `events` only when given.
async fn per_minute(pool: &PgPool, value: &str, events: Option<&[&str]>) -> Result<Vec<f64>> {
    // The value is this module's constant, never input.
    let sql = format!(
        "SELECT (extract(epoch FROM now() - processed_at) / 60)::int AS ago, {value}
         FROM outbox_messages
         WHERE processed_at > now() - interval '1 hour'
           AND ($1::text[] IS NULL OR event_type = ANY($1))
         GROUP BY 1"
    );
    let rows: Vec<(i32, f64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(events)
        .fetch_all(pool)
        .await?;
    let mut points = vec![0.0; MINUTES];
    for (ago, v) in rows {
        if let Ok(ago) = usize::try_from(ago)
            && ago < MINUTES
        {
            points[MINUTES - 1 - ago] = v;
        }
    }
    Ok(points)
}

/// Events of `events` published per second, each minute.
pub async fn rate(pool: &PgPool, events: &[&str]) -> Result<Vec<f64>> {
    per_minute(pool, "count(*)::float8 / 60", Some(events)).await
}

/// The longest commit-to-confirm wait of the minute's published rows, s.
pub async fn lag(pool: &PgPool) -> Result<Vec<f64>> {
    let value = "max(extract(epoch FROM processed_at - occurred_at))::float8";
    per_minute(pool, value, None).await
}

/// `points` as an inline SVG of bars, scaled to their largest, with it
/// written beside: no script, no chart library.
pub fn svg(points: &[f64], unit: &str) -> String {
    let (w, h, bar) = (360.0, 60.0, 6.0);
    let top = points.iter().copied().fold(0.0, f64::max);
    let bars: String = points
        .iter()
        .enumerate()
        .filter(|(_, v)| **v > 0.0)
        .map(|(i, v)| {
            let height = (v / top * h).max(1.0);
            format!(
                r#"<rect x="{:.0}" y="{:.1}" width="{:.0}" height="{height:.1}"><title>{v:.2} {unit}</title></rect>"#,
                i as f64 * bar,
                h - height,
                bar - 1.0
            )
        })
        .collect();
    format!(
        r##"<svg role="img" width="{w}" height="{h}" viewBox="0 0 {w} {h}" fill="#3b6ea5">{bars}</svg> <span>max {top:.2} {unit}</span>"##
    )
}
