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
use reliability::auth::JwtKeys;
use reliability::http::ApiError;
use reliability::idempotency::{IdempotencyConfig, Idempotent};
use reliability::testing::{TestDb, wait_until};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::support::{DEADLINE, tenant};

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

async fn create_widget(
    State(state): State<AppState>,
    mut req: Idempotent<CreateWidget>,
) -> Result<Response, ApiError> {
    let internal = |e: reliability::Error| ApiError::internal(&e);
    let id: i64 =
        sqlx::query_scalar("INSERT INTO widgets (tenant_id, name) VALUES ($1, $2) RETURNING id")
            .bind(req.tenant().get())
            .bind(&req.body.name)
            .fetch_one(&mut *req.tx)
            .await
            .map_err(|e| ApiError::internal(&e))?;
    if req.body.work_secs > 0.0 {
        sqlx::query("SELECT pg_sleep($1)")
            .bind(req.body.work_secs)
            .execute(&mut *req.tx)
            .await
            .map_err(|e| ApiError::internal(&e))?;
    }
    if state.fail_next.swap(false, Ordering::SeqCst) {
        return Err(ApiError::internal(&"simulated crash after a write"));
    }
    if req.body.quantity <= 0 {
        // A business rejection: cached like a success, but without the insert above.
        let body =
            json!({"error": {"code": "invalid_quantity", "message": "quantity must be positive"}});
        return req
            .complete(StatusCode::UNPROCESSABLE_ENTITY, &body)
            .await
            .map_err(internal);
    }
    let body = json!({"id": id, "name": req.body.name, "quantity": req.body.quantity});
    req.complete(StatusCode::CREATED, &body)
        .await
        .map_err(internal)
}

struct App {
    url: String,
    db: TestDb,
    jwt: JwtKeys,
    fail_next: Arc<AtomicBool>,
    http: reqwest::Client,
}

impl App {
    async fn start(wait: Duration) -> Self {
        let db = TestDb::new().await;
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
        let mut idempotency = IdempotencyConfig::new(db.app.clone());
        idempotency.wait = wait;
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
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
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
        text.contains(r#"idempotency_cache_hits_total{scope="POST /widgets"} 2"#),
        "{text}"
    );
    assert!(text.contains("idempotency_check_duration_bucket"), "{text}");
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

#[tokio::test]
async fn bad_keys_tokens_and_bodies_get_clear_errors_and_write_nothing() {
    let app = App::start(Duration::from_secs(5)).await;
    let good = r#"{"name": "a", "quantity": 1}"#;
    let cases: Vec<(Option<&str>, &str, StatusCode, &str)> = vec![
        (
            None,
            good,
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
        ),
        (
            Some("has space"),
            good,
            StatusCode::BAD_REQUEST,
            "idempotency_key_invalid",
        ),
        (
            Some("k"),
            "{not json",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("k"),
            r#"{"name": 5}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
    ];
    for (key, body, status, code) in cases {
        let (got, _, err) = app.post(1, key, body).await;
        assert_eq!(
            (got, err["error"]["code"].as_str().unwrap()),
            (status, code),
            "key {key:?} body {body}"
        );
    }
    let long_key = "k".repeat(256);
    assert_eq!(
        app.post(1, Some(&long_key), good).await.0,
        StatusCode::BAD_REQUEST
    );

    let resp = app
        .http
        .post(format!("{}/widgets", app.url))
        .header("Idempotency-Key", "k")
        .body(good)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let forged = JwtKeys::from_secret(b"another-secret").mint(tenant(1), Duration::from_secs(60));
    let resp = app
        .http
        .post(format!("{}/widgets", app.url))
        .bearer_auth(forged)
        .header("Idempotency-Key", "k")
        .body(good)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthorized");

    assert_eq!((app.widgets().await, app.keys().await), (0, 0));
    app.db.cleanup().await;
}
