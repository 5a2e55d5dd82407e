//! The graph store: one FalkorDB graph, reached only through
//! [`Store::run`], which scopes every statement to one tenant. A statement
//! is a [`Cypher`] constant whose every node pattern names
//! `tenant: $tenant`, and `$tenant` is always the caller's [`TenantId`]:
//! a route has its token's, the consumer the event's. Edges are only ever
//! made between nodes of one event's tenant, so no walk leaves it.
//!
//! The Cypher is the subset Neo4j also accepts (MERGE, MATCH, SET,
//! FOREACH, pattern comprehensions, parameters; no procedures), so another
//! engine needs another connection, not other statements.

use std::collections::HashMap;
use std::time::Duration;

use falkordb::{AsyncGraph, FalkorClientBuilder, FalkorConnectionInfo, FalkorDBError, FalkorValue};
use futures_util::TryStreamExt;
use reliability::TenantId;
use serde_json::{Map, Value};
use tokio::sync::OnceCell;

/// How long a statement may take before the store counts as unavailable;
/// a write waits its turn behind the graph's other writes.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A statement of the service's, checked by [`check`] before it runs.
#[derive(Debug, Clone, Copy)]
pub struct Cypher(pub &'static str);

/// Parameters of a statement, by name (`$name`); `tenant` is the store's.
pub type Params = Map<String, Value>;

/// One result row: its columns by name.
pub type Row = Map<String, Value>;

type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + 'a>>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The server cannot be reached, or did not answer in time: nothing
    /// may be known of the statement (a write is safe to send again).
    #[error("graph store unavailable: {0}")]
    Unavailable(String),
    /// The server refused the statement.
    #[error("graph statement failed: {0}")]
    Query(String),
    /// A statement or its parameters would not be scoped to one tenant.
    #[error("graph statement refused: {0}")]
    Unscoped(String),
}

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

/// The graph `name` on the FalkorDB server at `url` (`falkor://host:port`),
/// connected on first use (a process starts while the server does), its
/// schema declared before its first statement ([`crate::schema`]).
pub struct Store {
    url: String,
    name: String,
    graph: OnceCell<AsyncGraph>,
}

impl Store {
    pub fn new(url: &str, name: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: name.to_owned(),
            graph: OnceCell::new(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    async fn graph(&self) -> Result<AsyncGraph, StoreError> {
        self.graph
            .get_or_try_init(|| async {
                let info: FalkorConnectionInfo = self
                    .url
                    .as_str()
                    .try_into()
                    .map_err(|e: FalkorDBError| StoreError::Query(e.to_string()))?;
                let client = FalkorClientBuilder::new_async()
                    .with_connection_info(info)
                    .with_connect_timeout(Some(CONNECT_TIMEOUT))
                    .with_response_timeout(Some(RESPONSE_TIMEOUT))
                    .build()
                    .await?;
                crate::schema::declare(&mut self.redis().await?, &self.name).await?;
                Ok(client.select_graph(&self.name))
            })
            .await
            .cloned()
    }

    /// Runs `cypher` for `tenant`: the one way the service reaches the
    /// graph. Refuses a statement with a node pattern not scoped to
    /// `$tenant`, and a parameter that would stand in for the tenant.
    pub async fn run(
        &self,
        tenant: TenantId,
        cypher: Cypher,
        params: Params,
    ) -> Result<Vec<Row>, StoreError> {
        check(cypher.0).map_err(StoreError::Unscoped)?;
        if params.contains_key("tenant") {
            return Err(StoreError::Unscoped(
                "`tenant` is the store's own parameter".to_owned(),
            ));
        }
        // Boxed as a trait object: the client's futures nest deep enough
        // to overflow the compiler's query depth in every caller.
        let run: BoxFuture<'_, Vec<Row>> = Box::pin(self.execute(tenant, cypher, params));
        run.await
    }

    async fn execute(
        &self,
        tenant: TenantId,
        cypher: Cypher,
        params: Params,
    ) -> Result<Vec<Row>, StoreError> {
        let mut graph = self.graph().await?;
        let mut query = graph
            .query(cypher.0)
            .with_param("tenant", FalkorValue::I64(tenant.get()));
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
    /// `name` meets this one from its next statement). A graph nothing was
    /// ever written to does not exist: `name` is emptied instead.
    pub async fn replace(&self, name: &str) -> Result<(), StoreError> {
        let mut conn = self.redis().await?;
        let renamed: redis::RedisResult<()> = redis::cmd("RENAME")
            .arg(&self.name)
            .arg(name)
            .query_async(&mut conn)
            .await;
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

    /// A plain Redis connection to the server, for what the graph client
    /// does not offer (constraints, RENAME).
    async fn redis(&self) -> Result<redis::aio::MultiplexedConnection, StoreError> {
        let url =
            self.url
                .replacen("falkor://", "redis://", 1)
                .replacen("falkors://", "rediss://", 1);
        let client = redis::Client::open(url).map_err(|e| StoreError::Query(e.to_string()))?;
        tokio::time::timeout(CONNECT_TIMEOUT, client.get_multiplexed_async_connection())
            .await
            .map_err(|_| StoreError::Unavailable("connect timed out".into()))?
            .map_err(|e| StoreError::Unavailable(e.to_string()))
    }

    /// Deletes the whole graph (a test's, or a rebuild's old copy).
    pub async fn delete(&self) -> Result<(), StoreError> {
        // Boxed, as in `run`.
        let delete: BoxFuture<'_, ()> = Box::pin(async {
            let mut graph = self.graph().await?;
            match graph.delete().await {
                Ok(()) => Ok(()),
                // Never written: nothing to delete.
                Err(e) if e.to_string().contains("empty key") => Ok(()),
                Err(e) => Err(e.into()),
            }
        });
        delete.await
    }
}

/// Whether every node pattern of `cypher` is scoped to `$tenant`: a pattern
/// with a label or properties names `tenant: $tenant`, and a bare `(v)`
/// names a variable such a pattern bound before it. Parentheses right
/// after a name (`count(*)`) are calls, and groups that are not patterns
/// (`(l IN $lines | ...)`) are left alone.
pub fn check(cypher: &str) -> Result<(), String> {
    let mut scoped: Vec<&str> = Vec::new();
    for (at, _) in cypher.match_indices('(') {
        if cypher[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let rest = &cypher[at + 1..];
        let Some(end) = rest.find([')', '(']) else {
            return Err(format!("unclosed `(` at {at}"));
        };
        if rest.as_bytes()[end] == b'(' {
            continue;
        }
        let Some(node) = NodePattern::parse(&rest[..end]) else {
            continue;
        };
        if node.labelled || node.properties.is_some() {
            let props = node.properties.unwrap_or_default();
            if !props
                .trim_start_matches('{')
                .split(',')
                .any(|p| p.trim() == "tenant: $tenant")
            {
                return Err(format!(
                    "node pattern `({})` is not scoped by `tenant: $tenant`",
                    &rest[..end]
                ));
            }
            if !node.variable.is_empty() {
                scoped.push(node.variable);
            }
        } else if node.variable.is_empty() {
            return Err(format!("anonymous node pattern `()` at {at}"));
        } else if !scoped.contains(&node.variable) {
            return Err(format!(
                "`({})` names no node bound by a scoped pattern before it",
                node.variable
            ));
        }
    }
    Ok(())
}

/// `(variable:Label:Label {properties})`, each part optional.
struct NodePattern<'a> {
    variable: &'a str,
    labelled: bool,
    properties: Option<&'a str>,
}

impl<'a> NodePattern<'a> {
    fn parse(text: &'a str) -> Option<Self> {
        let word = |s: &'a str| -> (&'a str, &'a str) {
            let n = s
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(s.len());
            (&s[..n], &s[n..])
        };
        let (variable, mut rest) = word(text.trim_start());
        let mut labelled = false;
        loop {
            rest = rest.trim_start();
            let Some(after) = rest.strip_prefix(':') else {
                break;
            };
            let (label, tail) = word(after.trim_start());
            if label.is_empty() {
                return None;
            }
            labelled = true;
            rest = tail;
        }
        let properties = match rest.trim() {
            "" => None,
            p if p.starts_with('{') && p.ends_with('}') => Some(p.trim_end_matches('}')),
            _ => return None,
        };
        Some(Self {
            variable,
            labelled,
            properties,
        })
    }
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

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn a_statement_is_scoped_only_when_every_node_pattern_names_the_tenant() {
        let ok = [
            "MATCH (o:Order {tenant: $tenant, id: $id}) RETURN o.id",
            "MATCH (o:Order {id: $id, tenant: $tenant})<-[:PLACED]-(c:Customer {tenant: $tenant}) RETURN count(*)",
            "MATCH (o:Order {tenant: $tenant}) RETURN [(o)-[r:CONTAINS]->(p:Product {tenant: $tenant}) | p.sku]",
            "MERGE (o:Order {tenant: $tenant, id: $id}) FOREACH (l IN $lines | MERGE (p:Product {tenant: $tenant, sku: l.sku}) MERGE (o)-[:CONTAINS]->(p))",
        ];
        for cypher in ok {
            assert_eq!(check(cypher), Ok(()), "{cypher}");
        }
        let refused = [
            "MATCH (o:Order {id: $id}) RETURN o",
            "MATCH (o:Order) RETURN o",
            "MATCH (n) RETURN n",
            "MATCH (o:Order {tenant: $tenant})-[*]-() RETURN o",
            "MATCH (o:Order {tenant: $other}) RETURN o",
            "MATCH (o:Order {tenant: $tenant}) MATCH (p) RETURN p",
            "MATCH (o:Order {tenant: $tenant, id: $id}), (x:Order {tenantx: $tenant}) RETURN x",
        ];
        for cypher in refused {
            assert!(check(cypher).is_err(), "{cypher} should be refused");
        }
    }
}
