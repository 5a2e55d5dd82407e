//! Bad keys, tokens and bodies: a clear error each, and nothing written.

use std::time::Duration;

use axum::http::StatusCode;
use serde_json::Value;
use service_kit::auth::JwtKeys;

use crate::support::tenant;

use super::App;

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

/// RFC 8785 writes every number as a double: two integers past 2^53 can
/// share a canonical form, and the second request was answered with the
/// first's response for a body it never sent. It is a different body: 409.
#[tokio::test]
async fn bodies_that_differ_past_2_pow_53_are_different_requests() {
    let app = App::start(Duration::from_secs(5)).await;
    let first = r#"{"name": "a", "quantity": 9007199254740993}"#;
    let (status, _, body) = app.post(1, Some("big"), first).await;
    assert_eq!(
        (status, body["quantity"].as_i64()),
        (StatusCode::CREATED, Some(9_007_199_254_740_993))
    );
    let (status, replayed, err) = app
        .post(
            1,
            Some("big"),
            r#"{"name": "a", "quantity": 9007199254740992}"#,
        )
        .await;
    assert_eq!(
        (status, replayed, err["error"]["code"].as_str()),
        (StatusCode::CONFLICT, false, Some("idempotency_key_reused"))
    );
    let (status, replayed, _) = app.post(1, Some("big"), first).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(app.widgets().await, 1);
}
