//! The FalkorDB engine: a graph of a Redis server with the FalkorDB module
//! (`falkor://host:port`), its schema declared as it connects, and again
//! on the first write after it deleted or renamed its graph.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use falkordb::{AsyncGraph, FalkorClientBuilder, FalkorConnectionInfo, FalkorDBError, FalkorValue};
use futures_util::TryStreamExt;
use redis::aio::MultiplexedConnection;
use reliability::TenantId;
use serde_json::Value;

use super::{
    Access, CONNECT_TIMEOUT, Cypher, Params, READ_TIMEOUT, RESPONSE_TIMEOUT, Row, StoreError,
};

impl From<FalkorDBError> for StoreError {
    fn from(e: FalkorDBError) -> Self {
        let text = e.to_string();
        let lost = matches!(
            e,
            FalkorDBError::ConnectionDown
                | FalkorDBError::NoConnection
                | FalkorDBError::EmptyConnection
                | FalkorDBError::Timeout { .. }
        ) || [
            "refused",
            "broken pipe",
            "reset",
            "closed",
            "timed out",
            "LOADING",
            "os error",
        ]
        .iter()
        .any(|s| text.contains(s));
        if lost {
            Self::Unavailable(text)
        } else {
            Self::Query(text)
        }
    }
}

pub(super) struct Falkor {
    url: String,
    name: String,
    graph: AsyncGraph,
    /// Whether graph `name` holds the schema: false once it was deleted or
    /// renamed away, so that the next write declares it again. A rebuild
    /// connected to its fresh graph (declaring it), deleted what an
    /// interrupted one had left, wrote it without a schema and swapped it
    /// in: the live graph then had no index and no unique constraint.
    declared: AtomicBool,
}

impl Falkor {
    /// Connects to graph `name` at `url` and declares its schema
    /// ([`crate::schema`]) before anything runs on it.
    pub(super) async fn connect(url: &str, name: &str) -> Result<Self, StoreError> {
        let info: FalkorConnectionInfo = url
            .try_into()
            .map_err(|e: FalkorDBError| StoreError::Query(e.to_string()))?;
        let client = FalkorClientBuilder::new_async()
            .with_connection_info(info)
            .with_connect_timeout(Some(CONNECT_TIMEOUT))
            .with_response_timeout(Some(RESPONSE_TIMEOUT))
            .build()
            .await?;
        crate::schema::declare(&mut redis_connection(url).await?, name).await?;
        Ok(Self {
            url: url.to_owned(),
            name: name.to_owned(),
            graph: client.select_graph(name),
            declared: AtomicBool::new(true),
        })
    }

    /// Declares the schema again if the graph was deleted or renamed away
    /// since it was last declared (declaring is idempotent, so two writers
    /// may both do it).
    async fn declared(&self) -> Result<(), StoreError> {
        if !self.declared.load(Ordering::Acquire) {
            crate::schema::declare(&mut redis_connection(&self.url).await?, &self.name).await?;
            self.declared.store(true, Ordering::Release);
        }
        Ok(())
    }

    pub(super) async fn execute(
        &self,
        tenant: TenantId,
        cypher: Cypher,
        params: Params,
        access: Access,
    ) -> Result<Vec<Row>, StoreError> {
        if access == Access::Write {
            self.declared().await?;
        }
        let mut graph = self.graph.clone();
        let query = match access {
            Access::Write => graph.query(cypher.0),
            Access::Read => graph
                .ro_query(cypher.0)
                .with_timeout(READ_TIMEOUT.as_millis() as i64),
        };
        let mut query = query.with_param("tenant", FalkorValue::I64(tenant.get()));
        for (name, value) in params {
            query = query.with_param(&name, to_falkor(value));
        }
        let result = query.execute().await?;
        let header = result.header.clone();
        let rows: Vec<falkordb::Row> = result.data.try_collect().await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                header
                    .iter()
                    .cloned()
                    .zip(row.into_values().into_iter().map(to_json))
                    .collect()
            })
            .collect())
    }

    /// Puts this graph in the place of graph `name` in one step (Redis's
    /// RENAME: the graph there is dropped, and every reader and writer of
    /// `name` meets this one from its next statement).
    pub(super) async fn replace(&self, name: &str) -> Result<(), StoreError> {
        let mut conn = redis_connection(&self.url).await?;
        let renamed: redis::RedisResult<()> = redis::cmd("RENAME")
            .arg(&self.name)
            .arg(name)
            .query_async(&mut conn)
            .await;
        // After the step, not before: a write between the two would declare
        // on the graph the step then takes away.
        self.declared.store(false, Ordering::Release);
        match renamed {
            Ok(()) => Ok(()),
            Err(e) if e.to_string().contains("no such key") => {
                let _: () = redis::cmd("DEL")
                    .arg(name)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| StoreError::Query(e.to_string()))?;
                Ok(())
            }
            Err(e) => Err(StoreError::Query(e.to_string())),
        }
    }

    pub(super) async fn delete(&self) -> Result<(), StoreError> {
        let deleted = self.graph.clone().delete().await;
        self.declared.store(false, Ordering::Release);
        match deleted {
            Ok(()) => Ok(()),
            // Never written: nothing to delete.
            Err(e) if e.to_string().contains("empty key") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// A plain Redis connection to the server, for what the graph client does
/// not offer (constraints, RENAME).
async fn redis_connection(url: &str) -> Result<MultiplexedConnection, StoreError> {
    let url = url
        .replacen("falkor://", "redis://", 1)
        .replacen("falkors://", "rediss://", 1);
    let client = redis::Client::open(url).map_err(|e| StoreError::Query(e.to_string()))?;
    tokio::time::timeout(CONNECT_TIMEOUT, client.get_multiplexed_async_connection())
        .await
        .map_err(|_| StoreError::Unavailable("connect timed out".into()))?
        .map_err(|e| StoreError::Unavailable(e.to_string()))
}

fn to_falkor(value: Value) -> FalkorValue {
    match value {
        Value::Null => FalkorValue::None,
        Value::Bool(b) => FalkorValue::Bool(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => FalkorValue::I64(i),
            None => FalkorValue::F64(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => FalkorValue::String(s),
        Value::Array(items) => FalkorValue::Array(items.into_iter().map(to_falkor).collect()),
        Value::Object(map) => FalkorValue::Map(
            map.into_iter()
                .map(|(k, v)| (k, to_falkor(v)))
                .collect::<HashMap<_, _>>(),
        ),
    }
}

fn to_json(value: FalkorValue) -> Value {
    match value {
        FalkorValue::None => Value::Null,
        FalkorValue::Bool(b) => Value::Bool(b),
        FalkorValue::I64(i) => Value::from(i),
        FalkorValue::F64(f) => Value::from(f),
        FalkorValue::String(s) => Value::String(s),
        FalkorValue::Array(items) => Value::Array(items.into_iter().map(to_json).collect()),
        FalkorValue::Map(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, to_json(v))).collect())
        }
        FalkorValue::Node(node) => Value::Object(
            node.properties
                .into_iter()
                .map(|(k, v)| (k, to_json(v)))
                .collect(),
        ),
        other => Value::String(format!("{other:?}")),
    }
}
