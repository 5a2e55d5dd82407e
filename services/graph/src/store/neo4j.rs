//! The Neo4j engine (feature `neo4j`): the same statements over Bolt.
//! `GRAPH_URL` is `bolt://user:password@host:7687[/database]` (or
//! `neo4j://`, `+s` for TLS); without a database, the server's default.
//!
//! CI compiles and lints this module but runs no Neo4j: no registry the
//! project's machines reach ships a Neo4j server (README, "The graph").
//! What it relies on, from Neo4j's documentation rather than a test here:
//! - a uniqueness constraint per label key (declared as it connects, as
//!   [`crate::schema::KEYS`] lists them) makes concurrent MERGEs of one
//!   key take turns instead of creating two nodes;
//! - under read committed, a value read by one clause and written by a
//!   later one can be stale by then (a lost update), but a SET whose own
//!   right-hand side reads the node's property locks the node before it
//!   reads: every read a write depends on is written that way
//!   (`crate::apply`: the checkpoint's `fresh`, the counts, the stock).

use neo4rs::{BoltType, ConfigBuilder, Graph};
use reliability::TenantId;
use serde_json::{Map, Value};

use super::{Access, CONNECT_TIMEOUT, Cypher, Params, RESPONSE_TIMEOUT, Row, StoreError};

pub(super) struct Neo4j {
    graph: Graph,
}

impl Neo4j {
    /// Connects to the server of `url` and declares the schema. Neo4j's
    /// graph is its database (`url`'s path), so `_name` names nothing here.
    pub(super) async fn connect(url: &str, _name: &str) -> Result<Self, StoreError> {
        let target = Target::parse(url)?;
        let mut config = ConfigBuilder::default()
            .uri(target.uri)
            .user(target.user)
            .password(target.password)
            .connection_timeout(CONNECT_TIMEOUT);
        if let Some(db) = target.database {
            config = config.db(db);
        }
        let graph = Graph::connect(config.build().map_err(query)?).map_err(classify)?;
        let engine = Self { graph };
        for (label, key) in crate::schema::KEYS {
            let properties: Vec<String> = key.iter().map(|p| format!("n.{p}")).collect();
            let constraint = format!(
                "CREATE CONSTRAINT graph_{}_key IF NOT EXISTS FOR (n:{label}) REQUIRE ({}) IS UNIQUE",
                label.to_lowercase(),
                properties.join(", ")
            );
            engine
                .rows(neo4rs::query(&constraint), Access::Write)
                .await?;
        }
        Ok(engine)
    }

    pub(super) async fn execute(
        &self,
        tenant: TenantId,
        cypher: Cypher,
        params: Params,
        access: Access,
    ) -> Result<Vec<Row>, StoreError> {
        let mut statement = neo4rs::query(cypher.0).param("tenant", tenant.get());
        for (name, value) in params {
            statement = statement.param(&name, BoltType::try_from(value).map_err(query)?);
        }
        self.rows(statement, access).await
    }

    /// Runs `statement` in a transaction of its own, within
    /// [`RESPONSE_TIMEOUT`] (the driver's own retries included).
    ///
    /// A read runs in READ access mode: the server refuses a write in it.
    /// Its bound on the server is the database's `db.transaction.timeout`
    /// (the driver offers no per-transaction one here): set it to the
    /// graph's read bound, 3 s, where Neo4j serves the routes.
    async fn rows(&self, statement: neo4rs::Query, access: Access) -> Result<Vec<Row>, StoreError> {
        let run = async {
            let mut stream = match access {
                Access::Write => self.graph.execute(statement).await?,
                Access::Read => self.graph.execute_read(statement).await?,
            };
            let mut rows = Vec::new();
            while let Some(row) = stream.next().await? {
                rows.push(row.to::<Map<String, Value>>()?);
            }
            Ok::<_, neo4rs::Error>(rows)
        };
        tokio::time::timeout(RESPONSE_TIMEOUT, run)
            .await
            .map_err(|_| StoreError::Unavailable("no answer in time".into()))?
            .map_err(classify)
    }
}

/// Neo4j has no atomic swap of one graph for another (a database cannot
/// be renamed while it serves), so the rebuild by swap is FalkorDB's.
pub(super) fn no_swap() -> StoreError {
    StoreError::Query(
        "a rebuild's swap needs FalkorDB: Neo4j cannot replace a graph in one step".into(),
    )
}

/// The parts of a `bolt://user:password@host:port/database` address.
struct Target {
    uri: String,
    user: String,
    password: String,
    database: Option<String>,
}

impl Target {
    fn parse(url: &str) -> Result<Self, StoreError> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| StoreError::Query(format!("not an address: {url}")))?;
        let (credentials, address) = rest.rsplit_once('@').unwrap_or(("", rest));
        let (user, password) = credentials.split_once(':').unwrap_or((credentials, ""));
        let (host, database) = match address.split_once('/') {
            Some((host, db)) if !db.is_empty() => (host, Some(db.to_owned())),
            Some((host, _)) => (host, None),
            None => (address, None),
        };
        Ok(Self {
            uri: format!("{scheme}://{host}"),
            user: user.to_owned(),
            password: password.to_owned(),
            database,
        })
    }
}

fn query(e: impl std::fmt::Display) -> StoreError {
    StoreError::Query(e.to_string())
}

/// A lost or refused connection is the store being unavailable; anything
/// else is the statement's.
fn classify(e: neo4rs::Error) -> StoreError {
    use neo4rs::Error as E;
    match e {
        E::IOError { .. }
        | E::ConnectionError
        | E::ServerUnavailableError(_)
        | E::ConnectionTimedOut => StoreError::Unavailable(e.to_string()),
        other => query(other),
    }
}

#[cfg(test)]
mod tests {
    use super::Target;

    #[test]
    fn an_address_gives_its_credentials_and_database() {
        let t = Target::parse("bolt://neo4j:s3cret@db.example:7687/commerce").unwrap();
        assert_eq!(
            (t.uri.as_str(), t.user.as_str(), t.password.as_str()),
            ("bolt://db.example:7687", "neo4j", "s3cret")
        );
        assert_eq!(t.database.as_deref(), Some("commerce"));
        let t = Target::parse("neo4j+s://host:7687").unwrap();
        assert_eq!(
            (t.uri.as_str(), t.user.as_str()),
            ("neo4j+s://host:7687", "")
        );
        assert_eq!(t.database, None);
    }
}
