//! The HTTP contract of orders (shared/api.md).

use std::sync::Arc;

use serde_json::{Value, json};

use crate::{ORDER, TestApp};

#[tokio::test]
async fn placing_an_order_answers_201_with_the_order_and_writes_order_placed() {
    let app = TestApp::spawn().await;
    let (status, replayed, body) = app.place(1, "k-1", ORDER).await;
    assert_eq!((status, replayed), (201, false), "{body}");
    assert_eq!(body["status"], "pending");
    assert_eq!(body["customer_id"], "c-1");
    assert_eq!(body["currency"], "EUR");
    assert_eq!(body["total_cents"], 2599);
    assert_eq!(body["lines"].as_array().unwrap().len(), 2);
    assert!(body["created_at"].is_string());

    let (status, fetched) = app.get(1, &format!("/orders/{}", body["order_id"])).await;
    assert_eq!(status, 200);
    assert_eq!(fetched, body);

    let (event_type, payload): (String, Value) =
        sqlx::query_as("SELECT event_type, payload FROM outbox_messages")
            .fetch_one(&app.db.owner)
            .await
            .unwrap();
    assert_eq!(event_type, "OrderPlaced");
    assert_eq!(payload["order_id"], body["order_id"]);
    assert_eq!(payload["total_cents"], 2599);
    assert_eq!(
        payload["lines"][0],
        json!({"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250})
    );
    app.stop().await;
}

#[tokio::test]
async fn invalid_orders_get_422_and_write_nothing_but_the_cached_answer() {
    let app = TestApp::spawn().await;
    let line = |q: i64, p: i64| json!({"sku": "S", "quantity": q, "unit_price_cents": p});
    let order = |customer: &str, currency: &str, lines: Vec<Value>| {
        json!({"customer_id": customer, "currency": currency, "lines": lines}).to_string()
    };
    let cases = [
        order("c", "EUR", vec![]),
        order("c", "EUR", vec![line(1, 1); 101]),
        order("c", "EUR", vec![line(0, 1)]),
        order("c", "EUR", vec![line(10_001, 1)]),
        order("c", "EUR", vec![line(1, -1)]),
        order("c", "EUR", vec![line(1, 100_000_001)]),
        order("c", "eur", vec![line(1, 1)]),
        order("c", "EURO", vec![line(1, 1)]),
        order("", "EUR", vec![line(1, 1)]),
        order(&"c".repeat(65), "EUR", vec![line(1, 1)]),
        json!({"customer_id": "c", "currency": "EUR", "lines": [{"sku": "", "quantity": 1, "unit_price_cents": 1}]}).to_string(),
        json!({"customer_id": "c", "currency": "EUR", "lines": [{"sku": "S", "quantity": 1e30, "unit_price_cents": 1}]}).to_string(),
        json!({"customer_id": "c", "currency": "EUR"}).to_string(),
        json!([1, 2, 3]).to_string(),
    ];
    for (i, body) in cases.iter().enumerate() {
        let (status, _, err) = app.place(1, &format!("bad-{i}"), body).await;
        assert_eq!(status, 422, "case {i}: {body} -> {err}");
        assert!(
            err["error"]["code"].is_string() && err["error"]["message"].is_string(),
            "{err}"
        );
    }
    assert_eq!(
        (
            app.count("orders").await,
            app.count("order_lines").await,
            app.count("outbox_messages").await
        ),
        (0, 0, 0)
    );
    app.stop().await;
}

#[tokio::test]
async fn malformed_oversized_and_unauthenticated_requests_get_400_413_401() {
    let app = TestApp::spawn().await;
    let (status, _, err) = app.place(1, "k", "{\"customer_id\": ").await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (400, Some("malformed_json"))
    );

    let huge = format!(
        r#"{{"customer_id": "{}", "currency": "EUR", "lines": []}}"#,
        "x".repeat(70 * 1024)
    );
    let (status, _, err) = app.place(1, "k2", &huge).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (413, Some("payload_too_large"))
    );

    // Without Content-Length (chunked), the limit still holds.
    let stream =
        futures_util::stream::iter((0..80).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1024])));
    let resp = app
        .api
        .http
        .post(format!("{}/orders", app.api.url))
        .bearer_auth(app.api.token(1))
        .header("Idempotency-Key", "k3")
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 413);

    for auth in [None, Some("Bearer nonsense"), Some("Basic dXNlcjpwYXNz")] {
        let mut req = app
            .api
            .http
            .post(format!("{}/orders", app.api.url))
            .header("Idempotency-Key", "k4")
            .body(ORDER);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 401, "{auth:?}");
    }
    let expired = {
        #[derive(serde::Serialize)]
        struct Claims {
            tenant_id: i64,
            exp: u64,
        }
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            - 10;
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &Claims { tenant_id: 1, exp },
            &jsonwebtoken::EncodingKey::from_secret(b"dev-secret-change-me"),
        )
        .unwrap()
    };
    let resp = app
        .api
        .http
        .get(format!("{}/orders/1", app.api.url))
        .bearer_auth(expired)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);

    let (status, _, err) = app.place(1, "", ORDER).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (400, Some("idempotency_key_invalid"))
    );
    let resp = app
        .api
        .http
        .post(format!("{}/orders", app.api.url))
        .bearer_auth(app.api.token(1))
        .body(ORDER)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400, "no Idempotency-Key at all");
    assert_eq!(
        (
            app.count("orders").await,
            app.count("outbox_messages").await
        ),
        (0, 0)
    );
    app.stop().await;
}

#[tokio::test]
async fn another_tenants_order_is_not_found_exactly_like_a_missing_one() {
    let app = TestApp::spawn().await;
    let (_, _, order) = app.place(1, "k", ORDER).await;
    let path = format!("/orders/{}", order["order_id"]);
    let (theirs, theirs_body) = app.get(2, &path).await;
    let (missing, missing_body) = app.get(2, "/orders/999999999").await;
    let (junk, _) = app.get(2, "/orders/not-a-number").await;
    assert_eq!((theirs, missing, junk), (404, 404, 404));
    assert_eq!(theirs_body, missing_body, "no difference to learn from");
    // Tenant 2 reusing tenant 1's key creates its own order, not a replay.
    let (status, replayed, _) = app.place(2, "k", ORDER).await;
    assert_eq!((status, replayed), (201, false));
    assert_eq!(app.get(1, &path).await.0, 200);
    app.stop().await;
}

#[tokio::test]
async fn fifty_concurrent_identical_posts_create_one_order() {
    let app = Arc::new(TestApp::spawn().await);
    let responses = futures_util::future::join_all((0..50).map(|_| {
        let app = app.clone();
        async move { app.place(1, "same", ORDER).await }
    }))
    .await;
    assert_eq!(app.count("orders").await, 1);
    assert_eq!(app.count("outbox_messages").await, 1, "one OrderPlaced");
    // The one that created it (a 425 for a twin still in flight is not a
    // replay either).
    let first = responses
        .iter()
        .find(|(status, replayed, _)| *status == 201 && !replayed)
        .unwrap()
        .2
        .clone();
    for (status, _, body) in &responses {
        assert!(*status == 201 || *status == 425, "{status} {body}");
        if *status == 201 {
            assert_eq!(body, &first);
        }
    }
    let (status, _, err) = app.place(1, "same", &ORDER.replace("c-1", "c-2")).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (409, Some("idempotency_key_reused"))
    );
    Arc::into_inner(app).unwrap().stop().await;
}

#[tokio::test]
async fn the_api_port_answers_probes_and_the_ops_port_the_metrics() {
    let app = TestApp::spawn().await;
    let get = |url: String| {
        let http = app.api.http.clone();
        async move {
            let resp = http.get(url).send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }
    };
    for (path, status) in [
        ("/healthz", 200),
        ("/readyz", 200),
        ("/metrics", 404),
        ("/openapi.json", 200),
        ("/nope", 404),
    ] {
        assert_eq!(
            get(format!("{}{path}", app.api.url)).await.0,
            status,
            "{path}"
        );
    }
    // A bare status on the API port; the detail on the ops port.
    let (_, bare) = get(format!("{}/readyz", app.api.url)).await;
    assert_eq!(
        serde_json::from_str::<Value>(&bare).unwrap(),
        json!({"status": "ready"})
    );
    let (status, detail) = get(format!("{}/readyz", app.ops)).await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&detail).unwrap()["database"],
        true
    );
    assert_eq!(get(format!("{}/metrics", app.ops)).await.0, 200);
    // The process's own gauges and its pools' (the test's app pool: 10).
    testkit::wait_until(
        std::time::Duration::from_secs(15),
        "process and pool gauges",
        || async {
            let text = app.metrics().await;
            text.contains(r#"db_pool_max_connections{pool="app"} 10"#)
                && text.contains(r#"db_pool_connections{pool="app",state="in_use"}"#)
                && text
                    .lines()
                    .filter_map(|l| l.strip_prefix("process_resident_memory_bytes "))
                    .any(|v| v.parse::<f64>().is_ok_and(|v| v > 1e6))
        },
    )
    .await;
    // The document is built from the same macro that registers the routes.
    let doc: Value = app
        .api
        .http
        .get(format!("{}/openapi.json", app.api.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let paths: Vec<&String> = doc["paths"].as_object().unwrap().keys().collect();
    assert_eq!(paths, ["/orders", "/orders/{order_id}"]);
    assert_eq!(
        doc["paths"]["/orders"]["post"]["parameters"][0]["name"],
        "Idempotency-Key"
    );
    app.place(1, "m", ORDER).await;
    let text = app.metrics().await;
    assert!(
        text.contains(r#"http_requests_total{method="POST",route="/orders",status="201"}"#),
        "{text}"
    );
    // What runs: the workspace's version, and the commit (or `unknown`).
    let build = text
        .lines()
        .find(|l| l.starts_with("build_info{"))
        .expect(&text);
    assert!(
        build.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{build}"
    );
    assert!(build.contains("commit=\""), "{build}");
    app.stop().await;
}

#[tokio::test]
async fn order_ids_say_nothing_about_other_tenants_orders() {
    let app = TestApp::spawn().await;
    let id = |body: &Value| body["order_id"].as_i64().expect("a JSON integer");
    let (_, _, first) = app.place(1, "mine-1", ORDER).await;
    for i in 0..5 {
        let (status, _, _) = app.place(2, &format!("theirs-{i}"), ORDER).await;
        assert_eq!(status, 201);
    }
    let (_, _, second) = app.place(1, "mine-2", ORDER).await;
    let (a, b) = (id(&first), id(&second));
    // With a global counter the gap would be 6: tenant 2's five orders.
    assert_ne!(b - a, 6, "{a} then {b}");
    assert_ne!(b - a, 1);
    for v in [a, b] {
        assert!(
            (1i64 << 48..1i64 << 53).contains(&v),
            "{v}: opaque, exact in JavaScript"
        );
    }
    // The permutation behind them never repeats.
    let distinct: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT opaque_id(n)) FROM generate_series(0, 19999) n")
            .fetch_one(&app.db.owner)
            .await
            .unwrap();
    assert_eq!(distinct, 20_000);
    app.stop().await;
}
