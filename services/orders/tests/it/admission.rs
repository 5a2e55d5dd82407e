//! Admission that follows the pipeline (docs/adr/0027): a tenant at its
//! bound of orders in flight is refused with a `Retry-After`, its key left
//! free; a retry of an order it placed gets its stored 201; other tenants,
//! reads, and the same tenant once an order is decided, are served.

use testkit::Answer;

use crate::{ORDER, TestApp};

/// Tenant 7 may have 3 orders undecided; everyone else the default.
const BOUNDED: i64 = 7;

async fn place_raw(app: &TestApp, tenant: i64, key: &str) -> (u16, Option<u32>, String) {
    let resp = app
        .api
        .http
        .post(format!("{}/orders", app.api.url))
        .bearer_auth(app.api.token(tenant))
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(ORDER)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    let code = body["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    (status, retry_after, code)
}

async fn keys_of(app: &TestApp, tenant: i64, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1 AND key = $2")
        .bind(tenant)
        .bind(key)
        .fetch_one(&app.db.owner)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_tenant_at_its_bound_is_refused_with_its_key_left_free_and_its_retries_and_others_are_served()
 {
    let app = TestApp::spawn_with(|c| {
        c.admission_tenant_max_in_flight = format!("{BOUNDED}=3");
        // Counted on every request, so the test sees each order at once.
        c.admission_refresh_ms = 0;
    })
    .await;
    let mut placed = Vec::new();
    for i in 0..3 {
        let (status, _, order): Answer = app.place(BOUNDED, &format!("k{i}"), ORDER).await;
        assert_eq!(status, 201, "{order}");
        placed.push(order["order_id"].clone());
    }

    let (status, retry_after, code) = place_raw(&app, BOUNDED, "k3").await;
    assert_eq!((status, code.as_str()), (429, "backlog_full"));
    let secs = retry_after.expect("a Retry-After");
    // None of the tenant's work has been decided yet: a first burst, not
    // a stalled pipeline, so it is asked back in about a second (what has
    // passed since its first order), not a minute.
    assert!(secs <= 5, "Retry-After {secs}");
    assert_eq!(
        keys_of(&app, BOUNDED, "k3").await,
        0,
        "the key was not claimed"
    );
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE tenant_id = $1")
        .bind(BOUNDED)
        .fetch_one(&app.db.owner)
        .await
        .unwrap();
    assert_eq!(orders, 3, "the refused order wrote nothing");

    // A retry of an accepted order, at the bound: its stored 201, not a
    // 429 (issue 44: admission comes after the key's look-up).
    let (status, replayed, again) = app.place(BOUNDED, "k0", ORDER).await;
    assert_eq!((status, replayed), (201, true), "{again}");
    assert_eq!(again["order_id"], placed[0]);

    // Another tenant is accepted; reads are never gated.
    assert_eq!(app.place(8, "k3", ORDER).await.0, 201);
    let (status, _) = app
        .get(
            BOUNDED,
            &format!(
                "/orders/{}",
                placed[0]
                    .as_str()
                    .map_or_else(|| placed[0].to_string(), str::to_owned)
            ),
        )
        .await;
    assert_eq!(status, 200);

    // The saga decides one: the refused key now runs afresh.
    sqlx::query("UPDATE orders SET status = 'confirmed' WHERE tenant_id = $1 AND order_id = (SELECT min(order_id) FROM orders WHERE tenant_id = $1)")
        .bind(BOUNDED)
        .execute(&app.db.owner)
        .await
        .unwrap();
    let (status, replayed, _) = app.place(BOUNDED, "k3", ORDER).await;
    assert_eq!((status, replayed), (201, false));

    let metrics = app.metrics().await;
    assert!(metrics.contains("admission_refused_total"), "{metrics}");
    app.stop().await;
}

/// Reads have a per-tenant budget of their own (issue 43): over it, a read
/// is answered 429 with `Retry-After` and `rate_limited` before its
/// handler runs; another tenant's reads and the same tenant's writes are
/// served, and the read passes again once the bucket refills. Before the
/// budget, reads had no limit at all.
#[tokio::test]
async fn reads_have_a_per_tenant_budget_of_their_own() {
    let app = TestApp::spawn_with(|c| {
        c.read_rate_limit_per_sec = 1;
        c.read_rate_limit_burst = 3;
    })
    .await;
    let (status, _, order): Answer = app.place(1, "k0", ORDER).await;
    assert_eq!(status, 201, "{order}");
    let path = format!("/orders/{}", order["order_id"]);
    for _ in 0..3 {
        assert_eq!(app.api.get(1, &path).await.0, 200);
    }
    let over = app
        .api
        .http
        .get(format!("{}{path}", app.api.url))
        .bearer_auth(app.api.token(1))
        .send()
        .await
        .unwrap();
    assert_eq!(over.status().as_u16(), 429);
    assert!(over.headers().contains_key("retry-after"));
    let body: serde_json::Value = over.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_ne!(
        app.api.get(2, &path).await.0,
        429,
        "another tenant's bucket"
    );
    let (status, _, _): Answer = app.place(1, "k1", ORDER).await;
    assert_eq!(status, 201, "writes have a budget of their own");
    testkit::wait_until(
        std::time::Duration::from_secs(5),
        "the bucket refilled",
        || async { app.api.get(1, &path).await.0 == 200 },
    )
    .await;
}

/// Orders the pipeline will never decide (their saga events dead-lettered,
/// say) leave the count once undecided past `ADMISSION_STUCK_AFTER_SECS`:
/// the tenant is no longer locked out, and the gauge counts them (issue
/// 44). Before, they counted against the bound until an operator re-drove.
#[tokio::test]
async fn orders_undecided_past_the_stuck_bound_no_longer_lock_their_tenant_out() {
    let app = TestApp::spawn_with(|c| {
        c.admission_tenant_max_in_flight = format!("{BOUNDED}=2");
        c.admission_refresh_ms = 0;
        c.admission_stuck_after_secs = 60;
    })
    .await;
    for i in 0..2 {
        let (status, _, order): Answer = app.place(BOUNDED, &format!("k{i}"), ORDER).await;
        assert_eq!(status, 201, "{order}");
    }
    assert_eq!(place_raw(&app, BOUNDED, "k2").await.0, 429);

    // Still pending ten minutes on: stuck, not in flight.
    sqlx::query(
        "UPDATE orders SET created_at = created_at - interval '10 minutes' WHERE tenant_id = $1",
    )
    .bind(BOUNDED)
    .execute(&app.db.owner)
    .await
    .unwrap();
    let (status, replayed, order) = app.place(BOUNDED, "k2", ORDER).await;
    assert_eq!((status, replayed), (201, false), "{order}");
    let metrics = app.metrics().await;
    assert!(metrics.contains("admission_stuck_work 2"), "{metrics}");
    app.stop().await;
}
