//! The graph's questions, each one statement scoped to the token's tenant:
//! `GET /graph/orders/{order_id}` (an order's neighbourhood),
//! `GET /graph/products/{sku}/co-purchased` (what the customers who bought
//! it bought too) and `GET /graph/products/{sku}/open-orders` (the open
//! orders a stock-out of it touches).

use std::sync::Arc;

use axum::Json;
use axum::extract::{FromRef, Path, RawQuery, State};
use reliability::TenantId;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::{Value, json};
use service_kit::auth::JwtKeys;
use service_kit::auth::Tenant;
use service_kit::service::ApiState;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::freshness::{self, Freshness};
use crate::store::{Cypher, Params, Row, Store};
use crate::{Error, GraphSettings};

/// The routes' state: the shared one, and the graph.
#[derive(Clone)]
pub struct GraphState {
    api: ApiState,
    store: Arc<Store>,
}

impl FromRef<GraphState> for JwtKeys {
    fn from_ref(s: &GraphState) -> Self {
        JwtKeys::from_ref(&s.api)
    }
}

pub fn router(api: ApiState) -> OpenApiRouter {
    // Absent where only the OpenAPI document is built: nothing connects
    // before the first request.
    let settings = api.own::<GraphSettings>().cloned().unwrap_or_default();
    let store = Arc::new(settings.store());
    OpenApiRouter::new()
        .routes(routes!(get_order))
        .routes(routes!(get_co_purchased))
        .routes(routes!(get_open_orders))
        .with_state(GraphState { api, store })
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Neighbourhood {
    pub order_id: i64,
    /// `placed`, `confirmed` or `cancelled`.
    pub status: String,
    pub customer_id: Option<String>,
    pub currency: Option<String>,
    pub total_cents: Option<i64>,
    /// Its stock is held (`RESERVED` edges); given back if cancelled since.
    pub reserved: bool,
    /// `CONTAINS` edges, by sku.
    pub lines: Vec<LineEdge>,
    /// `PAID_BY` edges, by payment id.
    pub payments: Vec<PaymentNode>,
    /// `as_of` and `lag_seconds`: how fresh the answer is.
    #[serde(flatten)]
    pub freshness: Freshness,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LineEdge {
    pub sku: String,
    pub quantity: Option<i64>,
    pub unit_price_cents: Option<i64>,
    pub reserved: bool,
    pub released: bool,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PaymentNode {
    pub payment_id: i64,
    /// `captured` or `failed`; null while only a refund told of it.
    pub status: Option<String>,
    pub amount_cents: Option<i64>,
    /// `REFUNDED` edges, by refund id.
    pub refunds: Vec<RefundNode>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RefundNode {
    pub refund_id: i64,
    pub amount_cents: Option<i64>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CoPurchased {
    pub sku: String,
    /// Other products bought by customers who bought `sku`, most shared first.
    pub products: Vec<CoPurchase>,
    /// `as_of` and `lag_seconds`: how fresh the answer is.
    #[serde(flatten)]
    pub freshness: Freshness,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CoPurchase {
    pub sku: String,
    /// Customers who bought both.
    pub customers: i64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpenOrders {
    pub sku: String,
    /// Orders not yet confirmed or cancelled that contain `sku`, by id.
    pub orders: Vec<OpenOrder>,
    /// `as_of` and `lag_seconds`: how fresh the answer is.
    #[serde(flatten)]
    pub freshness: Freshness,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpenOrder {
    pub order_id: i64,
    pub quantity: Option<i64>,
    pub reserved: bool,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct Limit {
    /// How many products, 1 to 100 (default 10). Read from the raw query
    /// ([`limit`]), so that any other value, or the name twice, is the
    /// contract's 422, not a 400 of the extractor's own.
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<i64>,
}

/// `limit` of the query string: 10 when absent.
fn limit(query: Option<&str>) -> Result<i64, Error> {
    let mut given = query
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('=').or(Some((pair, ""))))
        .filter(|(name, _)| *name == "limit")
        .map(|(_, value)| value);
    let invalid = || Error::Invalid("limit must be a number from 1 to 100, given once".into());
    match (given.next(), given.next()) {
        (None, _) => Ok(10),
        (Some(value), None) => value
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(invalid),
        (Some(_), Some(_)) => Err(invalid()),
    }
}

/// Each comprehension has variables of its own, and none is nested:
/// FalkorDB 4.14 answers a comprehension inside another with null.
pub const NEIGHBOURHOOD: Cypher = Cypher(
    "MATCH (o:Order {tenant: $tenant, id: $order_id})
     RETURN o.id AS order_id, coalesce(o.status, 'placed') AS status, o.currency AS currency,
            o.total_cents AS total_cents, coalesce(o.reserved, false) AS reserved,
            head([(c:Customer {tenant: $tenant})-[:PLACED]->(o) | c.id]) AS customer_id,
            [(o)-[r:CONTAINS]->(p:Product {tenant: $tenant}) |
                {sku: p.sku, quantity: r.quantity, unit_price_cents: r.unit_price_cents}] AS lines,
            [(o)-[:RESERVED]->(x:Product {tenant: $tenant}) | x.sku] AS reserved_skus,
            [(o)-[:RELEASED]->(y:Product {tenant: $tenant}) | y.sku] AS released_skus,
            [(o)-[:PAID_BY]->(pay:Payment {tenant: $tenant}) |
                {payment_id: pay.id, status: pay.status, amount_cents: pay.amount_cents}] AS payments,
            [(o)-[:PAID_BY]->(pp:Payment {tenant: $tenant})-[:REFUNDED]->(rf:Refund {tenant: $tenant}) |
                {payment_id: pp.id, refund_id: rf.id, amount_cents: rf.amount_cents}] AS refunds",
);

/// Two matches, not one path: in one pattern the customer's second
/// `PLACED` edge could not be the first one, which would leave out what
/// was bought in the same order.
pub const CO_PURCHASED: Cypher = Cypher(
    "MATCH (p:Product {tenant: $tenant, sku: $sku})
     OPTIONAL MATCH (p)<-[:CONTAINS]-(:Order {tenant: $tenant})<-[:PLACED]-(c:Customer {tenant: $tenant})
     OPTIONAL MATCH (c)-[:PLACED]->(:Order {tenant: $tenant})-[:CONTAINS]->(q:Product {tenant: $tenant})
     WHERE q.sku <> $sku
     RETURN q.sku AS sku, count(DISTINCT c) AS customers
     ORDER BY customers DESC, sku LIMIT $limit",
);

pub const OPEN_ORDERS: Cypher = Cypher(
    "MATCH (p:Product {tenant: $tenant, sku: $sku})
     OPTIONAL MATCH (p)<-[r:CONTAINS]-(o:Order {tenant: $tenant})
     WHERE coalesce(o.status, 'placed') = 'placed'
     RETURN o.id AS order_id, r.quantity AS quantity, coalesce(o.reserved, false) AS reserved
     ORDER BY order_id",
);

/// Every statement the routes run, for the scoping test.
pub const STATEMENTS: &[Cypher] = &[
    NEIGHBOURHOOD,
    CO_PURCHASED,
    OPEN_ORDERS,
    freshness::WATERMARKS,
];

#[utoipa::path(get, path = "/graph/orders/{order_id}", tag = "graph",
    params(("order_id" = String, Path, description = "the order's id")),
    responses((status = 200, description = "the order, its customer, products, payments and refunds (404 until an event of it arrives)", body = Neighbourhood)))]
async fn get_order(
    Tenant(tenant): Tenant,
    State(state): State<GraphState>,
    Path(order_id): Path<String>,
) -> Result<Json<Neighbourhood>, Error> {
    let order_id = contracts::OrderId::parse(&order_id).ok_or(Error::NotFound)?;
    let rows = run(
        &state,
        tenant,
        NEIGHBOURHOOD,
        json!({"order_id": order_id.get()}),
    )
    .await?;
    let mut row = rows.into_iter().next().ok_or(Error::NotFound)?;
    let skus = |row: &mut Row, column: &str| -> Vec<String> {
        decode(row.remove(column).unwrap_or(Value::Null)).unwrap_or_default()
    };
    let (reserved, released) = (
        skus(&mut row, "reserved_skus"),
        skus(&mut row, "released_skus"),
    );
    let lines: Vec<Row> = decode(row.remove("lines").unwrap_or(Value::Null))?;
    let mut lines: Vec<LineEdge> = lines
        .into_iter()
        .map(|mut l| {
            let sku: String = decode(l.remove("sku").unwrap_or(Value::Null)).unwrap_or_default();
            LineEdge {
                reserved: reserved.contains(&sku),
                released: released.contains(&sku),
                quantity: l.get("quantity").and_then(Value::as_i64),
                unit_price_cents: l.get("unit_price_cents").and_then(Value::as_i64),
                sku,
            }
        })
        .collect();
    lines.sort_by(|a, b| a.sku.cmp(&b.sku));
    row.insert(
        "lines".into(),
        serde_json::to_value(lines).map_err(internal)?,
    );
    let refunds: Vec<Row> = decode(row.remove("refunds").unwrap_or(Value::Null))?;
    let mut payments: Vec<Row> = decode(row.remove("payments").unwrap_or(Value::Null))?;
    for p in &mut payments {
        let id = p.get("payment_id").cloned();
        let mut mine: Vec<RefundNode> = refunds
            .iter()
            .filter(|r| r.get("payment_id") == id.as_ref())
            .map(|r| decode(Value::Object(r.clone())))
            .collect::<Result<_, _>>()?;
        mine.sort_by_key(|r| r.refund_id);
        p.insert(
            "refunds".into(),
            serde_json::to_value(mine).map_err(internal)?,
        );
    }
    row.insert(
        "payments".into(),
        Value::Array(payments.into_iter().map(Value::Object).collect()),
    );
    let mut view: Neighbourhood = decode(Value::Object(row))?;
    view.payments.sort_by_key(|p| p.payment_id);
    view.freshness = freshness::read(&state.store, tenant).await?;
    Ok(Json(view))
}

#[utoipa::path(get, path = "/graph/products/{sku}/co-purchased", tag = "graph",
    params(("sku" = String, Path, description = "the product's sku"), Limit),
    responses((status = 200, description = "what the customers who bought it bought too (404 for a product no event named)", body = CoPurchased),
              (status = 422, description = "`limit` is not a number from 1 to 100, or given twice", body = service_kit::http::ErrorBody)))]
async fn get_co_purchased(
    Tenant(tenant): Tenant,
    State(state): State<GraphState>,
    Path(sku): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<CoPurchased>, Error> {
    let sku = valid_sku(sku)?;
    let limit = limit(query.as_deref())?;
    let rows = run(
        &state,
        tenant,
        CO_PURCHASED,
        json!({"sku": sku, "limit": limit}),
    )
    .await?;
    if rows.is_empty() {
        return Err(Error::NotFound);
    }
    let products = rows
        .into_iter()
        .filter(|r| r.get("sku").is_some_and(Value::is_string))
        .map(|r| decode(Value::Object(r)))
        .collect::<Result<_, _>>()?;
    Ok(Json(CoPurchased {
        sku,
        products,
        freshness: freshness::read(&state.store, tenant).await?,
    }))
}

#[utoipa::path(get, path = "/graph/products/{sku}/open-orders", tag = "graph",
    params(("sku" = String, Path, description = "the product's sku")),
    responses((status = 200, description = "the orders not yet decided that contain it (404 for a product no event named)", body = OpenOrders)))]
async fn get_open_orders(
    Tenant(tenant): Tenant,
    State(state): State<GraphState>,
    Path(sku): Path<String>,
) -> Result<Json<OpenOrders>, Error> {
    let sku = valid_sku(sku)?;
    let rows = run(&state, tenant, OPEN_ORDERS, json!({"sku": sku})).await?;
    if rows.is_empty() {
        return Err(Error::NotFound);
    }
    let orders = rows
        .into_iter()
        .filter(|r| r.get("order_id").is_some_and(Value::is_i64))
        .map(|r| decode(Value::Object(r)))
        .collect::<Result<_, _>>()?;
    Ok(Json(OpenOrders {
        sku,
        orders,
        freshness: freshness::read(&state.store, tenant).await?,
    }))
}

/// A sku as every service takes it; anything else names no product (404,
/// as inventory's `GET /products/{sku}` answers).
fn valid_sku(sku: String) -> Result<String, Error> {
    contracts::Sku::parse(sku)
        .map(|s| s.as_str().to_owned())
        .ok_or(Error::NotFound)
}

async fn run(
    state: &GraphState,
    tenant: TenantId,
    cypher: Cypher,
    params: Value,
) -> Result<Vec<Row>, Error> {
    let params = match params {
        Value::Object(map) => map,
        _ => Params::new(),
    };
    Ok(state.store.read(tenant, cypher, params).await?)
}

fn decode<T: DeserializeOwned>(value: Value) -> Result<T, Error> {
    serde_json::from_value(value).map_err(internal)
}

fn internal(e: serde_json::Error) -> Error {
    Error::Domain(crate::Graph::Row(e.to_string()))
}
