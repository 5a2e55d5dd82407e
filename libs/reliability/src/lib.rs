//! The reliability patterns every commerce service stands on, so a service is
//! only a router, handlers, consumers and its domain SQL.
//!
//! It owns:
//! - [`tenant`]: tenant-scoped transactions (row-level security's setting);
//! - [`outbox`]: writing events in the caller's transaction, and their wire form;
//! - [`relay`]: publishing the outbox to RabbitMQ with confirms (at least once);
//! - [`consumer`]: applying each delivered event exactly once;
//! - [`idempotency`]: the `Idempotency-Key` contract for axum handlers;
//! - [`auth`], [`http`]: bearer-token tenants and the JSON error shape;
//! - [`service`]: settings, the HTTP stack, ops routes and task runner of a service binary;
//! - [`trace`]: W3C trace context from request to event to consumer;
//! - [`maintenance`], [`metrics`], [`db`], [`broker`]: the plumbing around them.
//!
//! The invariants these serve are in `ARCHITECTURE.md`; each module says which.

pub mod admission;
pub mod auth;
pub mod broker;
pub mod consumer;
pub mod db;
mod error;
pub mod failpoint;
pub mod health;
pub mod http;
pub mod idempotency;
pub mod maintenance;
pub mod metrics;
pub mod ops;
pub mod outbox;
pub mod rate_limit;
pub mod relay;
pub mod service;
pub mod shutdown;
pub mod supervise;
pub mod tenant;
#[cfg(feature = "testing")]
pub mod testing;
pub mod trace;

pub use error::{Error, Result};

pub use tenant::{TenantId, TenantTx};
