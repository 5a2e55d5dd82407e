#![doc = include_str!("../README.md")]

pub mod admission;
pub mod auth;
pub mod bindings;
mod defaults;
pub mod http;
pub mod idempotency;
pub mod metrics;
pub mod rate_limit;
pub mod secret;
pub mod service;
