//! Integration tests of libs/reliability against the real PostgreSQL and
//! RabbitMQ (`DATABASE_URL`, `AMQP_URL`). Each test makes its own database
//! and its own exchange and queues.

mod consumer;
mod frozen;
mod ordered;
mod relay;
mod roles;
mod support;
mod tenancy;
mod tls;
mod topology;
