#![doc = include_str!("../README.md")]

mod doubt;
mod floor;
mod orders;
mod refunds;
mod snapshot;
mod stock;
mod tallies;
pub mod verify;

use std::collections::HashMap;

use reliability::{Result, db};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

pub use doubt::{InDoubt, in_doubt};
pub use floor::{FLOOR_WAIT, floor, floors};
pub use orders::{Line, Order, Payment, Refund, Reservation, order, orders_after};
pub use refunds::{FailedRefunds, failed_refunds};
pub use snapshot::{Floors, Reflected, Snapshot, chunk, snapshot};
pub use stock::{Stock, stock_after};
pub use tallies::{Tally, customers, tenants, units_ordered};
pub use verify::{Difference, VerifySettings};

/// The source databases, each opened as its owner role.
#[derive(Clone)]
pub struct Sources {
    pub orders: PgPool,
    pub inventory: PgPool,
    pub payments: PgPool,
}

impl Sources {
    /// From `orders=URL,inventory=URL,payments=URL`: each source's
    /// database, opened as the owner role (every tenant's rows) whatever
    /// user the URL names. The pools connect on first use, so a source
    /// that is down fails a pass, not the process.
    pub fn lazy(items: &[String]) -> Result<Self> {
        let mut named = HashMap::new();
        for item in items {
            let (name, url) = item.split_once('=').ok_or_else(|| {
                reliability::Error::Config(format!("expected name=url, got `{item}`"))
            })?;
            let base: PgConnectOptions = url
                .parse()
                .map_err(|e| reliability::Error::Config(format!("{name}'s URL: {e}")))?;
            let options = db::options_for_role(&base, db::OWNER_ROLE);
            named.insert(
                name.to_owned(),
                db::pool_options()
                    .max_connections(2)
                    .connect_lazy_with(options),
            );
        }
        let mut take = |name: &str| {
            named.remove(name).ok_or_else(|| {
                reliability::Error::Config(format!(
                    "verification needs the {name} database: {name}=postgres://…"
                ))
            })
        };
        Ok(Self {
            orders: take(contracts::source::ORDERS)?,
            inventory: take(contracts::source::INVENTORY)?,
            payments: take(contracts::source::PAYMENTS)?,
        })
    }

    /// Each source database by its name, for the event history a repair reads.
    pub fn named(&self) -> [(&'static str, &PgPool); 3] {
        [
            (contracts::source::ORDERS, &self.orders),
            (contracts::source::INVENTORY, &self.inventory),
            (contracts::source::PAYMENTS, &self.payments),
        ]
    }
}

/// What a rebuild of a derived view reads (`--rebuild-with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RebuildWith {
    /// The sources' current rows, at any age, then what arrives after.
    Rows,
    /// Every event the outboxes and their archives still hold (90 days).
    History,
}

/// An order's key: its tenant and its id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Key {
    pub tenant_id: i64,
    pub order_id: i64,
}

impl Key {
    pub fn new(tenant_id: i64, order_id: i64) -> Self {
        Self {
            tenant_id,
            order_id,
        }
    }

    /// The key just before this one in its tenant: a walk after it starts
    /// at this one (saturating: no id makes it overflow).
    pub fn before(self) -> Key {
        Key {
            order_id: self.order_id.saturating_sub(1),
            ..self
        }
    }

    /// Past every key: the end of a walk.
    pub const END: Key = Key {
        tenant_id: i64::MAX,
        order_id: i64::MAX,
    };
}
