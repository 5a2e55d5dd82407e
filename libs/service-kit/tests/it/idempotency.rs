//! I3: one effect per Idempotency-Key, whatever the concurrency; replays
//! return the original response; failures leave no stuck key.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::post;
use serde::Deserialize;
use serde_json::{Value, json};
use service_kit::auth::JwtKeys;
use service_kit::http::ApiError;
use service_kit::idempotency::{IdempotencyConfig, Idempotent};
use service_kit::rate_limit::{RateLimit, RateLimiter};
use service_kit::service::{self, ServerLimits};
use sqlx::PgPool;
use testkit::{TestDb, wait_until};
use tokio_util::sync::CancellationToken;

use crate::support::{DEADLINE, tenant};

mod refusals;

mod limits;

#[derive(Clone)]
struct AppState {
    idempotency: IdempotencyConfig,
    jwt: JwtKeys,
    /// Makes the next request fail with a 500 after writing (a crash mid-handler).
    fail_next: Arc<AtomicBool>,
}

impl FromRef<AppState> for IdempotencyConfig {
    fn from_ref(s: &AppState) -> Self {
        s.idempotency.clone()
    }
}

impl FromRef<AppState> for JwtKeys {
    fn from_ref(s: &AppState) -> Self {
        s.jwt.clone()
    }
}

#[derive(Deserialize)]
struct CreateWidget {
    name: String,
    quantity: i64,
    /// Seconds the handler's transaction takes (simulated slow work).
    #[serde(default)]
    work_secs: f64,
}

async fn create_widget(State(state): State<AppState>, req: Idempotent<CreateWidget>) -> Response {
    req.answer(StatusCode::CREATED, async |body, tx| {
        let db = |e: sqlx::Error| ApiError::failure(&e.into());
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO widgets (tenant_id, name) VALUES ($1, $2) RETURNING id",
        )
        .bind(tx.tenant().get())
        .bind(&body.name)
        .fetch_one(&mut **tx)
        .await
        .map_err(db)?;
        if body.work_secs > 0.0 {
            sqlx::query("SELECT pg_sleep($1)")
                .bind(body.work_secs)
                .execute(&mut **tx)
                .await
                .map_err(db)?;
        }
        if state.fail_next.swap(false, Ordering::SeqCst) {
            return Err(ApiError::internal(&"simulated crash after a write"));
        }
        if body.quantity <= 0 {
            // A business rejection: stored like a success, but without the insert above.
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_quantity",
                "quantity must be positive",
            ));
        }
        // What the handler's own lock waits are bounded by, after the key's
        // claim used a shorter bound of its own.
        let lock_timeout: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&mut **tx)
            .await
            .map_err(db)?;
        Ok(json!({"id": id, "name": body.name, "quantity": body.quantity, "lock_timeout": lock_timeout}))
    })
    .await
}

struct App {
    url: String,
    db: TestDb,
    jwt: JwtKeys,
    fail_next: Arc<AtomicBool>,
    http: reqwest::Client,
}

/// What a test changes in the app it starts.
#[derive(Default)]
struct Options {
    /// The runtime pool, when not the test database's default one.
    pool: Option<PgPool>,
    rate: Option<RateLimit>,
    limits: Option<ServerLimits>,
}

impl App {
    async fn start(wait: Duration) -> Self {
        Self::start_on(TestDb::new().await, wait, Options::default()).await
    }

    async fn start_on(db: TestDb, wait: Duration, options: Options) -> Self {
        sqlx::raw_sql(
            "CREATE TABLE widgets (
                 tenant_id bigint NOT NULL,
                 id bigint GENERATED ALWAYS AS IDENTITY,
                 name text NOT NULL,
                 PRIMARY KEY (tenant_id, id));
             ALTER TABLE widgets ENABLE ROW LEVEL SECURITY;
             ALTER TABLE widgets FORCE ROW LEVEL SECURITY;
             CREATE POLICY tenant_isolation ON widgets
                 USING (tenant_id = (SELECT app_current_tenant()))
                 WITH CHECK (tenant_id = (SELECT app_current_tenant()));
             GRANT SELECT, INSERT ON widgets TO commerce_app;",
        )
        .execute(&db.owner)
        .await
        .unwrap();
        let jwt = JwtKeys::from_secret(b"test-secret");
        let fail_next = Arc::new(AtomicBool::new(false));
        let pool = options.pool.unwrap_or_else(|| db.app.clone());
        let mut idempotency = IdempotencyConfig::new(pool);
        idempotency.wait = wait;
        if let Some(rate) = options.rate {
            idempotency.rate_limit = RateLimiter::new(rate);
        }
        let state = AppState {
            idempotency,
            jwt: jwt.clone(),
            fail_next: fail_next.clone(),
        };
        let app = Router::new()
            .route("/widgets", post(create_widget))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let limits = options.limits.unwrap_or_default();
        tokio::spawn(async move {
            service::serve_with(listener, app, CancellationToken::new(), limits)
                .await
                .unwrap()
        });
        Self {
            url,
            db,
            jwt,
            fail_next,
            http: reqwest::Client::new(),
        }
    }

    fn token(&self, tenant_id: i64) -> String {
        self.jwt.mint(tenant(tenant_id), Duration::from_secs(600))
    }

    async fn post(
        &self,
        tenant_id: i64,
        key: Option<&str>,
        body: &str,
    ) -> (StatusCode, bool, Value) {
        let mut req = self
            .http
            .post(format!("{}/widgets", self.url))
            .bearer_auth(self.token(tenant_id))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            req = req.header("Idempotency-Key", key);
        }
        let resp = req.send().await.unwrap();
        let status = StatusCode::from_u16(resp.status().as_u16()).unwrap();
        let replayed = resp
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let retry_after = resp.headers().get("retry-after").is_some();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status == StatusCode::TOO_EARLY {
            assert!(retry_after, "425 carries Retry-After");
        }
        (status, replayed, body)
    }

    async fn widgets(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM widgets")
            .fetch_one(&self.db.owner)
            .await
            .unwrap()
    }

    async fn keys(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
            .fetch_one(&self.db.owner)
            .await
            .unwrap()
    }
}

#[tokio::test]
async fn fifty_concurrent_identical_posts_run_the_handler_once() {
    let app = Arc::new(App::start(Duration::from_secs(10)).await);
    let body = r#"{"name": "w", "quantity": 2, "work_secs": 0.3}"#;
    let responses = futures_util::future::join_all((0..50).map(|_| {
        let app = app.clone();
        async move { app.post(1, Some("same-key"), body).await }
    }))
    .await;

    assert_eq!(app.widgets().await, 1, "the handler's effect happened once");
    let originals: Vec<_> = responses
        .iter()
        .filter(|(s, replayed, _)| *s == StatusCode::CREATED && !replayed)
        .collect();
    assert_eq!(originals.len(), 1, "exactly one response is the original");
    let original = &originals[0].2;
    for (status, replayed, body) in &responses {
        match *status {
            StatusCode::CREATED => assert_eq!(
                body, original,
                "replays return the original body (replayed: {replayed})"
            ),
            StatusCode::TOO_EARLY => {}
            other => panic!("unexpected {other}: {body}"),
        }
    }
    // The claim's short wait is over: the handler waits under the role's bound.
    assert_eq!(original["lock_timeout"], "5s", "{original}");
    let app = Arc::into_inner(app).unwrap();
    app.db.cleanup().await;
}

#[tokio::test]
async fn a_replay_returns_the_original_status_and_body_and_a_different_body_is_409() {
    let metrics = reliability::metrics::install();
    let app = App::start(Duration::from_secs(5)).await;
    let (status, replayed, first) = app
        .post(1, Some("k1"), r#"{"name": "a", "quantity": 1}"#)
        .await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));

    // Same JSON, other key order and spacing: the same request.
    let (status, replayed, again) = app
        .post(1, Some("k1"), r#"{ "quantity":1,"name":"a" }"#)
        .await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, first);

    let (status, _, body) = app
        .post(1, Some("k1"), r#"{"name": "b", "quantity": 1}"#)
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["error"]["code"], "idempotency_key_reused");

    // Keys are per tenant: tenant 2 may use the same key for its own request.
    let (status, replayed, _) = app
        .post(2, Some("k1"), r#"{"name": "b", "quantity": 1}"#)
        .await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(app.widgets().await, 2);

    let text = metrics.render();
    assert!(
        text.contains(r#"idempotency_cache_misses_total{scope="POST /widgets"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"idempotency_cache_hits_total{scope="POST /widgets"} 1"#),
        "a 409 is no cache hit: {text}"
    );
    assert!(
        text.contains(r#"idempotency_conflicts_total{scope="POST /widgets"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("idempotency_check_duration_seconds_bucket"),
        "{text}"
    );
    app.db.cleanup().await;
}

#[tokio::test]
async fn a_business_rejection_is_cached_without_its_writes() {
    let app = App::start(Duration::from_secs(5)).await;
    let body = r#"{"name": "a", "quantity": 0}"#;
    let (status, replayed, first) = app.post(1, Some("k"), body).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::UNPROCESSABLE_ENTITY, false)
    );
    let (status, replayed, again) = app.post(1, Some("k"), body).await;
    assert_eq!((status, replayed), (StatusCode::UNPROCESSABLE_ENTITY, true));
    assert_eq!(again, first);
    assert_eq!(
        app.widgets().await,
        0,
        "the rejected request's insert was rolled back"
    );
    assert_eq!(app.keys().await, 1);
    app.db.cleanup().await;
}

#[tokio::test]
async fn a_crash_mid_handler_leaves_no_stuck_key_and_the_retry_runs_afresh() {
    let app = App::start(Duration::from_secs(5)).await;
    let body = r#"{"name": "a", "quantity": 3}"#;
    app.fail_next.store(true, Ordering::SeqCst);
    let (status, _, err) = app.post(1, Some("k"), body).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(err["error"]["code"], "internal_error");
    assert_eq!(
        (app.widgets().await, app.keys().await),
        (0, 0),
        "nothing of the failed request remains"
    );

    let (status, replayed, _) = app.post(1, Some("k"), body).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(app.widgets().await, 1);
    app.db.cleanup().await;
}

#[tokio::test]
async fn a_twin_still_in_flight_after_the_bounded_wait_gets_425() {
    let app = Arc::new(App::start(Duration::from_millis(200)).await);
    let body = r#"{"name": "slow", "quantity": 1, "work_secs": 3}"#;
    let first = tokio::spawn({
        let app = app.clone();
        async move { app.post(1, Some("k"), body).await }
    });
    wait_until(DEADLINE, "the first request is inside its handler", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND state = 'active' AND query LIKE 'SELECT pg_sleep%'",
        )
        .bind(&app.db.name)
        .fetch_one(&app.db.admin)
        .await
        .unwrap()
            > 0
    })
    .await;
    let (status, _, body_425) = app.post(1, Some("k"), body).await;
    assert_eq!(status, StatusCode::TOO_EARLY);
    assert_eq!(body_425["error"]["code"], "idempotency_key_in_flight");
    let (status, replayed, _) = first.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, _) = app.post(1, Some("k"), body).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    let app = Arc::into_inner(app).unwrap();
    app.db.cleanup().await;
}
