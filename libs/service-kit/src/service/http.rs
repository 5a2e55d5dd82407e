//! The HTTP stack of the contract around a service's routes: body limit,
//! JSON errors, request id, trace step, per-route metrics, time limits,
//! and the ops routes (`/healthz`, `/readyz`, `/metrics`).

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::http::ApiError;
use reliability::health::Health;
use reliability::trace::{self, TraceContext};
use reliability::{Error, Result};

use super::{BODY_LIMIT, CommonSettings};

/// Binds the HTTP listener (port 0 picks a free port: tests).
pub async fn bind(common: &CommonSettings, port: u16) -> Result<TcpListener> {
    bind_at(&common.bind_address, port).await
}

/// The ops port's listener, on `OPS_BIND_ADDRESS` (loopback by default).
pub async fn bind_ops(common: &CommonSettings, port: u16) -> Result<TcpListener> {
    bind_at(&common.ops_bind_address, port).await
}

async fn bind_at(address: &str, port: u16) -> Result<TcpListener> {
    TcpListener::bind((address, port))
        .await
        .map_err(|source| Error::Bind {
            address: format!("{address}:{port}"),
            source,
        })
}

/// How long the server gives a client, so that a slow or idle one cannot
/// hold a connection (or, through it, anything else) for long.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// To send a request's headers, counted from when the server waits for
    /// them; an idle keep-alive connection is closed after it too.
    pub header_read: Duration,
    /// For a whole request, body and handler included: past it the handler
    /// is dropped (its transaction rolls back) and the client gets 408.
    pub request: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(10),
            request: Duration::from_secs(30),
        }
    }
}

/// Serves `app` until `shutdown`, then lets requests in flight finish (at
/// most `limits.request`).
pub async fn serve(listener: TcpListener, app: Router, shutdown: CancellationToken) -> Result<()> {
    serve_with(listener, app, shutdown, ServerLimits::default()).await
}

/// [`serve`] with explicit limits.
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
    limits: ServerLimits,
) -> Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::server::graceful::GracefulShutdown;
    use hyper_util::service::TowerToHyperService;

    let app = app.layer(middleware::from_fn_with_state(
        limits.request,
        request_deadline,
    ));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let graceful = GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, most likely: let some close.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection closed with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.request, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight at shutdown were cut off");
    }
    Ok(())
}

/// A request that outlives its deadline is dropped: its transaction rolls
/// back and its Idempotency-Key stays free.
async fn request_deadline(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request took too long (a slow body, or a slow dependency)",
        )
        .into_response(),
    }
}

/// What `/readyz` checks: the database, the broker, and every part of the
/// process (relay, consumers) that reports to `health`.
#[derive(Clone)]
pub struct Readiness {
    pub pool: PgPool,
    pub amqp_url: String,
    pub health: Health,
}

/// The ops port's routes, what every process role serves there:
/// `/healthz`, `/readyz` with its detail, and `/metrics`. Never on an API
/// port: the metrics name tenants and count their traffic (ADR 0017's
/// opaque ids hide exactly that).
pub fn ops_routes(ready: Readiness, metrics: PrometheusHandle) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(ready)
        .merge(reliability::metrics::router(metrics))
}

/// What an API port answers for probes: `/healthz`, and `/readyz` as a
/// status alone (200 or 503), which a load balancer needs and nobody
/// learns anything else from.
fn probe_routes(ready: Readiness) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route(
            "/readyz",
            get(|state: State<Readiness>| async move {
                let (status, _) = readiness(state).await;
                let word = if status.is_success() {
                    "ready"
                } else {
                    "unavailable"
                };
                (status, axum::Json(serde_json::json!({ "status": word })))
            }),
        )
        .with_state(ready)
}

async fn healthz() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({"status": "ok"}))
}

/// The service's routes wrapped in the contract's HTTP stack, plus the
/// probes (`/healthz`, a bare `/readyz`); the rest is on the ops port
/// ([`ops_routes`]).
pub fn http_app(service: &'static str, routes: Router, ready: Readiness) -> Router {
    let request_id = HeaderName::from_static("x-request-id");
    let ops = probe_routes(ready);
    routes
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed on this route")
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn(record_metrics))
        .layer(middleware::from_fn(move |req, next| trace_context(service, req, next)))
        .merge(ops)
        .layer(
            TraceLayer::new_for_http().make_span_with(|req: &Request| {
                let route = req.extensions().get::<MatchedPath>().map_or("", |p| p.as_str());
                let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
                tracing::info_span!("request", method = %req.method(), route, request_id = id,
                                    tenant_id = tracing::field::Empty, trace_id = tracing::field::Empty)
            }),
        )
        .layer(CatchPanicLayer::custom(|_| ApiError::internal(&"handler panicked").into_response()))
        .layer(PropagateRequestIdLayer::new(request_id.clone()))
        .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
}

async fn readyz(state: State<Readiness>) -> Response {
    let (status, detail) = readiness(state).await;
    (status, axum::Json(detail)).into_response()
}

/// 200 when the database, the broker and every part are up; the detail
/// says which are.
async fn readiness(State(r): State<Readiness>) -> (StatusCode, serde_json::Value) {
    let db = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query("SELECT 1").execute(&r.pool),
    )
    .await;
    let db_ok = matches!(db, Ok(Ok(_)));
    let broker_ok = broker_reachable(&r.amqp_url).await;
    let (parts_ok, parts) = r.health.report();
    let status = if db_ok && broker_ok && parts_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut detail = serde_json::json!({"database": db_ok, "broker": broker_ok, "parts": parts});
    if !db_ok {
        let why = reliability::db::why_no_connection(&r.pool).await;
        tracing::warn!(cause = %why, "not ready: no database connection");
        detail["database_cause"] = why.into();
    }
    (status, detail)
}

/// A TCP connect to the broker's host and port: cheap enough for every probe.
async fn broker_reachable(amqp_url: &str) -> bool {
    let rest = amqp_url.split_once("://").map_or(amqp_url, |(_, r)| r);
    let host_port = rest
        .rsplit_once('@')
        .map_or(rest, |(_, r)| r)
        .split('/')
        .next()
        .unwrap_or("");
    let host_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    };
    matches!(
        tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect(host_port)
        )
        .await,
        Ok(Ok(_))
    )
}

/// `http_requests_total{method,route,status}` and
/// `http_request_duration_seconds{method,route}`, by matched route so that
/// ids in paths do not explode the label set.
async fn record_metrics(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().to_string();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!(crate::metrics::HTTP_REQUESTS, "method" => method.clone(), "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!(crate::metrics::HTTP_REQUEST_DURATION, "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// The request as a step of `service`: a child of the caller's
/// `traceparent`, or a new trace; events written while handling it carry
/// it on.
async fn trace_context(service: &'static str, req: Request, next: Next) -> Response {
    let parent = {
        let header = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
        header(trace::HEADER)
            .and_then(|parent| TraceContext::parse_with_state(parent, header(trace::STATE_HEADER)))
    };
    let method = req.method().to_string();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let mut span = trace::Span::start(
        service,
        format!("{method} {route}"),
        trace::Kind::Server,
        parent,
    );
    tracing::Span::current().record("trace_id", span.context().trace_id());
    span.set("http.request.method", method);
    span.set("http.route", route);
    let response = span.scope(next.run(req)).await;
    let status = response.status();
    span.set("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.fail(status);
    }
    response
}
