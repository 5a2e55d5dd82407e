//! `GET /orders/{order_id}`: the order as the events tell it;
//! `GET /history/{aggregate_type}/{aggregate_id}`: an order's or a
//! product's events in the order they happened.

use axum::Json;
use axum::extract::{Path, State};
use chrono::{DateTime, Utc};
use serde::Serialize;
use service_kit::auth::Tenant;
use service_kit::http::read_one;
use service_kit::service::ApiState;
use sqlx::{PgConnection, PgPool};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::Error;

pub fn router(state: ApiState) -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(get_order))
        .routes(routes!(get_history))
        .with_state(state)
}

#[derive(Debug, PartialEq, Serialize, sqlx::FromRow, ToSchema)]
pub struct OrderView {
    pub order_id: i64,
    pub status: String,
    pub total_cents: Option<i64>,
    pub currency: Option<String>,
    pub payment_status: String,
    pub reservation_status: String,
    pub refunded_cents: i64,
    #[sqlx(skip)]
    pub events: Vec<EventView>,
}

#[derive(Debug, PartialEq, Serialize, sqlx::FromRow, ToSchema)]
pub struct EventView {
    #[serde(rename = "type")]
    pub event_type: String,
    pub source: String,
    pub occurred_at: DateTime<Utc>,
}

#[utoipa::path(get, path = "/orders/{order_id}", tag = "projection",
    params(("order_id" = String, Path, description = "the order's id")),
    responses((status = 200, description = "the order as its events tell it (404 until the first arrives)", body = OrderView)))]
async fn get_order(
    Tenant(tenant): Tenant,
    State(pool): State<PgPool>,
    Path(order_id): Path<String>,
) -> Result<Json<OrderView>, Error> {
    let order_id = contracts::OrderId::parse(&order_id).ok_or(Error::NotFound)?;
    read_one(&pool, tenant, async |tx| find(tx, order_id.get()).await).await
}

#[utoipa::path(get, path = "/history/{aggregate_type}/{aggregate_id}", tag = "projection",
    params(("aggregate_type" = String, Path, description = "`order` or `product`"),
           ("aggregate_id" = String, Path, description = "the order's id or the product's sku")),
    responses((status = 200, description = "the aggregate's events in the order they happened (404 until the first arrives)", body = [crate::history::Entry])))]
async fn get_history(
    Tenant(tenant): Tenant,
    State(pool): State<PgPool>,
    Path((aggregate_type, aggregate_id)): Path<(String, String)>,
) -> Result<Json<Vec<crate::history::Entry>>, Error> {
    read_one(&pool, tenant, async |tx| {
        let entries = crate::history::read(tx, &aggregate_type, &aggregate_id).await?;
        Ok((!entries.is_empty()).then_some(entries))
    })
    .await
}

/// The view and its timeline (oldest first), if any event of the order arrived.
pub async fn find(conn: &mut PgConnection, order_id: i64) -> Result<Option<OrderView>, Error> {
    let Some(mut view) = sqlx::query_as::<_, OrderView>(
        "SELECT order_id, status, total_cents, currency, payment_status, reservation_status, refunded_cents
         FROM order_views WHERE order_id = $1",
    )
    .bind(order_id)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    view.events = sqlx::query_as(
        "SELECT event_type, source, occurred_at FROM order_view_events WHERE order_id = $1 ORDER BY occurred_at, source, message_id",
    )
    .bind(order_id)
    .fetch_all(&mut *conn)
    .await?;
    Ok(Some(view))
}
