//! `POST /items` and `GET /items/{item_id}`, and the SQL they own.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
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

use crate::Error;

/// The event this service publishes: its payload, and its type, version and
/// source as a contract. Move it to `libs/contracts` (a row in `events!`)
/// once another service consumes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemCreated {
    pub item_id: i64,
    pub name: String,
}

impl contracts::Event for ItemCreated {
    const TYPE: &'static str = "ItemCreated";
    const VERSION: i32 = 1;
    const SOURCE: &'static str = "__SERVICE__";
}

pub fn router(state: ApiState) -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(create_item))
        .routes(routes!(get_item))
        .with_state(state)
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct CreateItem {
    /// 1 to 100 characters, none of them control characters.
    #[schema(
        min_length = 1,
        max_length = 100,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]+$"
    )]
    pub name: String,
}

#[derive(Debug, Serialize, sqlx::FromRow, ToSchema)]
pub struct ItemView {
    pub item_id: i64,
    pub name: String,
    pub created_at: DateTime<Utc>,
}

/// One transaction: the key, the item, `ItemCreated`, the stored response.
#[utoipa::path(post, path = "/items", tag = "items", request_body = CreateItem,
    responses((status = 201, description = "the item", body = ItemView)))]
async fn create_item(req: Idempotent<CreateItem>) -> Response {
    // The answer (201, a stored 4xx, or a rolled-back 5xx) is the
    // extractor's to give: the work only returns its result.
    req.answer(StatusCode::CREATED, async |body, tx| {
        let name = &body.name;
        // Control characters (NUL above all, which PostgreSQL text refuses) are not a name.
        if !(1..=100).contains(&name.chars().count()) || name.chars().any(char::is_control) {
            return Err(Error::Invalid(
                "name must be 1 to 100 characters, none of them control characters".into(),
            ));
        }
        let item: ItemView = sqlx::query_as(
            "INSERT INTO items (tenant_id, name) VALUES ($1, $2) RETURNING item_id, name, created_at",
        )
        .bind(tx.tenant().get())
        .bind(name)
        .fetch_one(&mut **tx)
        .await?;
        let created = ItemCreated {
            item_id: item.item_id,
            name: item.name.clone(),
        };
        let event = NewEvent::of("item", item.item_id, &created)?;
        outbox::enqueue(tx, &event).await?;
        Ok(item)
    })
    .await
}

#[utoipa::path(get, path = "/items/{item_id}", tag = "items",
    params(("item_id" = String, Path, description = "the item's id")),
    responses((status = 200, description = "the item", body = ItemView)))]
async fn get_item(
    Tenant(tenant): Tenant,
    State(pool): State<PgPool>,
    Path(item_id): Path<String>,
) -> Result<Json<ItemView>, Error> {
    let item_id: i64 = item_id.parse().map_err(|_| Error::NotFound)?;
    read_one(&pool, tenant, async |tx| {
        let item = sqlx::query_as("SELECT item_id, name, created_at FROM items WHERE item_id = $1")
            .bind(item_id)
            .fetch_optional(&mut **tx)
            .await?;
        Ok(item)
    })
    .await
}
