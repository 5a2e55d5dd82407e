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
use reliability::rate_limit::{RateLimit, RateLimiter};
use reliability::service::{self, ServerLimits};
use reliability::testing::{TestDb, postgres_addr, wait_until};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

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
    let internal = |e: reliability::Error| ApiError::failure(&e);
    let db = |e: sqlx::Error| ApiError::failure(&e.into());
    let tenant = req.tenant().get();
    let (body, tx) = req.parts();
    let id: i64 =
        sqlx::query_scalar("INSERT INTO widgets (tenant_id, name) VALUES ($1, $2) RETURNING id")
            .bind(tenant)
            .bind(&body.name)
            .fetch_one(&mut **tx)
            .await
            .map_err(db)?;
    if req.body.work_secs > 0.0 {
        sqlx::query("SELECT pg_sleep($1)")
            .bind(req.body.work_secs)
            .execute(&mut **req.tx())
            .await
            .map_err(db)?;
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

#[tokio::test]
async fn over_the_rate_limit_a_write_gets_429_runs_nothing_and_its_key_stays_free() {
    let rate = RateLimit {
        per_sec: 2,
        burst: 2,
    };
    let options = Options {
        rate: Some(rate),
        ..Options::default()
    };
    let app = App::start_on(TestDb::new().await, Duration::from_secs(1), options).await;
    let body = r#"{"name": "w", "quantity": 1}"#;
    for key in ["a", "b"] {
        assert_eq!(app.post(1, Some(key), body).await.0, StatusCode::CREATED);
    }
    let limited = app
        .http
        .post(format!("{}/widgets", app.url))
        .bearer_auth(app.token(1))
        .header("Idempotency-Key", "c")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(limited.status().as_u16(), 429);
    assert!(limited.headers().contains_key("retry-after"));
    assert_eq!(app.widgets().await, 2, "the limited request ran nothing");
    assert_eq!(app.keys().await, 2, "and claimed no key");
    // Another tenant has a bucket of its own.
    assert_eq!(app.post(2, Some("a"), body).await.0, StatusCode::CREATED);
    // Once the bucket refills, the same key runs afresh.
    let retried = std::cell::RefCell::new((StatusCode::TOO_MANY_REQUESTS, false));
    wait_until(DEADLINE, "the limited key to be accepted", || async {
        let (status, replayed, _) = app.post(1, Some("c"), body).await;
        *retried.borrow_mut() = (status, replayed);
        status != StatusCode::TOO_MANY_REQUESTS
    })
    .await;
    assert_eq!(retried.into_inner(), (StatusCode::CREATED, false));
    app.db.cleanup().await;
}

#[tokio::test]
async fn a_burst_of_one_key_holds_one_connection_and_other_tenants_are_served() {
    let db = TestDb::new().await;
    // Two connections, given up on after 1.5 s: without the in-process
    // wait, the twins would queue on the pool and starve tenant 2.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(1500))
        .connect_with(db.app.connect_options().as_ref().clone())
        .await
        .unwrap();
    let options = Options {
        pool: Some(pool),
        ..Options::default()
    };
    let app = Arc::new(App::start_on(db, Duration::from_secs(1), options).await);
    let slow = r#"{"name": "w", "quantity": 1, "work_secs": 3}"#;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.post(1, Some("hot"), slow).await })
    };
    let started = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%' AND datname = $1)",
        )
        .bind(&app.db.name)
        .fetch_one(&app.db.admin)
        .await
        .unwrap()
    };
    wait_until(DEADLINE, "the first request to be in its handler", started).await;
    let twins = futures_util::future::join_all((0..40).map(|_| {
        let app = app.clone();
        async move { app.post(1, Some("hot"), slow).await.0 }
    }));
    let other = async {
        app.post(2, Some("cold"), r#"{"name": "x", "quantity": 1}"#)
            .await
            .0
    };
    let (twins, other) = tokio::join!(twins, other);
    assert_eq!(
        other,
        StatusCode::CREATED,
        "another tenant is served during the burst"
    );
    assert!(
        twins
            .iter()
            .all(|s| *s == StatusCode::TOO_EARLY || *s == StatusCode::CREATED),
        "twins get 425 or the replay, never a 5xx: {twins:?}"
    );
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(app.widgets().await, 2);
    Arc::into_inner(app).unwrap().db.cleanup().await;
}

#[tokio::test]
async fn the_database_cut_off_mid_request_gets_503_and_the_key_stays_free() {
    let db = TestDb::new().await;
    let proxy = reliability::testing::TcpProxy::start(postgres_addr()).await;
    let options = Options {
        pool: Some(db.pool_via("commerce_app", proxy.addr).await),
        ..Options::default()
    };
    let app = Arc::new(App::start_on(db, Duration::from_secs(1), options).await);
    let body = r#"{"name": "w", "quantity": 1, "work_secs": 5}"#;
    let in_flight = {
        let app = app.clone();
        tokio::spawn(async move { app.post(1, Some("k"), body).await })
    };
    let started = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%' AND datname = $1)",
        )
        .bind(&app.db.name)
        .fetch_one(&app.db.admin)
        .await
        .unwrap()
    };
    wait_until(DEADLINE, "the request to be in its handler", started).await;
    proxy.down();
    let (status, _, body_json) = in_flight.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body_json}");
    assert_eq!(body_json["error"]["code"], "unavailable");
    // While it is down, new requests get 503 too (with Retry-After).
    let down = app
        .http
        .post(format!("{}/widgets", app.url))
        .bearer_auth(app.token(1))
        .header("Idempotency-Key", "k2")
        .header("content-type", "application/json")
        .body(r#"{"name": "w", "quantity": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(down.status().as_u16(), 503);
    assert!(down.headers().contains_key("retry-after"));
    proxy.up();
    // The same request again: the key was never kept, so it runs afresh.
    let again = std::cell::RefCell::new((StatusCode::SERVICE_UNAVAILABLE, false));
    wait_until(DEADLINE, "the retry to get through", || async {
        let (status, replayed, _) = app.post(1, Some("k"), body).await;
        *again.borrow_mut() = (status, replayed);
        // 425 until PostgreSQL notices the cut client and rolls its claim back.
        status != StatusCode::SERVICE_UNAVAILABLE && status != StatusCode::TOO_EARLY
    })
    .await;
    assert_eq!(again.into_inner(), (StatusCode::CREATED, false));
    assert_eq!(app.widgets().await, 1);
    drop(proxy);
    Arc::into_inner(app).unwrap().db.cleanup().await;
}

/// Reads until the server closes the connection; what it sent, or `None`
/// if it kept the connection open past `within`.
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    read.ok()
        .map(|()| String::from_utf8_lossy(&got).into_owned())
}

#[tokio::test]
async fn slow_and_idle_clients_are_cut_off_without_holding_a_database_connection() {
    use tokio::io::AsyncWriteExt;
    let limits = ServerLimits {
        header_read: Duration::from_millis(500),
        request: Duration::from_secs(1),
    };
    let options = Options {
        limits: Some(limits),
        ..Options::default()
    };
    let app = App::start_on(TestDb::new().await, Duration::from_secs(1), options).await;
    let addr = app.url.trim_start_matches("http://").to_owned();

    // Headers that never end.
    let mut slow_headers = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow_headers
        .write_all(b"POST /widgets HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    assert!(
        closed_within(&mut slow_headers, Duration::from_secs(5))
            .await
            .is_some(),
        "a client that never finishes its headers is cut off"
    );

    // A body trickled a byte at a time: 408, nothing claimed or written.
    let mut slow_body = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /widgets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nIdempotency-Key: slow\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{",
        app.token(1)
    );
    slow_body.write_all(head.as_bytes()).await.unwrap();
    let trickle = async {
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if slow_body.write_all(b" ").await.is_err() {
                break;
            }
            let pool = &app.db.app;
            assert_eq!(
                pool.size() as usize,
                pool.num_idle(),
                "no database connection is held while the body arrives"
            );
        }
    };
    trickle.await;
    let answer = closed_within(&mut slow_body, Duration::from_secs(5))
        .await
        .expect("the slow body's connection is closed");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert_eq!((app.widgets().await, app.keys().await), (0, 0));

    // An idle keep-alive connection is closed too.
    let mut idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    idle.write_all(b"GET /widgets HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answer = closed_within(&mut idle, Duration::from_secs(5))
        .await
        .expect("an idle connection is closed");
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    app.db.cleanup().await;
}
