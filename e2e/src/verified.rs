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
        Ok(report
            .differences
            .into_iter()
            .map(|d| format!("graph verify: {} {}: {}", d.view, d.entity, d.detail))
            .collect())
    }

    fn sources(&self) -> sources::Sources {
        sources::Sources {
            orders: self.orders.clone(),
            inventory: self.inventory.clone(),
            payments: self.payments.clone(),
        }
    }
}
