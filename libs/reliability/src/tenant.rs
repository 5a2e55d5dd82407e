//! Tenant identity and tenant-scoped transactions (invariant I7).
//!
//! Row-level security reads `app.tenant_id` from the transaction. [`TenantTx`]
//! is the only way this crate hands out a transaction for tenant data, and it
//! sets the tenant with `set_config(.., true)`: transaction-local, so a pooled
//! connection can never carry a tenant into the next request.

use std::fmt;
use std::ops::{Deref, DerefMut};

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

/// A tenant: a positive integer, as carried in the JWT `tenant_id` claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "i64", into = "i64")]
pub struct TenantId(i64);

#[derive(Debug, thiserror::Error)]
#[error("tenant id must be a positive integer, got {0}")]
pub struct InvalidTenantId(i64);

impl TenantId {
    pub fn new(id: i64) -> Result<Self, InvalidTenantId> {
        if id > 0 {
            Ok(Self(id))
        } else {
            Err(InvalidTenantId(id))
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

impl TryFrom<i64> for TenantId {
    type Error = InvalidTenantId;
    fn try_from(id: i64) -> Result<Self, Self::Error> {
        Self::new(id)
    }
}

impl From<TenantId> for i64 {
    fn from(t: TenantId) -> i64 {
        t.0
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A transaction in which row-level security sees exactly one tenant.
///
/// Derefs to `PgConnection`, so queries run on `&mut *tx`. Dropping it
/// without [`TenantTx::commit`] rolls back.
pub struct TenantTx {
    tx: Transaction<'static, Postgres>,
    tenant: TenantId,
}

impl TenantTx {
    pub async fn begin(pool: &PgPool, tenant: TenantId) -> sqlx::Result<Self> {
        // One round trip, not two: the tenant is set by the statement that
        // opens the transaction (a simple query; BEGIN keeps the block open
        // past it). The value is an integer, formatted here, never text
        // from outside. sqlx's begin reads past the SELECT's replies, an
        // error among them; set_config of an integer cannot fail, and if it
        // did the block would be aborted: the first statement in it fails,
        // none runs without its tenant.
        let tx = pool
            .begin_with(sqlx::AssertSqlSafe(format!(
                "BEGIN; SELECT set_config('app.tenant_id', '{}', true)",
                tenant.get()
            )))
            .await?;
        Ok(Self { tx, tenant })
    }

    /// As [`Self::begin`], then takes the transaction-scoped advisory
    /// locks `locks` in ascending order (the lock order of every applier),
    /// in a statement of their own. Every later statement's snapshot is
    /// then taken with them held, so it may read and write what they guard
    /// in one go (docs/adr/0028). The keys are integers, formatted here.
    ///
    /// Why not in the statement that opens the transaction, one round trip
    /// fewer: sqlx counts a transaction only once its opening statement
    /// succeeded. A lock wait that failed there (past `lock_timeout`) left
    /// the connection in an aborted transaction that sqlx did not know of,
    /// so it went back to the pool as it was, and every later user of it
    /// failed with 25P02 (docs/adr/0034). Here a failed wait drops a
    /// transaction sqlx knows, and the connection is rolled back before
    /// the pool hands it out again.
    pub(crate) async fn begin_locked(
        pool: &PgPool,
        tenant: TenantId,
        locks: &[i64],
    ) -> sqlx::Result<Self> {
        let mut tx = Self::begin(pool, tenant).await?;
        let mut keys: Vec<i64> = locks.to_vec();
        keys.sort_unstable();
        keys.dedup();
        if !keys.is_empty() {
            sqlx::query(
                "SELECT count(*) FROM (SELECT pg_advisory_xact_lock(k)
                                       FROM unnest($1::bigint[]) AS u(k) ORDER BY k) AS l",
            )
            .bind(&keys)
            .execute(&mut *tx)
            .await?;
        }
        Ok(tx)
    }

    pub fn tenant(&self) -> TenantId {
        self.tenant
    }

    /// Moves the open transaction to another tenant. Only the consumer
    /// runtime does this, when it applies a group of waiting deliveries in
    /// one transaction (one commit for the group), each under its own tenant.
    pub(crate) async fn rescope(&mut self, tenant: TenantId) -> sqlx::Result<()> {
        if tenant != self.tenant {
            set_tenant(&mut self.tx, tenant).await?;
            self.tenant = tenant;
        }
        Ok(())
    }

    pub async fn commit(self) -> sqlx::Result<()> {
        self.tx.commit().await
    }

    pub async fn rollback(self) -> sqlx::Result<()> {
        self.tx.rollback().await
    }
}

impl Deref for TenantTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for TenantTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

/// Sets the tenant for the rest of the current transaction only.
async fn set_tenant(conn: &mut PgConnection, tenant: TenantId) -> sqlx::Result<()> {
    sqlx::query("SELECT set_config('app.tenant_id', $1, true)")
        .bind(tenant.get().to_string())
        .execute(conn)
        .await?;
    Ok(())
}
