//! Reconciliation: the provider's own lists of charges and refunds against
//! our payments and refunds, as payment teams run it daily, repaired where
//! a rule says how (invariant I4; docs/adr/0011).
//!
//! - a charge the provider made for a payment we failed (the order was
//!   cancelled) and did not refund in full: a refund of the rest by the
//!   charge's key (`charge_without_order`, repaired);
//! - a refund the provider made that we think failed: marked succeeded,
//!   its amount counted again, `RefundIssued` emitted (`refund_marked_failed`,
//!   repaired);
//! - a payment we captured with no succeeded charge at the provider
//!   (`captured_without_charge`), a succeeded refund of ours the provider
//!   never made (`refund_without_provider_refund`), a key the provider holds
//!   that we never issued (`unknown_key`): alerts for a person.
//!
//! Runs as the owner role (every tenant's rows), takes no transaction
//! across a provider call, and is safe beside another run of itself: each
//! repair locks its payment and re-reads our side before it writes.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::Utc;
use reliability::Result;
use serde::Serialize;
use sqlx::PgPool;

use crate::provider::{ChargeRecord, HasKey, Psp, RefundRecord, Reply};

mod repair;

/// A charge's or refund's status, as a look-up by key answers it.
#[derive(serde::Deserialize)]
struct Status {
    status: String,
}

pub const MISMATCHES: &str = "payments_reconciliation_mismatches_total";
pub const REPAIRS: &str = "payments_reconciliation_repairs_total";
pub const LAST_SUCCESS: &str = "payments_reconciliation_last_success_timestamp_seconds";

/// One difference between the provider's books and ours.
#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    pub kind: &'static str,
    /// The provider's idempotency key it concerns.
    pub key: String,
    pub detail: String,
    pub repaired: bool,
}

impl Mismatch {
    fn found(kind: &'static str, key: &str, detail: String, repaired: bool) -> Option<Self> {
        Some(Self {
            kind,
            key: key.to_owned(),
            detail,
            repaired,
        })
    }
}

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub charges_seen: usize,
    pub refunds_seen: usize,
    pub mismatches: Vec<Mismatch>,
}

pub struct Reconciler {
    /// The owner role: every tenant's payments.
    owner: PgPool,
    psp: Psp,
    /// How far back the provider's lists are read.
    window: Duration,
}

/// `pay-<tenant>-<payment_id>` or `refund-<tenant>-<refund_id>`, with a
/// valid tenant: anything else at the provider is a key we never issued.
fn parse_key(key: &str, prefix: &str) -> Option<(i64, i64)> {
    let (tenant, id) = key.strip_prefix(prefix)?.split_once('-')?;
    let tenant = reliability::TenantId::new(tenant.parse().ok()?).ok()?;
    Some((tenant.get(), id.parse().ok()?))
}

impl Reconciler {
    pub fn new(owner: PgPool, psp: Psp, window: Duration) -> Self {
        Self { owner, psp, window }
    }

    /// One pass over the window; with `repair` false it only reports.
    pub async fn run_once(&self, repair: bool) -> Result<Report> {
        let since = Utc::now() - self.window;
        let charges: Vec<ChargeRecord> = self
            .psp
            .list("/charges", since)
            .await
            .map_err(reliability::Error::Upstream)?;
        let refunds: Vec<RefundRecord> = self
            .psp
            .list("/refunds", since)
            .await
            .map_err(reliability::Error::Upstream)?;
        let mut report = Report {
            charges_seen: charges.len(),
            refunds_seen: refunds.len(),
            ..Report::default()
        };
        // Our side of the whole list in one read; a row is locked and
        // judged one by one only where the two books may disagree.
        let ours = self
            .statuses("payments", "payment_id", &charges, "pay-")
            .await?;
        for c in &charges {
            let candidate = match parse_key(&c.key, "pay-").and_then(|k| ours.get(&k)) {
                None => true,
                Some(status) => matches!(
                    (c.status.as_str(), status.as_str()),
                    ("succeeded", "failed") | ("declined" | "failed", "captured")
                ),
            };
            if candidate && let Some(m) = self.charge(c, repair).await? {
                report.mismatches.push(m);
            }
        }
        report.mismatches.extend(self.books(since, repair).await?);
        let listed: HashSet<&str> = charges.iter().map(|c| c.key.as_str()).collect();
        let captured = (
            "SELECT tenant_id, payment_id FROM payments WHERE status = 'captured' AND first_attempt_at >= $1",
            "/charges",
            "captured_without_charge",
        );
        report.mismatches.extend(
            self.missing_at_provider(captured, contracts::provider::charge_key, since, &listed)
                .await?,
        );
        let ours = self
            .statuses("refunds", "refund_id", &refunds, "refund-")
            .await?;
        for r in &refunds {
            let candidate = match parse_key(&r.key, "refund-").and_then(|k| ours.get(&k)) {
                None => true,
                Some(status) => r.status == "succeeded" && status == "failed",
            };
            if candidate && let Some(m) = self.refund(r, repair).await? {
                report.mismatches.push(m);
            }
        }
        let listed: HashSet<&str> = refunds.iter().map(|r| r.key.as_str()).collect();
        let refunded = (
            "SELECT tenant_id, refund_id FROM refunds WHERE status = 'succeeded' AND created_at >= $1",
            "/refunds",
            "refund_without_provider_refund",
        );
        report.mismatches.extend(
            self.missing_at_provider(refunded, contracts::provider::refund_key, since, &listed)
                .await?,
        );
        for m in &report.mismatches {
            metrics::counter!(MISMATCHES, "kind" => m.kind).increment(1);
            if m.repaired {
                metrics::counter!(REPAIRS, "kind" => m.kind).increment(1);
            }
            tracing::warn!(kind = m.kind, key = %m.key, repaired = m.repaired, "{}", m.detail);
        }
        metrics::gauge!(LAST_SUCCESS).set(Utc::now().timestamp() as f64);
        Ok(report)
    }

    /// Runs a pass every `interval` until `shutdown`; a failed pass is
    /// logged and the next one comes on time.
    pub async fn run(&self, interval: Duration, shutdown: service_kit::service::ShutdownToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            match self.run_once(true).await {
                Ok(r) => tracing::info!(
                    charges = r.charges_seen,
                    refunds = r.refunds_seen,
                    mismatches = r.mismatches.len(),
                    "reconciled with the provider"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "reconciliation failed; next pass on schedule")
                }
            }
        }
    }

    /// Our status of every listed item (`table` keyed by tenant and
    /// `id_column`), in one statement.
    async fn statuses<T: HasKey>(
        &self,
        table: &'static str,
        id_column: &'static str,
        listed: &[T],
        prefix: &str,
    ) -> Result<HashMap<(i64, i64), String>> {
        let (tenants, ids): (Vec<i64>, Vec<i64>) = listed
            .iter()
            .filter_map(|item| parse_key(item.key(), prefix))
            .unzip();
        // Table and column are the constants of the two call sites.
        let rows: Vec<(i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT t.tenant_id, t.{id_column}, t.status FROM {table} t
             JOIN unnest($1::bigint[], $2::bigint[]) AS k (tenant_id, id)
               ON t.tenant_id = k.tenant_id AND t.{id_column} = k.id"
        )))
        .bind(&tenants)
        .bind(&ids)
        .fetch_all(&self.owner)
        .await?;
        Ok(rows.into_iter().map(|(t, id, s)| ((t, id), s)).collect())
    }

    /// Rows of ours (`sql`: tenant and id, from `since`) that the
    /// provider's list does not hold (a listed one was judged above), each
    /// confirmed by a look-up by key, since the window's edges differ by a
    /// clock's width: anything but `succeeded` there is a `kind` mismatch.
    async fn missing_at_provider(
        &self,
        (sql, path, kind): (&'static str, &str, &'static str),
        key_of: fn(i64, i64) -> String,
        since: chrono::DateTime<Utc>,
        listed: &HashSet<&str>,
    ) -> Result<Vec<Mismatch>> {
        let ours: Vec<(i64, i64)> = sqlx::query_as(sql)
            .bind(since)
            .fetch_all(&self.owner)
            .await?;
        let mut found = Vec::new();
        for (tenant, id) in ours {
            let key = key_of(tenant, id);
            if listed.contains(key.as_str()) {
                continue;
            }
            // A look-up that fails is asked again next pass.
            if let Reply::Done(answer) = self.psp.lookup::<Status>(path, &key).await
                && answer.as_ref().is_none_or(|a| a.status != "succeeded")
            {
                found.push(Mismatch {
                    kind,
                    detail: format!(
                        "{id} is {} here; the provider has {}",
                        if path == "/charges" {
                            "captured"
                        } else {
                            "a succeeded refund"
                        },
                        answer.map_or("nothing".into(), |a| a.status)
                    ),
                    key,
                    repaired: false,
                });
            }
        }
        Ok(found)
    }
}
