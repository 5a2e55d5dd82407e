//! `projection verify` as the last check of an e2e run (docs/adr/0035).

use crate::check::Dbs;

impl Dbs {
    /// `projection verify` over the whole run (docs/adr/0035): every order
    /// view equals what the sources' rows say, every ordered history is in
    /// its order. Run once all is quiet, so with no grace.
    pub async fn views_verified(&self) -> anyhow::Result<Vec<String>> {
        let sources = projection::verify::Sources {
            orders: self.orders.clone(),
            inventory: self.inventory.clone(),
            payments: self.payments.clone(),
        };
        let verifier = projection::verify::Verifier::new(
            self.projection.clone(),
            sources,
            std::time::Duration::ZERO,
            projection::VERIFY_CHUNK,
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
}
