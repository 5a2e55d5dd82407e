//! Leasing due work: payments and refunds, round-robin across tenants,
//! each payment with its row as the claim left it (payments migration
//! 1007).

use std::collections::HashMap;

use reliability::{Error, Result, TenantId};

use super::{Worker, charge, tenant_id};

/// One claimed piece of work: a payment or refund, and which attempt at
/// it this is (the claim numbered it); a payment with its row as the
/// claim left it.
pub(super) enum Work {
    Charge(TenantId, i64, i32, Box<charge::Payment>),
    Refund(TenantId, i64, i32),
}

/// A row of `claim_due_work`: the charge's columns are NULL for a refund.
#[derive(sqlx::FromRow)]
struct Claimed {
    kind: String,
    tenant_id: i64,
    id: i64,
    attempt: i32,
    order_id: Option<i64>,
    customer_id: Option<String>,
    amount_cents: Option<i64>,
    currency: Option<String>,
    outcome_unknown: Option<bool>,
    traceparent: Option<String>,
    expired: Option<bool>,
    not_after: Option<chrono::DateTime<chrono::Utc>>,
}

impl Claimed {
    fn into_work(self) -> Result<Work> {
        let tenant = tenant_id(self.tenant_id)?;
        if self.kind != "charge" {
            return Ok(Work::Refund(tenant, self.id, self.attempt));
        }
        let missing = || {
            Error::Database(sqlx::Error::Protocol(
                "claim_due_work returned a charge without its row".into(),
            ))
        };
        let leased = charge::Payment {
            order_id: self.order_id.ok_or_else(missing)?,
            customer_id: self.customer_id.ok_or_else(missing)?,
            amount_cents: self.amount_cents.ok_or_else(missing)?,
            currency: self.currency.ok_or_else(missing)?,
            outcome_unknown: self.outcome_unknown.ok_or_else(missing)?,
            not_after: self.not_after.ok_or_else(missing)?,
            expired: self.expired.ok_or_else(missing)?,
            traceparent: self.traceparent,
        };
        Ok(Work::Charge(
            tenant,
            self.id,
            self.attempt,
            Box::new(leased),
        ))
    }
}

impl Work {
    pub(super) fn tenant(&self) -> TenantId {
        match self {
            Self::Charge(t, ..) | Self::Refund(t, ..) => *t,
        }
    }
}

impl Worker {
    /// Leases up to `free` due payments and refunds, round-robin across
    /// tenants, counting each tenant's calls of either kind already in
    /// flight; rows another worker is claiming are skipped, not waited on.
    pub(super) async fn claim(
        &self,
        free: usize,
        busy: &HashMap<TenantId, usize>,
    ) -> Result<Vec<Work>> {
        if free == 0 {
            return Ok(Vec::new());
        }
        let tenants: Vec<i64> = busy.keys().map(|t| t.get()).collect();
        let counts: Vec<i32> = busy.values().map(|&n| n as i32).collect();
        let rows: Vec<Claimed> =
            sqlx::query_as("SELECT * FROM claim_due_work($1, $2, $3, $4, $5, $6)")
                .bind(free as i32)
                .bind(self.config.tenant_share as i32)
                .bind(&tenants)
                .bind(&counts)
                .bind(self.config.lease.as_secs_f64())
                .bind(self.config.deadline.as_secs_f64())
                .fetch_all(&self.pool)
                .await?;
        rows.into_iter().map(Claimed::into_work).collect()
    }
}
