//! The provider's books: charges and refunds by idempotency key, what each
//! key was first asked with, and the requests still being processed. Real
//! providers differ from a function call in exactly the ways kept here: a
//! charge can be `pending` and settle later, a request can land after its
//! caller gave up, and a look-up in between finds nothing.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::Faults;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Charge {
    pub charge_id: String,
    /// The idempotency key it was made under.
    pub key: String,
    /// `pending`, `succeeded`, `declined` or `failed`.
    pub status: String,
    pub amount_cents: i64,
    pub currency: String,
    pub customer_id: String,
    /// Refunded so far; never above `amount_cents`.
    pub refunded_cents: i64,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Refund {
    pub refund_id: String,
    pub key: String,
    pub charge_id: String,
    /// The key of the charge it refunds.
    pub charge_key: String,
    pub status: String,
    pub amount_cents: i64,
    pub created_at: DateTime<Utc>,
}

/// One key's money, as the e2e checker and the model test read it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyMoney {
    pub key: String,
    pub status: String,
    pub amount_cents: i64,
    /// What the customer paid under this key (0 unless it succeeded).
    pub charged_cents: i64,
    pub refunded_cents: i64,
    /// Times money moved under the key; above 1 is a double charge.
    pub times_charged: u32,
}

#[derive(Default)]
pub(crate) struct Ledger {
    pub charges: HashMap<String, Charge>,
    pub refunds: HashMap<String, Refund>,
    /// The parameters each key was first used with (`charge:KEY`,
    /// `refund:KEY`): the same key with others is 409.
    pub requests: HashMap<String, serde_json::Value>,
    /// Charges accepted but not landed yet: invisible to look-ups and
    /// lists, and a replay of the key is 409 (in progress).
    pub landing: HashMap<String, PendingCharge>,
    /// Keys of pending charges and when they settle on their own.
    pub settling: HashSet<String>,
    /// How many times a key made money move. Above 1 would be a double charge.
    pub times_charged: HashMap<String, u32>,
    pub times_refunded: HashMap<String, u32>,
    pub faults: Faults,
    /// Charge and refund calls being served now, and the most at once:
    /// overall and per key prefix (`pay-<tenant>`: per tenant of ours).
    pub in_flight: HashMap<String, u32>,
    pub peak_in_flight: HashMap<String, u32>,
    /// The last `traceparent` each key's charge or refund came with.
    pub traceparents: HashMap<String, String>,
}

/// A charge request the provider is still processing.
#[derive(Debug, Clone)]
pub(crate) struct PendingCharge {
    pub amount_cents: i64,
    pub currency: String,
    pub customer_id: String,
    pub created_at: DateTime<Utc>,
    /// The request's `X-Not-After`: past it, the charge never lands.
    pub not_after: Option<DateTime<Utc>>,
}

impl Ledger {
    /// Books a charge under `key` with `status`; counts the money if it moved.
    pub fn book(&mut self, key: &str, p: PendingCharge, status: &str) -> Charge {
        let charge = Charge {
            charge_id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
            key: key.to_owned(),
            status: status.to_owned(),
            amount_cents: p.amount_cents,
            currency: p.currency,
            customer_id: p.customer_id,
            refunded_cents: 0,
            created_at: p.created_at,
        };
        self.charges.insert(key.to_owned(), charge.clone());
        if status == "succeeded" {
            *self.times_charged.entry(key.to_owned()).or_default() += 1;
        }
        charge
    }

    /// Lands a late charge (once): declined customers stay declined, and
    /// one past its request's `X-Not-After` is dropped, nothing booked.
    pub fn land(&mut self, key: &str) {
        if let Some(p) = self.landing.remove(key) {
            if p.not_after.is_some_and(|t| Utc::now() > t) {
                return;
            }
            let status = if p.customer_id.starts_with("decline") {
                "declined"
            } else {
                "succeeded"
            };
            self.book(key, p, status);
        }
    }

    /// Settles a pending charge (once): to `succeeded`, or `failed`.
    pub fn settle(&mut self, key: &str, fail: bool) {
        if !self.settling.remove(key) {
            return;
        }
        let Some(c) = self.charges.get_mut(key) else {
            return;
        };
        if c.status != "pending" {
            return;
        }
        if fail || c.customer_id.starts_with("decline") {
            c.status = "failed".into();
        } else {
            c.status = "succeeded".into();
            *self.times_charged.entry(key.to_owned()).or_default() += 1;
        }
    }

    /// Everything still in progress lands or settles now.
    pub fn settle_all(&mut self) {
        let landing: Vec<String> = self.landing.keys().cloned().collect();
        for key in landing {
            self.land(&key);
        }
        let settling: Vec<String> = self.settling.iter().cloned().collect();
        for key in settling {
            self.settle(&key, false);
        }
    }

    /// Whether `key` was first used with other parameters.
    pub fn reused(&mut self, scope: &str, key: &str, params: serde_json::Value) -> bool {
        let first = self
            .requests
            .entry(format!("{scope}:{key}"))
            .or_insert_with(|| params.clone());
        *first != params
    }

    pub fn money(&self) -> Vec<KeyMoney> {
        let mut all: Vec<KeyMoney> = self
            .charges
            .values()
            .map(|c| KeyMoney {
                key: c.key.clone(),
                status: c.status.clone(),
                amount_cents: c.amount_cents,
                charged_cents: if c.status == "succeeded" {
                    c.amount_cents
                } else {
                    0
                },
                refunded_cents: c.refunded_cents,
                times_charged: self.times_charged.get(&c.key).copied().unwrap_or(0),
            })
            .collect();
        all.sort_by(|a, b| a.key.cmp(&b.key));
        all
    }
}

/// A page of a list by creation time, in (created_at, key) order.
#[derive(Debug, Serialize, Deserialize)]
pub struct Page<T> {
    pub data: Vec<T>,
    pub has_more: bool,
}

/// Query of `GET /charges` and `GET /refunds`, as real providers' list APIs
/// take it: a creation-time window, a page size and a cursor.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ListQuery {
    pub created_gte: Option<DateTime<Utc>>,
    pub created_lt: Option<DateTime<Utc>>,
    pub limit: Option<usize>,
    /// The key of the last item of the previous page.
    pub starting_after: Option<String>,
}

impl ListQuery {
    pub fn page<T: Clone>(
        &self,
        items: impl Iterator<Item = T>,
        at: impl Fn(&T) -> (DateTime<Utc>, String),
    ) -> Page<T> {
        let mut all: Vec<T> = items
            .filter(|i| {
                let (t, _) = at(i);
                self.created_gte.is_none_or(|g| t >= g) && self.created_lt.is_none_or(|l| t < l)
            })
            .collect();
        all.sort_by_key(|i| at(i));
        if let Some(after) = &self.starting_after
            && let Some(pos) = all.iter().position(|i| &at(i).1 == after)
        {
            all.drain(..=pos);
        }
        let limit = self.limit.unwrap_or(100).clamp(1, 1000);
        let has_more = all.len() > limit;
        all.truncate(limit);
        Page {
            data: all,
            has_more,
        }
    }
}
