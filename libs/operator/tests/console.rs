//! `reliability console` over HTTP, against a real PostgreSQL: the token
//! and the CSRF token in front of every action, read-only mode, an action
//! that does nothing twice, and an order's story (issue 45).

use operator::console::Auth;
use operator::ops;
use reqwest::StatusCode;
use support::{FormBody, client};
use testkit::TestDb;

mod support;

const TOKEN: &str = "operator-token-for-tests";

/// One dead-lettered outbox row of tenant 1's order 42, and that order's
/// row: what a console over "orders" has to show.
async fn estate() -> (TestDb, ops::Estate) {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE TABLE orders (tenant_id bigint, order_id bigint, status text, created_at timestamptz);
         INSERT INTO orders VALUES (1, 42, 'pending', now() - interval '1 hour'),
                                   (1, 43, 'confirmed', now() - interval '1 hour'),
                                   (2, 44, 'pending', now());
         INSERT INTO outbox_messages_dlq (id, tenant_id, aggregate_type, aggregate_id, event_type,
                                          event_version, payload, headers, occurred_at, attempts, last_error)
         VALUES (900, 1, 'order', '42', 'OrderPlaced', 1, '{\"order_id\": 42}', '{}', now(), 10,
                 'no queue took it')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let estate = ops::Estate {
        databases: vec![("orders".into(), db.owner.clone())],
        broker: None,
        queue_prefix: String::new(),
        exchange: "commerce.events".into(),
        subscriptions: &[],
        ordered_partitions: String::new(),
        management_url: None,
    };
    (db, estate)
}

async fn spawn(estate: ops::Estate, auth: Auth, read_only: bool) -> String {
    support::serve(estate, auth, read_only, Vec::new()).await
}

async fn dlq_rows(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_messages_dlq")
        .fetch_one(&db.owner)
        .await
        .unwrap()
}

/// The CSRF token the overview's re-drive form carries.
fn csrf_in(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a CSRF token")
        + 19;
    page[at..at + 64].to_owned()
}

#[tokio::test]
async fn without_the_token_401_a_forged_post_does_nothing_and_a_redrive_happens_once() {
    let (db, estate) = estate().await;
    let url = spawn(estate, Auth::token(TOKEN), false).await;
    let http = client();

    let anonymous = http.get(&url).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    assert!(anonymous.text().await.unwrap().contains("Operator token"));
    let redrive = format!("{url}/outbox/orders/redrive");
    let anonymous_post = http
        .post(&redrive)
        .form(&[("csrf", "x")])
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous_post.status(), StatusCode::UNAUTHORIZED);
    let wrong = http
        .post(format!("{url}/login"))
        .form(&[("token", "guess")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);

    // A browser: the token once, then its session cookie.
    let login = http
        .post(format!("{url}/login"))
        .form(&[("token", TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), StatusCode::SEE_OTHER);
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_owned();
    let overview = http
        .get(&url)
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(overview.status(), StatusCode::OK);
    let page = overview.text().await.unwrap();
    assert!(page.contains("Re-drive 1"), "{page}");

    // A page elsewhere that posts with the operator's cookie has no CSRF token.
    for forged in [vec![], vec![("csrf", "00".repeat(32))]] {
        let answer = http
            .post(&redrive)
            .header("cookie", &session)
            .form(&forged)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    }
    assert_eq!(dlq_rows(&db).await, 1, "a forged POST re-drove nothing");

    let csrf = csrf_in(&page);
    let first = http
        .post(&redrive)
        .header("cookie", &session)
        .form(&[("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::SEE_OTHER);
    assert_eq!(dlq_rows(&db).await, 0);
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE id = 900")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    assert_eq!(pending, 1, "the row is in the outbox again, under its id");
    let said = http
        .get(format!(
            "{url}{}",
            first.headers()["location"].to_str().unwrap()
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(said.contains("1 row(s) of orders"), "{said}");

    // The double click, or a second operator: said, and nothing done.
    let second = http
        .post(&redrive)
        .bearer_auth(TOKEN)
        .form(&[("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), StatusCode::CONFLICT);
    assert!(second.text().await.unwrap().contains("re-driven already"));
    db.cleanup().await;
}

#[tokio::test]
async fn read_only_draws_no_button_and_refuses_every_post() {
    let (db, estate) = estate().await;
    let url = spawn(estate, Auth::token(TOKEN), true).await;
    let http = client();
    let page = http
        .get(&url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("outbox"), "{page}");
    assert!(
        !page.contains("<form method=\"post\""),
        "no action in read-only mode: {page}"
    );
    let csrf = Auth::token(TOKEN).csrf();
    let answer = http
        .post(format!("{url}/outbox/orders/redrive"))
        .bearer_auth(TOKEN)
        .form(&[("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    assert_eq!(dlq_rows(&db).await, 1);
    db.cleanup().await;
}

#[tokio::test]
async fn an_order_page_tells_its_story_and_an_unknown_order_says_so() {
    let (db, estate) = estate().await;
    let url = spawn(estate, Auth::none(), false).await;
    let http = client();
    let story = http
        .get(format!("{url}/orders?tenant=1&id=42"))
        .send()
        .await
        .unwrap();
    assert_eq!(story.status(), StatusCode::OK);
    let page = story.text().await.unwrap();
    assert!(page.contains("Order 42 of tenant 1"), "{page}");
    assert!(
        page.contains("&#34;status&#34;: &#34;pending&#34;"),
        "{page}"
    );
    assert!(
        page.contains("OrderPlaced") && page.contains("outbox_dlq"),
        "its dead-lettered event: {page}"
    );

    let unknown = http
        .get(format!("{url}/orders?tenant=1&id=45"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    assert!(
        unknown
            .text()
            .await
            .unwrap()
            .contains("tenant 1 has no order 45")
    );
    // Another tenant's order is not this tenant's.
    let other = http
        .get(format!("{url}/orders?tenant=2&id=42"))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::NOT_FOUND);
    for bad in ["tenant=x&id=42", "tenant=0&id=42", "tenant=1"] {
        let answer = http
            .get(format!("{url}/orders?{bad}"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::BAD_REQUEST, "{bad}");
    }
    db.cleanup().await;
}

async fn release_requested(db: &TestDb) -> bool {
    sqlx::query_scalar("SELECT release_requested_at IS NOT NULL FROM parked_aggregates")
        .fetch_one(&db.owner)
        .await
        .unwrap()
}

/// A parked aggregate: the page shows why and its first event; a skip
/// asks first and drops only the event it showed, once; an unpark is
/// asked once and a second click says it is under way.
#[tokio::test]
async fn a_parked_aggregate_is_skipped_only_as_shown_and_unparked_once() {
    let (db, estate) = estate().await;
    sqlx::raw_sql(
        "INSERT INTO parked_aggregates (tenant_id, consumer, source, aggregate_type, aggregate_id, error)
         VALUES (1, 'projection.history', 'orders', 'order', '42', 'handler: no such status');
         INSERT INTO parked_events (tenant_id, consumer, source, aggregate_type, aggregate_id,
                                    message_id, aggregate_seq, event_type, envelope)
         VALUES (1, 'projection.history', 'orders', 'order', '42', 900, 3, 'OrderConfirmed', '{}'),
                (1, 'projection.history', 'orders', 'order', '42', 901, 4, 'OrderShipped', '{}')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let url = spawn(estate, Auth::token(TOKEN), false).await;
    let http = client();
    let get = |path: String| {
        let http = http.clone();
        async move {
            let answer = http.get(path).bearer_auth(TOKEN).send().await.unwrap();
            (answer.status(), answer.text().await.unwrap())
        }
    };
    let post = |path: &str, fields: Vec<(&'static str, String)>| {
        let (http, path) = (http.clone(), format!("{url}{path}"));
        async move {
            let answer = http
                .post(path)
                .bearer_auth(TOKEN)
                .form(&fields)
                .send()
                .await
                .unwrap();
            (answer.status(), answer.text().await.unwrap())
        }
    };
    let (status, page) = get(format!("{url}/parked")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains("handler: no such status")
            && page.contains("OrderConfirmed (number 3, message 900)"),
        "{page}"
    );
    let csrf = csrf_in(&page);
    // The aggregate's fields and this console's CSRF token; `extra`
    // overrides or adds.
    let aggregate = |extra: &[(&'static str, &str)]| {
        let base = [
            ("service", "orders"),
            ("consumer", "projection.history"),
            ("tenant", "1"),
            ("aggregate_type", "order"),
            ("aggregate_id", "42"),
            ("csrf", csrf.as_str()),
        ];
        base.iter()
            .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
            .chain(extra)
            .map(|(k, v)| (*k, (*v).to_owned()))
            .collect::<Vec<_>>()
    };

    let (status, ask) = get(format!(
        "{url}/parked/skip?service=orders&consumer=projection.history&tenant=1&aggregate_type=order&aggregate_id=42"
    ))
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(ask.contains("Drop message 900 for good"), "{ask}");
    let (status, _) = post("/parked/skip", aggregate(&[("message_id", "900")])).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let (status, again) = post("/parked/skip", aggregate(&[("message_id", "900")])).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        again.contains("no longer the first parked event"),
        "{again}"
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT message_id FROM parked_events")
        .fetch_all(&db.owner)
        .await
        .unwrap();
    assert_eq!(left, [901], "only the event shown was dropped");

    let (status, _) = post("/parked/unpark", aggregate(&[("csrf", "")])).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(
        !release_requested(&db).await,
        "a forged unpark asks nothing"
    );
    let (status, _) = post("/parked/unpark", aggregate(&[])).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(release_requested(&db).await);
    let (status, again) = post("/parked/unpark", aggregate(&[])).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(again.contains("under way"), "{again}");
    db.cleanup().await;
}

/// Pending past `stuck_after`: order 42 (an hour), not 43 (decided) nor 44
/// (pending a moment).
#[tokio::test]
async fn the_stuck_page_lists_orders_pending_past_the_bound_with_their_story() {
    let (db, mut estate) = estate().await;
    static VIEWS: &[contracts::topology::Subscription] = &[contracts::topology::Subscription::new(
        "orders.views",
        &["orders.*"],
    )];
    estate.subscriptions = VIEWS;
    let url = spawn(estate, Auth::none(), true).await;
    let page = support::page(format!("{url}/stuck")).await;
    assert!(
        page.contains("href=\"/orders?tenant=1&amp;id=42\""),
        "{page}"
    );
    assert!(!page.contains("id=43") && !page.contains("id=44"), "{page}");
    assert!(page.contains("60 min"), "{page}");
    assert!(
        page.contains(
            "OrderPlaced orders#900 is not published for orders.views: in the outbox DLQ table"
        ),
        "where it waits: {page}"
    );
    db.cleanup().await;
}

/// A role's ops port that answers `/readyz` with `status` and `body`.
async fn ops_port(status: u16, body: &'static str) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let status = axum::http::StatusCode::from_u16(status).unwrap();
    let app = axum::Router::new().route(
        "/readyz",
        axum::routing::get(move || async move { (status, body) }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// Each role's `/readyz`: ready, not ready with why, and down, the last
/// two among what needs an operator.
#[tokio::test]
async fn the_overview_says_which_process_roles_are_ready_not_ready_or_down() {
    let (db, estate) = estate().await;
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let probe = |role, port| ops::roles::RoleProbe {
        service: "orders".into(),
        role,
        port,
    };
    let roles = vec![
        probe("serve", ops_port(200, "ok").await),
        probe(
            "relay",
            ops_port(503, "relay: the broker is unreachable").await,
        ),
        probe("consume", free),
    ];
    let url = support::serve(estate, Auth::none(), true, roles).await;
    let page = support::page(&url).await;
    let problems =
        &page[page.find("id=\"problems\"").unwrap()..page.find("<h2>Process roles").unwrap()];
    assert!(
        problems.contains("orders relay") && problems.contains("the broker is unreachable"),
        "{problems}"
    );
    assert!(
        problems.contains("orders consume") && problems.contains("down"),
        "{problems}"
    );
    assert!(!problems.contains("orders serve"), "{problems}");
    assert!(
        problems.contains("href=\"#roles\""),
        "each links to its table: {problems}"
    );
    assert!(page.contains("<td class=\"ok\">ready</td>"), "{page}");
    db.cleanup().await;
}

/// The last hour from the outbox itself: two orders decided two minutes
/// ago, each published 3 s after its commit.
#[tokio::test]
async fn the_overview_charts_the_last_hour_from_the_outbox() {
    let (db, estate) = estate().await;
    sqlx::raw_sql(
        "INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                                      payload, headers, occurred_at, processed_at)
         SELECT 1, 'order', n::text, t, 1, '{}', '{}', now() - interval '123 s', now() - interval '120 s'
         FROM generate_series(1, 2) n, unnest(ARRAY['OrderConfirmed', 'OrderPlaced']) t",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let url = spawn(estate, Auth::none(), true).await;
    let page = support::page(&url).await;
    let charts = &page[page.find("id=\"charts\"").unwrap()..page.find("<h2>Outboxes").unwrap()];
    assert!(charts.contains("Orders decided per second"), "{charts}");
    // Two decided in the minute: 2/60 per second; the OrderPlaced are not.
    assert!(charts.contains("<title>0.03 /s</title>"), "{charts}");
    assert!(
        charts.contains("orders: outbox lag") && charts.contains("max 3.00 s"),
        "{charts}"
    );
    db.cleanup().await;
}

/// A role that is ready and whose `/metrics` says `metrics`.
async fn role_saying(metrics: &'static str) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new()
        .route("/readyz", axum::routing::get(|| async { "ok" }))
        .route(
            "/metrics",
            axum::routing::get(move || async move { metrics }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// What needs an operator, the oldest first after what has no recorded
/// start; the money in doubt; reconciliation's findings and a view's
/// drift, read from the processes that run them.
#[tokio::test]
async fn the_overview_puts_the_oldest_problem_first_and_shows_the_money_and_what_processes_found() {
    let (db, mut estate) = estate().await;
    sqlx::raw_sql("UPDATE outbox_messages_dlq SET failed_at = now() - interval '10 minutes'")
        .execute(&db.owner)
        .await
        .unwrap();
    let payments = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE TABLE payments (tenant_id bigint, payment_id bigint, order_id bigint, status text,
                                outcome_unknown boolean, doubt_sent_at timestamptz);
         CREATE TABLE refunds (tenant_id bigint, refund_id bigint, payment_id bigint, status text,
                               outcome_unknown boolean, doubt_sent_at timestamptz, last_error text,
                               updated_at timestamptz);
         INSERT INTO payments VALUES (1, 5, 42, 'pending', true, now() - interval '20 minutes'),
                                     (1, 6, 43, 'captured', false, NULL);",
    )
    .execute(&payments.owner)
    .await
    .unwrap();
    estate
        .databases
        .push(("payments".into(), payments.owner.clone()));
    let metrics = "# TYPE payments_reconciliation_mismatches_total counter\n\
        payments_reconciliation_mismatches_total{kind=\"unknown_key\"} 2\n\
        payments_reconciliation_repairs_total{kind=\"unknown_key\"} 0\n\
        projection_verify_differences{view=\"orders\"} 3\n\
        projection_verify_differences{view=\"history\"} 0\n";
    let role = ops::roles::RoleProbe {
        service: "payments".into(),
        role: "serve",
        port: role_saying(metrics).await,
    };
    let url = support::serve(estate, Auth::none(), true, vec![role]).await;
    let page = support::page(&url).await;
    let problems =
        &page[page.find("id=\"problems\"").unwrap()..page.find("id=\"charts\"").unwrap()];
    let at = |says: &str| {
        problems
            .find(says)
            .unwrap_or_else(|| panic!("{says:?} is not among the problems: {problems}"))
    };
    let order = [
        at("payments: reconciliation found 2 unknown_key it could not repair"),
        at("orders: tenant 1 has 1 order(s) undecided for over 300 s"),
        at("payments: 1 payment(s) and 0 refund(s) in doubt"),
        at("orders: 1 outbox row(s) in the DLQ table"),
    ];
    assert!(
        order.is_sorted(),
        "unknown first, then the oldest: {problems}"
    );
    assert!(
        problems.contains("projection: its orders view differed from the sources in 3 entities"),
        "{problems}"
    );
    assert!(!problems.contains("history view"), "{problems}");
    assert!(
        problems.contains(">1 h 0 min<"),
        "the stuck order's age: {problems}"
    );
    assert!(problems.contains(">20 min<"), "the doubt's age: {problems}");
    assert!(problems.contains("href=\"#money\""), "{problems}");
    let money = &page[page.find("id=\"money\"").unwrap()..page.find("<h2>Outboxes").unwrap()];
    assert!(
        money.contains("In doubt at the provider") && money.contains("1 payment(s), 0 refund(s)"),
        "{money}"
    );
    assert!(money.contains("Reconciliation: unknown_key"), "{money}");
    db.cleanup().await;
    payments.cleanup().await;
}
