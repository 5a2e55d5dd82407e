//! `GET /payments?order_id=` and `POST /refunds`, and their SQL. A refund is
//! accepted here (reserving the amount against the payment) and carried out
//! by the provider worker, never inside this transaction.

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use reliability::TenantTx;
use serde::{Deserialize, Serialize};
use service_kit::auth::Tenant;
use service_kit::idempotency::Idempotent;
use service_kit::service::ApiState;
use sqlx::PgPool;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{Error, Payments};

pub fn router(state: ApiState) -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(list_payments))
        .routes(routes!(create_refund))
        .with_state(state)
}

#[derive(Debug, Serialize, sqlx::FromRow, ToSchema)]
pub struct PaymentView {
    pub payment_id: i64,
    pub order_id: i64,
    pub status: String,
    pub amount_cents: i64,
    pub currency: String,
    pub refunded_cents: i64,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PaymentsQuery {
    /// Only this order's payments.
    pub order_id: Option<String>,
}

#[utoipa::path(get, path = "/payments", tag = "payments", params(PaymentsQuery),
    responses((status = 200, description = "the tenant's payments (of one order with `order_id`)", body = Vec<PaymentView>)))]
async fn list_payments(
    Tenant(tenant): Tenant,
    State(pool): State<PgPool>,
    Query(q): Query<PaymentsQuery>,
) -> Result<Json<Vec<PaymentView>>, Error> {
    // An order id that is not a number matches nothing, like an unknown one.
    let order_id: Option<i64> = match q.order_id.as_deref() {
        None => None,
        Some(s) => match s.parse() {
            Ok(id) => Some(id),
            Err(_) => return Ok(Json(Vec::new())),
        },
    };
    let mut tx = TenantTx::begin(&pool, tenant).await?;
    let rows = sqlx::query_as(
        "SELECT payment_id, order_id, status, amount_cents, currency, refunded_cents
         FROM payments WHERE $1::bigint IS NULL OR order_id = $1 ORDER BY payment_id LIMIT 100",
    )
    .bind(order_id)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Json(rows))
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct RefundRequest {
    /// The payment's id: a number (or the same as a string).
    #[schema(value_type = i64, minimum = 1)]
    pub payment_id: serde_json::Value,
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "service_kit::http::integer")]
    pub amount_cents: i64,
}

#[derive(Debug, Serialize, sqlx::FromRow, ToSchema)]
pub struct RefundView {
    pub refund_id: i64,
    pub payment_id: i64,
    pub amount_cents: i64,
    pub status: String,
}

#[utoipa::path(post, path = "/refunds", tag = "payments", request_body = RefundRequest,
    responses((status = 201, description = "the refund, pending until the provider confirms it", body = RefundView),
        (status = 404, description = "no such payment for this tenant", body = service_kit::http::ErrorBody)))]
async fn create_refund(req: Idempotent<RefundRequest>) -> Response {
    req.answer(StatusCode::CREATED, async |body, tx| {
        // Ids are opaque to clients: a number or a numeric string.
        let payment_id = match &body.payment_id {
            serde_json::Value::Number(n) => service_kit::http::integral(n),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        }
        .ok_or(Error::NotFound)?;
        if body.amount_cents <= 0 {
            return Err(Error::Invalid("amount_cents must be positive".into()));
        }
        reserve_refund(tx, payment_id, body.amount_cents).await
    })
    .await
}

/// Counts the amount against the captured payment and records the refund
/// as pending; the worker asks the provider.
async fn reserve_refund(
    tx: &mut TenantTx,
    payment_id: i64,
    amount: i64,
) -> Result<RefundView, Error> {
    let reserved = sqlx::query(
        "UPDATE payments SET refunded_cents = refunded_cents + $2, updated_at = now()
         WHERE payment_id = $1 AND status = 'captured' AND $2 <= amount_cents - refunded_cents",
    )
    .bind(payment_id)
    .bind(amount)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if reserved == 0 {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT FROM payments WHERE payment_id = $1)")
                .bind(payment_id)
                .fetch_one(&mut **tx)
                .await?;
        return Err(if exists {
            Error::Domain(Payments::RefundTooLarge)
        } else {
            Error::NotFound
        });
    }
    Ok(sqlx::query_as(
        "INSERT INTO refunds (tenant_id, payment_id, amount_cents, traceparent) VALUES ($1, $2, $3, $4)
         RETURNING refund_id, payment_id, amount_cents, status",
    )
    .bind(tx.tenant().get())
    .bind(payment_id)
    .bind(amount)
    .bind(reliability::trace::current().map(|t| t.to_header()))
    .fetch_one(&mut **tx)
    .await?)
}
