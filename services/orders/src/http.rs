//! `POST /orders` and `GET /orders/{order_id}`, and the SQL they own.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use contracts::aggregate;
use reliability::TenantTx;
use reliability::outbox::{self, NewEvent};
use serde::{Deserialize, Serialize};
use service_kit::auth::Tenant;
use service_kit::http::read_one;
use service_kit::idempotency::Idempotent;
use service_kit::service::ApiState;
use sqlx::{PgConnection, PgPool};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::Error;
use crate::domain::{self, NewOrder, OrderId};

/// A tenant's orders the saga has not decided (placed in the last `$2`
/// seconds), those created since the last count's mark (µs since the
/// epoch), the new mark, and the orders undecided for longer (stuck): what
/// admission counts for `POST /orders` (docs/adr/0027). Served by the
/// indexes of migrations 1003 and 1004.
const IN_FLIGHT: &str = "SELECT (SELECT count(*) FROM orders WHERE status = 'pending' \
                          AND created_at > now() - make_interval(secs => $2)), \
     (SELECT count(*) FROM orders WHERE created_at > to_timestamp($1::bigint / 1000000.0)), \
     (extract(epoch FROM now()) * 1000000)::bigint, \
     (SELECT count(*) FROM orders WHERE status = 'pending' \
      AND created_at <= now() - make_interval(secs => $2))";

pub fn router(state: ApiState) -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(place_order))
        // Only placing an order waits on the saga; reads are never gated.
        .route_layer(state.backlog(IN_FLIGHT))
        .routes(routes!(get_order))
        .with_state(state)
}

/// The wire shape of `POST /orders`; validated into [`NewOrder`].
#[derive(Debug, Deserialize, ToSchema)]
pub struct PlaceOrder {
    /// 1 to 64 characters, no control characters.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]+$"
    )]
    pub customer_id: String,
    #[schema(pattern = "^[A-Z]{3}$", example = "EUR")]
    pub currency: String,
    #[schema(min_items = 1, max_items = 100)]
    pub lines: Vec<PlaceOrderLine>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct PlaceOrderLine {
    /// 1 to 64 visible ASCII characters.
    #[schema(min_length = 1, max_length = 64, pattern = "^[!-~]+$")]
    pub sku: String,
    #[schema(minimum = 1, maximum = 10000)]
    #[serde(deserialize_with = "service_kit::http::integer")]
    pub quantity: i64,
    #[schema(minimum = 0, maximum = 100000000)]
    #[serde(deserialize_with = "service_kit::http::integer")]
    pub unit_price_cents: i64,
}

#[derive(Debug, Serialize, sqlx::FromRow, ToSchema)]
pub struct OrderView {
    pub order_id: i64,
    pub status: String,
    pub customer_id: String,
    pub currency: String,
    pub total_cents: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cancel_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    #[sqlx(skip)]
    pub lines: Vec<LineView>,
}

#[derive(Debug, Serialize, sqlx::FromRow, ToSchema)]
pub struct LineView {
    pub sku: String,
    pub quantity: i32,
    pub unit_price_cents: i64,
}

fn validate(body: &PlaceOrder) -> Result<NewOrder, Error> {
    let lines = body
        .lines
        .iter()
        .map(|l| domain::line(l.sku.clone(), l.quantity, l.unit_price_cents))
        .collect::<Result<Vec<_>, _>>()?;
    domain::new_order(body.customer_id.clone(), body.currency.clone(), lines)
}

/// One transaction: the key, the order and its lines, `OrderPlaced`, the
/// stored response (I3 and I1 together).
#[utoipa::path(post, path = "/orders", tag = "orders", request_body = PlaceOrder,
    responses((status = 201, description = "the order, pending", body = OrderView)))]
async fn place_order(req: Idempotent<PlaceOrder>) -> Response {
    req.answer(StatusCode::CREATED, async |body, tx| {
        place(tx, &validate(body)?).await
    })
    .await
}

/// Inserts `order` and its `OrderPlaced` event in the caller's transaction:
/// both commit or neither (I1). Public for the e2e suite, which holds such a
/// transaction open to commit an early outbox id late.
pub async fn place(tx: &mut TenantTx, order: &NewOrder) -> Result<OrderView, Error> {
    let view = insert_order(tx, order).await?;
    let placed = contracts::OrderPlaced {
        order_id: view.order_id,
        customer_id: view.customer_id.clone(),
        currency: view.currency.clone(),
        total_cents: view.total_cents,
        lines: view
            .lines
            .iter()
            .map(|l| contracts::Line {
                sku: l.sku.clone(),
                quantity: l.quantity.into(),
                unit_price_cents: l.unit_price_cents,
            })
            .collect(),
    };
    outbox::enqueue(tx, &NewEvent::of(aggregate::ORDER, view.order_id, &placed)?).await?;
    tracing::info!(
        order_id = view.order_id,
        total_cents = view.total_cents,
        "order placed"
    );
    Ok(view)
}

#[utoipa::path(get, path = "/orders/{order_id}", tag = "orders",
    params(("order_id" = String, Path, description = "the order's id")),
    responses((status = 200, description = "the order and its lines", body = OrderView)))]
async fn get_order(
    Tenant(tenant): Tenant,
    State(pool): State<PgPool>,
    Path(order_id): Path<String>,
) -> Result<Json<OrderView>, Error> {
    let order_id = OrderId::parse(&order_id).ok_or(Error::NotFound)?;
    read_one(&pool, tenant, async |tx| find_order(tx, order_id).await).await
}

// A span of the service's own: exported inside the request's step, with
// the SQL it runs (reliability::trace::layer).
#[tracing::instrument(skip_all, fields(lines = order.lines.len()))]
async fn insert_order(tx: &mut TenantTx, order: &NewOrder) -> Result<OrderView, Error> {
    let tenant = tx.tenant().get();
    let mut view: OrderView = sqlx::query_as(
        "INSERT INTO orders (tenant_id, customer_id, currency, total_cents)
         VALUES ($1, $2, $3, $4)
         RETURNING order_id, status, customer_id, currency, total_cents, cancel_reason, created_at",
    )
    .bind(tenant)
    .bind(order.customer_id.as_str())
    .bind(order.currency.as_str())
    .bind(order.total_cents())
    .fetch_one(&mut **tx)
    .await?;
    let skus: Vec<&str> = order.lines.iter().map(|l| l.sku.as_str()).collect();
    let quantities: Vec<i32> = order.lines.iter().map(|l| l.quantity).collect();
    let prices: Vec<i64> = order.lines.iter().map(|l| l.unit_price_cents).collect();
    sqlx::query(
        "INSERT INTO order_lines (tenant_id, order_id, line_no, sku, quantity, unit_price_cents)
         SELECT $1, $2, l.n, l.sku, l.quantity, l.price
         FROM unnest($3::text[], $4::int[], $5::bigint[]) WITH ORDINALITY AS l(sku, quantity, price, n)",
    )
    .bind(tenant)
    .bind(view.order_id)
    .bind(&skus)
    .bind(&quantities)
    .bind(&prices)
    .execute(&mut **tx)
    .await?;
    view.lines = order
        .lines
        .iter()
        .map(|l| LineView {
            sku: l.sku.as_str().to_owned(),
            quantity: l.quantity,
            unit_price_cents: l.unit_price_cents,
        })
        .collect();
    Ok(view)
}

/// The order with its lines, if this tenant has it (RLS filters the rest).
pub async fn find_order(
    conn: &mut PgConnection,
    order_id: OrderId,
) -> Result<Option<OrderView>, Error> {
    let Some(mut view) = sqlx::query_as::<_, OrderView>(
        "SELECT order_id, status, customer_id, currency, total_cents, cancel_reason, created_at
         FROM orders WHERE order_id = $1",
    )
    .bind(order_id.get())
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    view.lines = sqlx::query_as("SELECT sku, quantity, unit_price_cents FROM order_lines WHERE order_id = $1 ORDER BY line_no")
        .bind(order_id.get())
        .fetch_all(&mut *conn)
        .await?;
    Ok(Some(view))
}
