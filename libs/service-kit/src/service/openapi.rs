//! The OpenAPI conventions every service's document follows (bearer auth,
//! the shared error and header shapes), applied in one place.

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use utoipa_axum::router::OpenApiRouter;

use crate::auth::JwtKeys;

use super::ApiState;

/// The OpenAPI document of a service's routes, without a database (for
/// `<service> --openapi` and CI).
pub fn openapi(name: &str, routes: fn(ApiState) -> OpenApiRouter) -> utoipa::openapi::OpenApi {
    let pool = PgPoolOptions::new().connect_lazy_with(PgConnectOptions::new());
    let (_, mut api) =
        routes(ApiState::new(pool, JwtKeys::from_secret(b"unused"))).split_for_parts();
    document(&mut api, name);
    api
}

/// What is the same on every route, written once: bearer authentication,
/// the `Idempotency-Key` header of every POST, and the contract's error
/// responses with their shared body.
pub fn document(api: &mut utoipa::openapi::OpenApi, name: &str) {
    use utoipa::openapi::path::{HttpMethod, ParameterBuilder, ParameterIn};
    use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
    use utoipa::openapi::{
        ContentBuilder, ObjectBuilder, Ref, RefOr, Required, ResponseBuilder, Type,
    };

    api.info.title = format!("{name} service");
    api.info.version = env!("CARGO_PKG_VERSION").to_owned();
    api.info.description = Some(
        "Every route needs `Authorization: Bearer <JWT>` (HS256, integer claims `tenant_id` and `exp`). \
         Errors are `{\"error\": {\"code\", \"message\"}}`."
            .to_owned(),
    );
    let components = api.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            Http::builder()
                .scheme(HttpAuthScheme::Bearer)
                .bearer_format("JWT")
                .build(),
        ),
    );
    let schemas: Vec<(String, RefOr<utoipa::openapi::schema::Schema>)> = {
        let mut v = Vec::new();
        <crate::http::ErrorBody as utoipa::ToSchema>::schemas(&mut v);
        v.push((
            <crate::http::ErrorBody as utoipa::ToSchema>::name().into_owned(),
            <crate::http::ErrorBody as utoipa::PartialSchema>::schema(),
        ));
        v
    };
    components.schemas.extend(schemas);
    let error = |description: &str| {
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build()
    };
    for item in api.paths.paths.values_mut() {
        for (method, op) in [
            (HttpMethod::Get, item.get.as_mut()),
            (HttpMethod::Post, item.post.as_mut()),
        ] {
            let Some(op) = op else { continue };
            op.security = Some(vec![SecurityRequirement::new(
                "bearer",
                Vec::<String>::new(),
            )]);
            let mut errors = vec![("401", "missing, expired or badly signed token")];
            if method == HttpMethod::Post {
                op.parameters.get_or_insert_with(Vec::new).push(RefOr::T(
                    ParameterBuilder::new()
                        .name("Idempotency-Key")
                        .parameter_in(ParameterIn::Header)
                        .required(Required::True)
                        .description(Some("1 to 255 visible ASCII characters; a replay returns the stored response with `Idempotent-Replayed: true`"))
                        .schema(Some(ObjectBuilder::new().schema_type(Type::String).min_length(Some(1)).max_length(Some(255)).pattern(Some("^[\\x21-\\x7E]+$"))))
                        .build(),
                ));
                errors.extend([
                    (
                        "400",
                        "malformed JSON, or a missing or invalid Idempotency-Key",
                    ),
                    ("409", "the Idempotency-Key was used with another body"),
                    ("413", "the body is larger than 64 KiB"),
                    ("422", "well-formed but invalid input"),
                    (
                        "425",
                        "a request with this Idempotency-Key is still in flight; see Retry-After",
                    ),
                    (
                        "429",
                        "over the tenant's rate limit, or (`backlog_full`) at its bound of work in flight; nothing was run, see Retry-After",
                    ),
                ]);
            } else {
                errors.push(("404", "no such resource for this tenant"));
            }
            errors.extend([
                ("408", "the request took longer than the server allows"),
                ("500", "internal error (logged; never shown)"),
                (
                    "503",
                    "a dependency (the database) is unavailable; see Retry-After",
                ),
            ]);
            for (status, description) in errors {
                op.responses
                    .responses
                    .entry(status.to_owned())
                    .or_insert_with(|| RefOr::T(error(description)));
            }
        }
    }
}
