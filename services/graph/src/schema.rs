//! The graph's schema: every label a statement MERGEs on, each with an
//! index and a unique constraint on its key, declared before the first
//! statement of a process runs (docs/adr/0030).
//!
//! Why before: FalkorDB plans a statement before it takes the graph's
//! write lock, and a label the graph does not know yet is planned as
//! "no such node". Two statements planned before the first of them made
//! the label both create their node: on a fresh graph, two deliveries of
//! one event both missed its checkpoint and both applied it (two writers
//! of one event on fresh graphs: applied twice in 286 of 300 tries; with
//! the label declared first, once in every try). Once declared, a label's
//! MERGEs take turns under the write lock. The unique constraint turns any
//! second node of one key into a refused write, which the consumer retries
//! and then finds applied, instead of a silent double count; the index
//! keeps each MERGE a lookup, not a scan of the label.

use redis::aio::MultiplexedConnection;

use crate::store::StoreError;

/// Each label and the properties that identify one of its nodes.
pub const KEYS: &[(&str, &[&str])] = &[
    ("Checkpoint", &["tenant", "consumer", "source", "aggregate"]),
    ("Tenant", &["tenant"]),
    ("Watermark", &["tenant", "source"]),
    ("Customer", &["tenant", "id"]),
    ("Order", &["tenant", "id"]),
    ("Product", &["tenant", "sku"]),
    ("Payment", &["tenant", "id"]),
    ("Refund", &["tenant", "id"]),
];

/// Declares [`KEYS`] in graph `name` (creating the graph if need be).
/// What is declared already is left as it is, so every process may run it
/// at once.
pub async fn declare(conn: &mut MultiplexedConnection, name: &str) -> Result<(), StoreError> {
    for (label, key) in KEYS {
        let properties: Vec<String> = key.iter().map(|p| format!("n.{p}")).collect();
        let index = format!(
            "CREATE INDEX FOR (n:{label}) ON ({})",
            properties.join(", ")
        );
        let created: redis::RedisResult<redis::Value> = redis::cmd("GRAPH.QUERY")
            .arg(name)
            .arg(&index)
            .query_async(conn)
            .await;
        tolerate(created, "already indexed")?;
        let constrained: redis::RedisResult<redis::Value> = redis::cmd("GRAPH.CONSTRAINT")
            .arg("CREATE")
            .arg(name)
            .arg("UNIQUE")
            .arg("NODE")
            .arg(label)
            .arg("PROPERTIES")
            .arg(key.len())
            .arg(*key)
            .query_async(conn)
            .await;
        tolerate(constrained, "already exists")?;
    }
    Ok(())
}

/// `result`, with an error that says `already` counted as done.
fn tolerate(result: redis::RedisResult<redis::Value>, already: &str) -> Result<(), StoreError> {
    match result {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains(already) => Ok(()),
        Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
            Err(StoreError::Unavailable(e.to_string()))
        }
        Err(e) => Err(StoreError::Query(e.to_string())),
    }
}
