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
        let mut found: Vec<String> = report
            .differences
            .into_iter()
            .map(|d| format!("graph verify: {} {}: {}", d.view, d.entity, d.detail))
            .collect();
        if !found.is_empty() {
            found.push(match self.graph_missing(graph, tenant).await {
                Ok(missing) => missing,
                Err(e) => format!("graph: the events it lacks not listed ({e:#})"),
            });
        }
        Ok(found)
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
        Ok(format!(
            "graph: {} events of the tenant's outboxes never applied: {}",
            missing.len(),
            missing.join(", ")
        ))
    }

    fn sources(&self) -> sources::Sources {
        sources::Sources {
            orders: self.orders.clone(),
            inventory: self.inventory.clone(),
            payments: self.payments.clone(),
        }
    }
}
