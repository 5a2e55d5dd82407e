//! `reliability explain order <id> --tenant N`: the rows a business key has
//! in every service, every event that names it, and for each event where it
//! is (outbox, published, outbox DLQ) and whether each subscriber applied
//! it, still has it queued, or dead-lettered it; then the first place it is
//! stuck, if any.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use super::Estate;
use reliability::{Result, TenantId, broker, outbox};

/// Where a key's rows live: (service, table); each table has `tenant_id`
/// and the key's column.
pub type Tables<'a> = &'a [(&'a str, &'a str)];

#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    pub tenant_id: i64,
    pub key: String,
    pub id: i64,
    pub rows: Vec<RowAt>,
    pub events: Vec<EventPath>,
    /// The first event a subscriber has not applied, and why; `None` when
    /// every event reached every subscriber.
    pub stuck: Option<String>,
    /// The payment provider's record of each payment and refund beside
    /// ours (`provider_view`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub provider: Vec<ProviderView>,
}

/// One provider key: our status, and what the provider holds under it.
#[derive(Debug, Clone, Serialize)]
pub struct ProviderView {
    pub key: String,
    pub ours: String,
    /// The provider's record, or `null`: nothing under this key.
    pub provider: Option<Value>,
    /// Why the provider could not be asked.
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RowAt {
    pub service: String,
    pub table: String,
    pub row: Value,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EventPath {
    pub source: String,
    pub id: i64,
    pub event_type: String,
    pub occurred_at: DateTime<Utc>,
    /// `outbox` (not yet published), `published`, `archived` (published,
    /// then archived), or `outbox_dlq` (attempts exhausted).
    pub at: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// The W3C trace the event carries (its `traceparent`'s trace id):
    /// the one to look up in the traces.
    pub trace_id: Option<String>,
    #[sqlx(skip)]
    pub deliveries: Vec<DeliveryAt>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeliveryAt {
    pub consumer: String,
    /// `applied`, `dead_lettered`, `waiting` (published, not applied:
    /// in the queue or in a consumer's hands), `consumed` (no record in
    /// PostgreSQL and nothing in the queue: a sink's consumer, ADR 0030,
    /// took it), `not_published`, or `unknown` (archived, and its dedup
    /// record cleaned up since).
    pub state: String,
    pub applied_at: Option<DateTime<Utc>>,
}

/// Explains `key = id` for `tenant`: rows from `tables`, events whose
/// payload carries `key`, and each event's deliveries.
pub async fn explain(
    estate: &Estate,
    tenant: TenantId,
    key: &str,
    id: i64,
    tables: Tables<'_>,
) -> Result<Explanation> {
    let mut rows = Vec::new();
    for (service, table) in tables {
        let Some(pool) = estate.database(service) else {
            continue;
        };
        // Table and column come from the caller's constant list, never input.
        let sql = format!(
            "SELECT to_jsonb(t) FROM {table} t WHERE tenant_id = $1 AND {key} = $2 ORDER BY 1"
        );
        let found: Vec<Value> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(tenant.get())
            .bind(id)
            .fetch_all(pool)
            .await?;
        rows.extend(found.into_iter().map(|row| RowAt {
            service: (*service).to_owned(),
            table: (*table).to_owned(),
            row,
        }));
    }
    let mut events = Vec::new();
    for (service, pool) in &estate.databases {
        let found: Vec<EventPath> = sqlx::query_as(
            "SELECT $3::text AS source, id, event_type, occurred_at, at, attempts, last_error,
                    nullif(split_part(headers->>'traceparent', '-', 2), '') AS trace_id FROM (
               SELECT id, event_type, occurred_at,
                      CASE WHEN processed_at IS NULL THEN 'outbox' ELSE 'published' END AS at,
                      attempts, last_error, tenant_id, payload, headers FROM outbox_messages
               UNION ALL
               SELECT id, event_type, occurred_at, 'archived', attempts, last_error, tenant_id, payload,
                      headers
               FROM outbox_messages_archive
               UNION ALL
               SELECT id, event_type, occurred_at, 'outbox_dlq', attempts, last_error, tenant_id, payload,
                      headers
               FROM outbox_messages_dlq) e
             WHERE tenant_id = $1 AND payload->>$4 = $2::text",
        )
        .bind(tenant.get())
        .bind(id)
        .bind(service)
        .bind(key)
        .fetch_all(pool)
        .await?;
        events.extend(found);
    }
    events.sort_by_key(|e| (e.occurred_at, e.id));
    let mut stuck = None;
    for event in &mut events {
        let routing_key = outbox::routing_key(&event.source, &event.event_type);
        for sub in estate.subscriptions {
            if !sub
                .bindings
                .iter()
                .any(|b| broker::topic_matches(b, &routing_key))
            {
                continue;
            }
            let delivery = delivery(estate, tenant, event, sub.consumer).await?;
            if stuck.is_none()
                && !matches!(delivery.state.as_str(), "applied" | "consumed" | "unknown")
            {
                stuck = Some(format!(
                    "{} {}#{} is {} for {}{}",
                    event.event_type,
                    event.source,
                    event.id,
                    delivery.state.replace('_', " "),
                    sub.consumer,
                    match (event.at.as_str(), delivery.state.as_str()) {
                        ("outbox", _) if event.attempts > 0 => format!(
                            ": {} failed publish(es), last: {}",
                            event.attempts,
                            event.last_error.as_deref().unwrap_or("?")
                        ),
                        ("outbox", _) => ": is the relay of its service running?".to_owned(),
                        ("outbox_dlq", _) =>
                            ": in the outbox DLQ table (reliability outbox dlq show)".to_owned(),
                        (_, "dead_lettered") => format!(
                            ": in {} (reliability queue dlq list)",
                            broker::dead_letter_queue(&estate.queue(sub.consumer))
                        ),
                        _ => format!(": in queue {} or being applied", estate.queue(sub.consumer)),
                    }
                ));
            }
            event.deliveries.push(delivery);
        }
    }
    Ok(Explanation {
        tenant_id: tenant.get(),
        key: key.to_owned(),
        id,
        rows,
        events,
        stuck,
        provider: Vec::new(),
    })
}

/// Rows that name the key through another table (a refund through its
/// payment): `sql` gives one `jsonb` per row of `service`'s database for
/// `tenant_id = $1` and the explained id `$2`, shown as `table`'s.
#[derive(Debug, Clone, Copy)]
pub struct Related<'a> {
    pub service: &'a str,
    pub table: &'a str,
    pub sql: &'a str,
}

/// Adds the rows of each of `related` to `e`.
pub async fn related_rows(
    estate: &Estate,
    related: &[Related<'_>],
    e: &mut Explanation,
) -> Result<()> {
    for r in related {
        let Some(pool) = estate.database(r.service) else {
            continue;
        };
        // The SQL is the caller's constant, never input.
        let found: Vec<Value> = sqlx::query_scalar(sqlx::AssertSqlSafe(r.sql))
            .bind(e.tenant_id)
            .bind(e.id)
            .fetch_all(pool)
            .await?;
        e.rows.extend(found.into_iter().map(|row| RowAt {
            service: r.service.to_owned(),
            table: r.table.to_owned(),
            row,
        }));
    }
    Ok(())
}

/// Where a key's requests to a third party are, and how to name them
/// there: `sql` gives `(id, status)` rows of `service`'s database for
/// `tenant_id = $1` and the explained id `$2`; each is asked for at
/// `{base}/{path}/{key(tenant, id)}` (404: nothing under that key).
#[derive(Debug, Clone, Copy)]
pub struct ProviderItems<'a> {
    pub service: &'a str,
    pub sql: &'a str,
    pub path: &'a str,
    pub key: fn(i64, i64) -> String,
}

/// Adds the third party's record of each of `items`, looked up by key at
/// `base_url`, beside our status.
pub async fn provider_view(
    estate: &Estate,
    base_url: &str,
    items: &[ProviderItems<'_>],
    e: &mut Explanation,
) -> Result<()> {
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .map_err(|err| reliability::Error::Config(format!("an HTTP client: {err}")))?;
    let base = base_url.trim_end_matches('/');
    for item in items {
        let Some(pool) = estate.database(item.service) else {
            continue;
        };
        // The query is the caller's constant, never input.
        let ours: Vec<(i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(item.sql))
            .bind(e.tenant_id)
            .bind(e.id)
            .fetch_all(pool)
            .await?;
        for (id, status) in ours {
            let key = (item.key)(e.tenant_id, id);
            let (provider, error) =
                match http.get(format!("{base}/{}/{key}", item.path)).send().await {
                    Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => (None, None),
                    Ok(r) if r.status().is_success() => (r.json::<Value>().await.ok(), None),
                    Ok(r) => (None, Some(format!("the provider answered {}", r.status()))),
                    Err(err) => (None, Some(format!("the provider is unreachable: {err}"))),
                };
            e.provider.push(ProviderView {
                key,
                ours: status,
                provider,
                error,
            });
        }
    }
    Ok(())
}

async fn delivery(
    estate: &Estate,
    tenant: TenantId,
    event: &EventPath,
    consumer: &str,
) -> Result<DeliveryAt> {
    let applied_at: Option<DateTime<Utc>> = match estate.consumer_db(consumer) {
        Some(pool) => {
            sqlx::query_scalar(
                "SELECT processed_at FROM processed_messages
                 WHERE tenant_id = $1 AND consumer = $2 AND source = $3 AND message_id = $4",
            )
            .bind(tenant.get())
            .bind(consumer)
            .bind(&event.source)
            .bind(event.id)
            .fetch_optional(pool)
            .await?
        }
        None => None,
    };
    let state = if applied_at.is_some() {
        "applied"
    } else if matches!(event.at.as_str(), "outbox" | "outbox_dlq") {
        "not_published"
    } else if event.at == "archived" {
        // Published long ago; maintenance may have forgotten its record.
        "unknown"
    } else if dead_lettered(estate, consumer, &event.source, event.id).await {
        "dead_lettered"
    } else if queue_empty(estate, consumer).await {
        // No record in PostgreSQL, none waiting: a consumer whose state is
        // elsewhere (a sink, ADR 0030) took it, or one is applying it now.
        "consumed"
    } else {
        "waiting"
    };
    Ok(DeliveryAt {
        consumer: consumer.to_owned(),
        state: state.to_owned(),
        applied_at,
    })
}

/// Whether nothing waits in the consumer's queue.
async fn queue_empty(estate: &Estate, consumer: &str) -> bool {
    let Some(conn) = &estate.broker else {
        return false;
    };
    broker::inspect_queue(conn, &estate.queue(consumer))
        .await
        .is_ok_and(|(ready, _)| ready == 0)
}

/// Whether the consumer's DLQ holds the event (looks at up to 1000 letters,
/// putting each back).
async fn dead_lettered(estate: &Estate, consumer: &str, source: &str, id: i64) -> bool {
    let Some(conn) = &estate.broker else {
        return false;
    };
    let wanted = format!("{source}:{id}");
    crate::dlq::peek_dead_letters(conn, &estate.queue(consumer), 1000)
        .await
        .is_ok_and(|letters| {
            letters
                .iter()
                .any(|l| l.message_id.as_deref() == Some(wanted.as_str()))
        })
}
