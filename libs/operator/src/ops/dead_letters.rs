//! A consumer queue's dead letters, grouped by cause: the handler's error
//! its consumer recorded beside each letter (`reliability::consumer::causes`),
//! else the broker's reason. Letters that share a cause are usually one
//! incident, fixed once and re-driven together.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use reliability::{Error, Result};
use serde::Serialize;
use sqlx::PgPool;

use super::Estate;

/// Letters looked at per queue: the oldest, which is where it began.
pub const PEEK: usize = 500;

#[derive(Debug, Clone, Serialize)]
pub struct Letter {
    pub message_id: String,
    pub event_type: String,
    pub tenant_id: Option<i64>,
    /// The handler's error, when its consumer recorded one.
    pub error: Option<String>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Group {
    /// `transient`, `permanent`, `decode`, `database 23505`, …, or `not
    /// recorded` (the broker's reason is the cause then).
    pub class: String,
    /// The error with its numbers blanked (`no order #`): what the group's
    /// letters share.
    pub cause: String,
    pub letters: Vec<Letter>,
}

/// Why a dead letter was dead-lettered, as its consumer recorded it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct DeadLetterCause {
    pub tenant_id: i64,
    pub source: String,
    pub message_id: i64,
    pub event_type: String,
    pub reason: String,
    pub error_class: String,
    pub error: String,
    pub dead_lettered_at: DateTime<Utc>,
}

/// The recorded causes of `consumer`'s letters `ids` (`(source, id)`, as
/// `reliability::outbox::Envelope::message_id` splits), read as the owner
/// role.
pub async fn causes(
    owner: &PgPool,
    consumer: &str,
    ids: &[(String, i64)],
) -> Result<Vec<DeadLetterCause>> {
    let (sources, numbers): (Vec<&str>, Vec<i64>) =
        ids.iter().map(|(s, n)| (s.as_str(), *n)).unzip();
    Ok(sqlx::query_as(
        "SELECT c.tenant_id, c.source, c.message_id, c.event_type, c.reason, c.error_class, c.error,
                c.dead_lettered_at
         FROM dead_letter_causes c
         JOIN unnest($2::text[], $3::bigint[]) AS k (source, message_id) USING (source, message_id)
         WHERE c.consumer = $1",
    )
    .bind(consumer)
    .bind(&sources)
    .bind(&numbers)
    .fetch_all(owner)
    .await?)
}

fn broker_of(estate: &Estate) -> Result<&lapin::Connection> {
    let unreachable = || Error::Config("the broker is unreachable".into());
    estate.broker.as_ref().ok_or_else(unreachable)
}

/// Digit runs as `#`: "no order 7" and "no order 9" are one cause.
fn shape(error: &str) -> String {
    let mut out = String::with_capacity(error.len());
    let mut in_digits = false;
    for c in error.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('#');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

/// `consumer`'s dead letters (up to [`PEEK`]) in groups of one cause, the
/// largest first.
pub async fn grouped(estate: &Estate, consumer: &str) -> Result<Vec<Group>> {
    let conn = broker_of(estate)?;
    let letters = crate::dlq::peek_dead_letters(conn, &estate.queue(consumer), PEEK).await?;
    let ids: Vec<(String, i64)> = letters
        .iter()
        .filter_map(|l| l.message_id.as_deref()?.rsplit_once(':'))
        .filter_map(|(source, id)| Some((source.to_owned(), id.parse().ok()?)))
        .collect();
    let causes = match estate.consumer_db(consumer) {
        Some(pool) if !ids.is_empty() => causes(pool, consumer, &ids).await?,
        _ => Vec::new(),
    };
    let mut groups: BTreeMap<(String, String), Vec<Letter>> = BTreeMap::new();
    for l in letters {
        let id = l.message_id.clone().unwrap_or_default();
        let cause = causes
            .iter()
            .find(|c| format!("{}:{}", c.source, c.message_id) == id);
        let key = match cause {
            Some(c) => (c.error_class.clone(), shape(&c.error)),
            None => (
                "not recorded".to_owned(),
                l.reason.clone().unwrap_or_else(|| "no reason".into()),
            ),
        };
        groups.entry(key).or_default().push(Letter {
            message_id: id,
            event_type: l.event_type.unwrap_or_default(),
            tenant_id: cause.map(|c| c.tenant_id),
            error: cause.map(|c| c.error.clone()),
            dead_lettered_at: cause.map(|c| c.dead_lettered_at),
        });
    }
    let mut groups: Vec<Group> = groups
        .into_iter()
        .map(|((class, cause), letters)| Group {
            class,
            cause,
            letters,
        })
        .collect();
    groups.sort_by_key(|g| std::cmp::Reverse(g.letters.len()));
    Ok(groups)
}

/// Moves `ids` of `consumer`'s DLQ (all of it when `None`) back onto its
/// queue, in order; the others stay, in order. Returns how many moved:
/// fewer than asked when some had gone (re-driven by another operator).
pub async fn redrive(estate: &Estate, consumer: &str, ids: Option<Vec<String>>) -> Result<usize> {
    let conn = broker_of(estate)?;
    let filter = crate::dlq::DeadLetterFilter {
        message_ids: ids,
        ..Default::default()
    };
    crate::dlq::redrive_dead_letters(conn, &estate.queue(consumer), usize::MAX, &filter).await
}

/// Letter `id` of `consumer`'s DLQ, as it is there now, if it still is.
pub async fn letter(
    estate: &Estate,
    consumer: &str,
    id: &str,
) -> Result<Option<crate::dlq::DeadLetter>> {
    let conn = broker_of(estate)?;
    let letters = crate::dlq::peek_dead_letters(conn, &estate.queue(consumer), PEEK).await?;
    Ok(letters
        .into_iter()
        .find(|l| l.message_id.as_deref() == Some(id)))
}

/// Deletes letter `id` of `consumer`'s DLQ for good, and its cause (so
/// the DLQ's age no longer counts it); 0 when it had gone.
pub async fn drop(estate: &Estate, consumer: &str, id: &str) -> Result<usize> {
    let conn = broker_of(estate)?;
    let filter = crate::dlq::DeadLetterFilter {
        message_id: Some(id.to_owned()),
        ..Default::default()
    };
    let dropped = crate::dlq::drop_dead_letters(conn, &estate.queue(consumer), &filter).await?;
    if let Some(pool) = estate.consumer_db(consumer)
        && let Some((source, n)) = id.split_once(':')
        && let Ok(n) = n.parse::<i64>()
    {
        sqlx::query(
            "DELETE FROM dead_letter_causes WHERE consumer = $1 AND source = $2 AND message_id = $3",
        )
        .bind(consumer)
        .bind(source)
        .bind(n)
        .execute(pool)
        .await?;
    }
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    #[test]
    fn numbers_do_not_split_a_cause() {
        assert_eq!(
            super::shape("no order 7 for tenant 12"),
            "no order # for tenant #"
        );
        assert_eq!(
            super::shape("transient: poison pill"),
            "transient: poison pill"
        );
    }
}
