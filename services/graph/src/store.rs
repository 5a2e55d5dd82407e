//! The graph store: one graph, reached only through [`Store::run`], which
//! scopes every statement to one tenant. A statement is a [`Cypher`]
//! constant whose every node pattern names `tenant: $tenant`, and
//! `$tenant` is always the caller's [`TenantId`]: a route has its token's,
//! the consumer the event's. Edges are only ever made between nodes of one
//! event's tenant, so no walk leaves it.
//!
//! The engine is FalkorDB (`falkor://`), or Neo4j (`bolt://`, `neo4j://`)
//! when built with the `neo4j` feature. The Cypher is the subset both
//! accept (MERGE, MATCH, SET, FOREACH, pattern comprehensions, parameters;
//! no procedures), so an engine is a connection, not other statements.

use std::time::Duration;

use reliability::TenantId;
use serde_json::{Map, Value};
use tokio::sync::OnceCell;

mod falkor;
#[cfg(feature = "neo4j")]
mod neo4j;

/// How long a statement may take before the store counts as unavailable;
/// a write waits its turn behind the graph's other writes.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a read may run on the server before the engine aborts it
/// (FalkorDB's query `TIMEOUT`): below [`RESPONSE_TIMEOUT`], so the server
/// gives a slow read up, and its thread back, before the client does.
const READ_TIMEOUT: Duration = Duration::from_secs(3);

/// What a statement may do on the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// The consumer's statements: they write.
    Write,
    /// The routes': read-only on the engine (`GRAPH.RO_QUERY`, Neo4j's
    /// READ access mode), within [`READ_TIMEOUT`].
    Read,
}

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

enum Engine {
    Falkor(falkor::Falkor),
    #[cfg(feature = "neo4j")]
    Neo4j(neo4j::Neo4j),
}

/// The graph `name` on the server at `url` (`falkor://host:port`, or with
/// the `neo4j` feature `bolt://user:password@host:port`), connected on
/// first use (a process starts while the server does), its schema
/// declared before its first statement ([`crate::schema`]).
pub struct Store {
    url: String,
    name: String,
    engine: OnceCell<Engine>,
}

impl Store {
    pub fn new(url: &str, name: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: name.to_owned(),
            engine: OnceCell::new(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    async fn engine(&self) -> Result<&Engine, StoreError> {
        self.engine
            .get_or_try_init(|| async {
                let scheme = self.url.split("://").next().unwrap_or_default();
                match scheme {
                    "falkor" | "falkors" => {
                        Ok(Engine::Falkor(falkor::Falkor::connect(&self.url, &self.name).await?))
                    }
                    #[cfg(feature = "neo4j")]
                    "bolt" | "bolt+s" | "neo4j" | "neo4j+s" => {
                        Ok(Engine::Neo4j(neo4j::Neo4j::connect(&self.url, &self.name).await?))
                    }
                    #[cfg(not(feature = "neo4j"))]
                    "bolt" | "bolt+s" | "neo4j" | "neo4j+s" => Err(StoreError::Query(
                        "GRAPH_URL names Neo4j: build graph with `--features neo4j`".into(),
                    )),
                    other => Err(StoreError::Query(format!(
                        "GRAPH_URL scheme `{other}`: falkor:// (or bolt://, neo4j:// with the neo4j feature)"
                    ))),
                }
            })
            .await
    }

    /// Runs `cypher` for `tenant`: the one way the service writes the
    /// graph. Refuses a statement with a node pattern not scoped to
    /// `$tenant`, and a parameter that would stand in for the tenant.
    pub async fn run(
        &self,
        tenant: TenantId,
        cypher: Cypher,
        params: Params,
    ) -> Result<Vec<Row>, StoreError> {
        self.statement(tenant, cypher, params, Access::Write).await
    }

    /// As [`Self::run`], read-only on the engine and within a server-side
    /// bound: the routes' one way to the graph. A statement that would
    /// write is refused by the engine, whatever its text.
    pub async fn read(
        &self,
        tenant: TenantId,
        cypher: Cypher,
        params: Params,
    ) -> Result<Vec<Row>, StoreError> {
        self.statement(tenant, cypher, params, Access::Read).await
    }

    async fn statement(
        &self,
        tenant: TenantId,
        cypher: Cypher,
        params: Params,
        access: Access,
    ) -> Result<Vec<Row>, StoreError> {
        check(cypher.0).map_err(StoreError::Unscoped)?;
        if params.contains_key("tenant") {
            return Err(StoreError::Unscoped(
                "`tenant` is the store's own parameter".to_owned(),
            ));
        }
        // Boxed as a trait object: the clients' futures nest deep enough
        // to overflow the compiler's query depth in every caller.
        let run: BoxFuture<'_, Vec<Row>> = Box::pin(async move {
            match self.engine().await? {
                Engine::Falkor(f) => f.execute(tenant, cypher, params, access).await,
                #[cfg(feature = "neo4j")]
                Engine::Neo4j(n) => n.execute(tenant, cypher, params, access).await,
            }
        });
        run.await
    }

    /// Puts this graph in the place of graph `name` in one step: every
    /// reader and writer of `name` meets this one from its next statement
    /// (FalkorDB only: the rebuild's swap).
    pub async fn replace(&self, name: &str) -> Result<(), StoreError> {
        let replace: BoxFuture<'_, ()> = Box::pin(async move {
            match self.engine().await? {
                Engine::Falkor(f) => f.replace(name).await,
                #[cfg(feature = "neo4j")]
                Engine::Neo4j(_) => Err(neo4j::no_swap()),
            }
        });
        replace.await
    }

    /// Deletes the whole graph (a test's, or a rebuild's old copy).
    pub async fn delete(&self) -> Result<(), StoreError> {
        let delete: BoxFuture<'_, ()> = Box::pin(async move {
            match self.engine().await? {
                Engine::Falkor(f) => f.delete().await,
                #[cfg(feature = "neo4j")]
                Engine::Neo4j(_) => Err(neo4j::no_swap()),
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
