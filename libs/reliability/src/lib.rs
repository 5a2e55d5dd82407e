#![doc = include_str!("../README.md")]

pub mod broker;
pub mod consumer;
pub mod db;
mod error;
pub mod failpoint;
pub mod health;
pub mod metrics;
pub mod outbox;
pub mod relay;
pub mod shutdown;
pub mod supervise;
pub mod tenant;
pub mod trace;

pub use error::{Error, Result};

pub use tenant::{TenantId, TenantTx};
