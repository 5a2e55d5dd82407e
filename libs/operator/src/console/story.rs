//! An order's story: `explain order` as a page.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use reliability::TenantId;
use serde::Deserialize;

use super::Console;
use super::pages::{html, refused};
use crate::ops::{self, commerce};

#[derive(Deserialize)]
pub struct OrderQuery {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    id: String,
}

struct EventRow {
    source: String,
    id: i64,
    event_type: String,
    occurred_at: String,
    at: String,
    attempts: i32,
    last_error: String,
    trace_id: String,
    deliveries: Vec<(String, String)>,
}

#[derive(Template)]
#[template(path = "order.html")]
struct OrderPage {
    title: String,
    stuck: Option<String>,
    rows: Vec<(String, String, String)>,
    events: Vec<EventRow>,
    provider: Vec<(String, String, String)>,
}

/// An order's story: its rows in every service, each event that names it
/// and where each subscriber has it, and the provider's record of its
/// payments and refunds beside ours.
pub async fn order(State(console): State<Arc<Console>>, Query(q): Query<OrderQuery>) -> Response {
    let (Ok(tenant), Ok(id)) = (q.tenant.trim().parse::<i64>(), q.id.trim().parse::<i64>()) else {
        return refused(
            StatusCode::BAD_REQUEST,
            "a tenant and an order id are numbers",
        );
    };
    let Ok(tenant) = TenantId::new(tenant) else {
        return refused(StatusCode::BAD_REQUEST, "a tenant id is positive");
    };
    let estate = &console.estate;
    let explained = ops::explain::explain(estate, tenant, "order_id", id, commerce::ORDER_TABLES);
    let mut e = match explained.await {
        Ok(e) => e,
        Err(err) => return refused(StatusCode::BAD_GATEWAY, &format!("{err:#}")),
    };
    if e.rows.is_empty() && e.events.is_empty() {
        let why = format!("tenant {tenant} has no order {id} in any service");
        return refused(StatusCode::NOT_FOUND, &why);
    }
    if let Err(err) = ops::explain::related_rows(estate, commerce::ORDER_RELATED, &mut e).await {
        return refused(StatusCode::BAD_GATEWAY, &format!("{err:#}"));
    }
    let items = commerce::ORDER_PROVIDER_ITEMS;
    if let Err(err) = ops::explain::provider_view(estate, &console.psp_url, items, &mut e).await {
        e.provider.push(ops::explain::ProviderView {
            key: "—".into(),
            ours: "—".into(),
            provider: None,
            error: Some(format!("{err:#}")),
        });
    }
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    html(&OrderPage {
        title: format!("Order {id} of tenant {tenant}"),
        stuck: e.stuck,
        rows: e
            .rows
            .iter()
            .map(|r| (r.service.clone(), r.table.clone(), pretty(&r.row)))
            .collect(),
        events: e
            .events
            .into_iter()
            .map(|ev| EventRow {
                deliveries: ev
                    .deliveries
                    .into_iter()
                    .map(|d| (d.consumer, d.state))
                    .collect(),
                source: ev.source,
                id: ev.id,
                event_type: ev.event_type,
                occurred_at: ev.occurred_at.format("%F %T%.3f UTC").to_string(),
                at: ev.at,
                attempts: ev.attempts,
                last_error: ev.last_error.unwrap_or_default(),
                trace_id: ev.trace_id.unwrap_or_default(),
            })
            .collect(),
        provider: e
            .provider
            .iter()
            .map(|p| {
                let theirs = p.provider.as_ref().map_or_else(
                    || {
                        p.error
                            .clone()
                            .unwrap_or_else(|| "nothing under this key".into())
                    },
                    pretty,
                );
                (p.key.clone(), p.ours.clone(), theirs)
            })
            .collect(),
    })
}
