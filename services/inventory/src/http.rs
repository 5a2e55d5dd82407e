//! `POST /stock/adjustments` and `GET /products/{sku}`, and their SQL.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use contracts::aggregate;
use reliability::TenantTx;
use reliability::outbox::{self, NewEvent};
use serde::{Deserialize, Serialize};
use service_kit::auth::Tenant;
use service_kit::http::read_one;
use service_kit::idempotency::Idempotent;
use service_kit::service::ApiState;
use sqlx::PgPool;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{Error, Inventory};
use contracts::Sku;

pub fn router(state: ApiState) -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(adjust_stock))
        .routes(routes!(get_product))
        .with_state(state)
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct Adjustment {
    /// 1 to 64 visible ASCII characters.
    #[schema(min_length = 1, max_length = 64, pattern = "^[!-~]+$")]
    pub sku: String,
    /// Non-zero, within ±1000000000.
    #[schema(schema_with = delta_schema)]
    #[serde(deserialize_with = "service_kit::http::integer")]
    pub delta: i64,
    /// 1 to 200 characters, none of them control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]+$"
    )]
    pub reason: String,
}

/// `delta`: a non-zero integer within ±MAX_DELTA, as two ranges (so that a
/// client generated from the document never sends 0).
fn delta_schema() -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{
        KnownFormat, ObjectBuilder, OneOfBuilder, Schema, SchemaFormat, Type,
    };
    let range = |min: i64, max: i64| {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
            .minimum(Some(min))
            .maximum(Some(max))
    };
    Schema::OneOf(
        OneOfBuilder::new()
            .item(range(-MAX_DELTA, -1))
            .item(range(1, MAX_DELTA))
            .build(),
    )
}

#[derive(Debug, Serialize, sqlx::FromRow, ToSchema)]
pub struct ProductView {
    pub sku: String,
    pub on_hand: i64,
    pub reserved: i64,
    pub available: i64,
}

const MAX_DELTA: i64 = 1_000_000_000;

#[utoipa::path(post, path = "/stock/adjustments", tag = "inventory", request_body = Adjustment,
    responses((status = 201, description = "the product after the adjustment", body = ProductView)))]
async fn adjust_stock(req: Idempotent<Adjustment>) -> Response {
    req.answer(StatusCode::CREATED, async |body, tx| {
        let sku = validate(body)?;
        let product = apply_adjustment(tx, &sku, body.delta, &body.reason).await?;
        let adjusted = contracts::StockAdjusted {
            sku: product.sku.clone(),
            delta: body.delta,
            on_hand: product.on_hand,
            reason: body.reason.clone(),
        };
        outbox::enqueue(
            tx,
            &NewEvent::of(aggregate::PRODUCT, &product.sku, &adjusted)?,
        )
        .await?;
        Ok::<_, Error>(product)
    })
    .await
}

fn validate(body: &Adjustment) -> Result<Sku, Error> {
    let sku = Sku::parse(body.sku.clone()).ok_or_else(|| Error::Invalid(Sku::RULE.into()))?;
    if body.delta == 0 || body.delta.unsigned_abs() > MAX_DELTA.unsigned_abs() {
        return Err(Error::Invalid(format!(
            "delta must be non-zero and within ±{MAX_DELTA}"
        )));
    }
    // Control characters (NUL above all, which PostgreSQL text refuses) are not a reason.
    let reason = &body.reason;
    if !(1..=200).contains(&reason.chars().count()) || reason.chars().any(char::is_control) {
        return Err(Error::Invalid(
            "reason must be 1 to 200 characters, none of them control characters".into(),
        ));
    }
    Ok(sku)
}

/// Adds stock (creating the product) or removes it, never below what is
/// reserved; an unknown sku has nothing to remove.
async fn apply_adjustment(
    tx: &mut TenantTx,
    sku: &Sku,
    delta: i64,
    reason: &str,
) -> Result<ProductView, Error> {
    let tenant = tx.tenant().get();
    let product: Option<ProductView> = if delta > 0 {
        sqlx::query_as(
            "INSERT INTO products (tenant_id, sku, on_hand) VALUES ($1, $2, $3)
             ON CONFLICT (tenant_id, sku) DO UPDATE SET on_hand = products.on_hand + $3, updated_at = now()
             RETURNING sku, on_hand, reserved, on_hand - reserved AS available",
        )
        .bind(tenant)
        .bind(sku.as_str())
        .bind(delta)
        .fetch_optional(&mut **tx)
        .await
        .map_err(|e| match reliability::db::is_out_of_range(&e) {
            true => Error::Invalid("on_hand would exceed the largest stock level".into()),
            false => e.into(),
        })?
    } else {
        sqlx::query_as(
            "UPDATE products SET on_hand = on_hand + $2, updated_at = now()
             WHERE sku = $1 AND on_hand + $2 >= reserved
             RETURNING sku, on_hand, reserved, on_hand - reserved AS available",
        )
        .bind(sku.as_str())
        .bind(delta)
        .fetch_optional(&mut **tx)
        .await?
    };
    let product = product.ok_or(Error::Domain(Inventory::BelowReserved))?;
    sqlx::query(
        "INSERT INTO stock_adjustments (tenant_id, sku, delta, reason) VALUES ($1, $2, $3, $4)",
    )
    .bind(tenant)
    .bind(sku.as_str())
    .bind(delta)
    .bind(reason)
    .execute(&mut **tx)
    .await?;
    Ok(product)
}

#[utoipa::path(get, path = "/products/{sku}", tag = "inventory",
    params(("sku" = String, Path, description = "the product's sku", min_length = 1, max_length = 64, pattern = "^[!-~]+$")),
    responses((status = 200, description = "stock of the product", body = ProductView)))]
async fn get_product(
    Tenant(tenant): Tenant,
    State(pool): State<PgPool>,
    Path(sku): Path<String>,
) -> Result<Json<ProductView>, Error> {
    read_one(&pool, tenant, async |tx| {
        let product = sqlx::query_as(
            "SELECT sku, on_hand, reserved, on_hand - reserved AS available FROM products WHERE sku = $1",
        )
        .bind(&sku)
        .fetch_optional(&mut **tx)
        .await?;
        Ok(product)
    })
    .await
}
