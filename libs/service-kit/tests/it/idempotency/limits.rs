//! The key's guarantees at the edges: over the rate limit, a burst of one key, the database cut off mid-request, slow and idle clients.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use service_kit::rate_limit::RateLimit;
use service_kit::service::ServerLimits;
use testkit::{TestDb, postgres_addr, wait_until};

use crate::support::DEADLINE;

use super::{App, Options};

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
    let proxy = testkit::TcpProxy::start(postgres_addr()).await;
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
