//! `projection verify` as the last check of an e2e run, and `graph
//! verify` of each scenario's tenant (docs/adr/0035).

use crate::check::Dbs;

impl Dbs {
    /// `projection verify` over the whole run (docs/adr/0035): every order
    /// view equals what the sources' rows say, every ordered history is in
    /// its order. Run once all is quiet, so with no grace.
    pub async fn views_verified(&self) -> anyhow::Result<Vec<String>> {
        let verifier = projection::verify::Verifier::new(
            self.projection.clone(),
            self.sources(),
            std::time::Duration::ZERO,
            sources::verify::CHUNK,
        );
        let report = verifier.run_once(false).await?;
        Ok(report
            .differences
            .into_iter()
            .map(|d| {
                format!(
                    "verify: {} of tenant {} {}: {}",
                    d.view, d.tenant_id, d.entity, d.detail
                )
            })
            .collect())
    }

    /// `graph verify` of one tenant (docs/adr/0035): every order's node and
    /// edges, every customer's count and product's units ordered, as the
    /// sources' rows say. Run once the scenario is quiet, with no grace.
    pub(crate) async fn graph_verified(
        &self,
        graph: &std::sync::Arc<graph::store::Store>,
        tenant: i64,
    ) -> anyhow::Result<Vec<String>> {
        let verifier = graph::verify::Verifier::new(
            graph.clone(),
            self.sources(),
            std::time::Duration::ZERO,
            sources::verify::CHUNK,
        );
        let report = verifier.run_tenant(tenant, false).await?;
        if report.differences.is_empty() {
            return Ok(vec![]);
        }
        // One line per kind of difference, its entities named: CI keeps a
        // line's first 1,500 characters, and forty customers each "graph
        // 2; the sources say 1" pushed every other clue out of stop 58's.
        let mut kinds: std::collections::BTreeMap<(&str, String), Vec<String>> =
            std::collections::BTreeMap::new();
        for d in report.differences {
            kinds.entry((d.view, d.detail)).or_default().push(d.entity);
        }
        let mut found: Vec<String> = kinds
            .into_iter()
            .map(|((view, detail), entities)| {
                format!("graph verify: {view} {}: {detail}", named(&entities))
            })
            .collect();
        found.push(match self.graph_doubled(graph, tenant).await {
            Ok(doubled) => doubled,
            Err(e) => format!("graph: keys held twice not counted ({e:#})"),
        });
        found.push(match self.graph_missing(graph, tenant).await {
            Ok(missing) => missing,
            Err(e) => format!("graph: the events it lacks not listed ({e:#})"),
        });
        Ok(found)
    }

    /// Which of the schema's keys (graph::schema::KEYS) the tenant holds
    /// in two or more nodes. A key held twice makes every statement that
    /// MERGEs it run its change once per node: a count doubled where its
    /// checkpoint says the event came once (stop 58's "graph 2; the
    /// sources say 1" for every customer of the scenario).
    async fn graph_doubled(
        &self,
        graph: &std::sync::Arc<graph::store::Store>,
        tenant: i64,
    ) -> anyhow::Result<String> {
        let id = reliability::TenantId::new(tenant)?;
        let mut doubled = Vec::new();
        for (label, key) in graph::schema::KEYS {
            let columns: Vec<String> = key.iter().map(|k| format!("n.{k} AS {k}")).collect();
            // Leaked: `Cypher` holds a `&'static str`, and this runs only
            // when a scenario has failed, once per label.
            let cypher = format!(
                "MATCH (n:{label} {{tenant: $tenant}}) WITH {}, count(*) AS c WHERE c > 1
                 RETURN count(*) AS keys, toInteger(sum(c)) AS nodes",
                columns.join(", ")
            )
            .leak();
            let rows = graph
                .read(
                    id,
                    graph::store::Cypher(cypher),
                    graph::store::Params::new(),
                )
                .await?;
            let count = |name: &str| {
                rows.first()
                    .and_then(|r| r.get(name))
                    .and_then(|v| v.as_i64())
                    .unwrap_or(0)
            };
            if count("keys") > 0 {
                doubled.push(format!(
                    "{label} {} keys in {} nodes",
                    count("keys"),
                    count("nodes")
                ));
            }
        }
        // Without its unique constraints nothing refuses a second node of a
        // key (a rebuild swapped in a graph with none until session 45).
        let constraints = graph
            .read(
                id,
                graph::store::Cypher(
                    "CALL db.constraints() YIELD label, status RETURN label, status",
                ),
                graph::store::Params::new(),
            )
            .await?;
        let field = |r: &graph::store::Row, name: &str| {
            r.get(name)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned()
        };
        let unready: Vec<String> = constraints
            .iter()
            .filter(|r| field(r, "status") != "OPERATIONAL")
            .map(|r| format!("{} {}", field(r, "label"), field(r, "status")))
            .collect();
        Ok(format!(
            "graph: {}; unique constraints on {} of {} labels{}",
            if doubled.is_empty() {
                "no key held by two nodes".to_owned()
            } else {
                format!("keys held twice: {}", doubled.join(", "))
            },
            constraints.len(),
            graph::schema::KEYS.len(),
            if unready.is_empty() {
                String::new()
            } else {
                format!(" ({})", unready.join(", "))
            }
        ))
    }

    /// Which of the tenant's events the graph's checkpoints do not list:
    /// the ids to look for in the relays' logs and the broker, where a
    /// shape alone says only what is missing from a node. A product's
    /// checkpoint is a window (docs/adr/0030), so stock adjustments are
    /// left out.
    async fn graph_missing(
        &self,
        graph: &std::sync::Arc<graph::store::Store>,
        tenant: i64,
    ) -> anyhow::Result<String> {
        let id = reliability::TenantId::new(tenant)?;
        let mut params = graph::store::Params::new();
        params.insert(
            "consumer".into(),
            contracts::topology::GRAPH_EDGES.consumer.into(),
        );
        let rows = graph
            .read(
                id,
                graph::store::Cypher(
                    "MATCH (k:Checkpoint {tenant: $tenant, consumer: $consumer})
                     RETURN k.source AS source, k.messages AS messages",
                ),
                params,
            )
            .await?;
        let mut listed = std::collections::HashSet::new();
        for row in rows {
            let source = row
                .get("source")
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            for m in row
                .get("messages")
                .and_then(|v| v.as_array())
                .into_iter()
                .flatten()
            {
                listed.insert((source.to_owned(), m.as_i64().unwrap_or_default()));
            }
        }
        let mut missing = Vec::new();
        for (source, pool) in [
            ("orders", &self.orders),
            ("inventory", &self.inventory),
            ("payments", &self.payments),
        ] {
            let events: Vec<(i64, String, String)> = sqlx::query_as(
                "SELECT id, event_type, aggregate_type || ':' || aggregate_id FROM outbox_messages
                 WHERE tenant_id = $1 AND event_type <> 'StockAdjusted' ORDER BY id",
            )
            .bind(tenant)
            .fetch_all(pool)
            .await?;
            for (id, event_type, aggregate) in events {
                if !listed.contains(&(source.to_owned(), id)) {
                    missing.push(format!("{source}:{id} {event_type} of {aggregate}"));
                }
            }
        }
        Ok(if missing.is_empty() {
            "graph: every event of the tenant's outboxes applied".into()
        } else {
            format!(
                "graph: {} events of the tenant's outboxes never applied: {}",
                missing.len(),
                missing.join(", ")
            )
        })
    }

    fn sources(&self) -> sources::Sources {
        sources::Sources {
            orders: self.orders.clone(),
            inventory: self.inventory.clone(),
            payments: self.payments.clone(),
        }
    }
}

/// `entities`, the first few by name.
fn named(entities: &[String]) -> String {
    const SHOWN: usize = 6;
    match entities {
        [one] => one.clone(),
        many if many.len() <= SHOWN => format!("{} ({})", many.len(), many.join(", ")),
        many => format!("{} ({}, ...)", many.len(), many[..SHOWN].join(", ")),
    }
}
