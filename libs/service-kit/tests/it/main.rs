//! Integration tests of the service kit against the real PostgreSQL
//! (`DATABASE_URL`): auth, and Idempotency-Keys with their limits. Each
//! test makes its own database.

mod auth;
mod bindings;
mod idempotency;

mod support {
    pub use testkit::{DEADLINE, tenant};
}
