//! What a confused or hostile client gets, and that it changes nothing:
//! Idempotency-Key rules, other tenants' ids, the RLS wall, bad tokens and
//! bad bodies.

use std::str::FromStr;

use reliability::db;
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;
use testkit::database_url;

use crate::run::{Outcome, Run, Scenario, orders_of, quiesce};

mod rls;
use rls::*;

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![
        (
            "Idempotency-Key rules: other body, bad keys, replays",
            |r, t| Box::pin(key_rules(r, t)),
        ),
        (
            "tenants: cross-tenant reads and writes, RLS wall",
            |r, t| Box::pin(cross_tenant(r, t)),
        ),
        ("hostile input: tokens, bodies, sizes, ranges", |r, t| {
            Box::pin(bad_input(r, t))
        }),
    ]
}

mod bad_input;
pub use bad_input::bad_input;

const ORDERS: &str = "http://127.0.0.1:9081";

struct Reply {
    status: u16,
    body: Value,
    replayed: bool,
}

/// One request, no retries: exactly what the client sent.
async fn send(
    run: &Run,
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    key: Option<&[u8]>,
    body: Option<Vec<u8>>,
) -> anyhow::Result<Reply> {
    let mut req = run.client.http.request(method, url);
    if let Some(t) = token {
        req = req.header("Authorization", format!("Bearer {t}"));
    }
    if let Some(k) = key {
        req = req.header(
            "Idempotency-Key",
            reqwest::header::HeaderValue::from_bytes(k)?,
        );
    }
    if let Some(b) = body {
        req = req.header("Content-Type", "application/json").body(b);
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let replayed = resp
        .headers()
        .get("Idempotent-Replayed")
        .is_some_and(|v| v == "true");
    let body = resp.json().await.unwrap_or(Value::Null);
    Ok(Reply {
        status,
        body,
        replayed,
    })
}

/// A POST with a key and a JSON body, as sent.
async fn post(
    run: &Run,
    url: &str,
    token: Option<&str>,
    key: &[u8],
    body: Vec<u8>,
) -> anyhow::Result<Reply> {
    send(
        run,
        reqwest::Method::POST,
        url,
        token,
        Some(key),
        Some(body),
    )
    .await
}

fn order_body(tenant: i64, quantity: i64) -> Vec<u8> {
    json!({"customer_id": "c-1", "currency": "EUR",
           "lines": [{"sku": format!("SKU-{tenant}"), "quantity": quantity, "unit_price_cents": 1250}]})
    .to_string()
    .into_bytes()
}

/// Collects "expected X, got Y" as violations.
#[derive(Default)]
struct Expect(Vec<String>);

impl Expect {
    fn status(&mut self, what: &str, reply: &Reply, allowed: &[u16]) {
        if !allowed.contains(&reply.status) {
            self.0.push(format!(
                "contract: {what}: {} {}, expected {allowed:?}",
                reply.status, reply.body
            ));
        } else if reply.status >= 400 && reply.body["error"]["code"].as_str().is_none() {
            self.0.push(format!(
                "contract: {what}: {} without a JSON error code: {}",
                reply.status, reply.body
            ));
        }
    }

    fn that(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.0.push(what());
        }
    }
}

pub async fn key_rules(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    let token = run.client.token(tenant);
    let t = Some(token.as_str());
    let url = format!("{ORDERS}/orders");
    let mut e = Expect::default();

    let first = post(run, &url, t, b"k-1", order_body(tenant, 1)).await?;
    e.status("first POST", &first, &[201]);
    let again = post(run, &url, t, b"k-1", order_body(tenant, 1)).await?;
    e.status("replay", &again, &[201]);
    e.that(again.replayed && again.body == first.body, || {
        format!("I3: a replay must answer the stored response with Idempotent-Replayed: true; got {} (replayed {})", again.body, again.replayed)
    });
    // Key order and whitespace do not make another body (RFC 8785).
    let reordered = format!(
        r#"{{ "lines": [{{"unit_price_cents": 1250, "quantity": 1, "sku": "SKU-{tenant}"}}], "currency": "EUR", "customer_id": "c-1" }}"#
    );
    let same = post(run, &url, t, b"k-1", reordered.into_bytes()).await?;
    e.status("same body, keys reordered", &same, &[201]);
    let other = post(run, &url, t, b"k-1", order_body(tenant, 2)).await?;
    e.status("same key, other body", &other, &[409]);

    let long = vec![b'a'; 256];
    let longest = vec![b'b'; 255];
    for (what, key) in [
        ("no key", None),
        ("empty key", Some(&b""[..])),
        ("256-character key", Some(&long[..])),
        ("key with a space", Some(&b"a b"[..])),
        ("non-ASCII key", Some("café".as_bytes())),
    ] {
        let r = send(
            run,
            reqwest::Method::POST,
            &url,
            t,
            key,
            Some(order_body(tenant, 1)),
        )
        .await?;
        e.status(what, &r, &[400]);
    }
    let r = post(run, &url, t, &longest, order_body(tenant, 1)).await?;
    e.status("255-character key", &r, &[201]);

    // A 4xx is an answer too: stored and replayed.
    let bad = post(run, &url, t, b"k-bad", order_body(tenant, 0)).await?;
    e.status("invalid order", &bad, &[422]);
    let bad_again = post(run, &url, t, b"k-bad", order_body(tenant, 0)).await?;
    e.status("invalid order replayed", &bad_again, &[422]);
    e.that(bad_again.replayed, || {
        "I3: a stored 422 must be replayed with Idempotent-Replayed: true".into()
    });

    // Keys belong to a tenant: another tenant's same key is another request.
    let stranger = run.client.token(tenant + 200);
    let theirs = post(run, &url, Some(&stranger), b"k-1", order_body(tenant, 1)).await?;
    e.status("another tenant, same key", &theirs, &[201]);
    e.that(
        !theirs.replayed && theirs.body["order_id"] != first.body["order_id"],
        || {
            format!(
                "I7: tenant {} got tenant {tenant}'s stored answer for its key",
                tenant + 200
            )
        },
    );

    let n = orders_of(&run.dbs, tenant).await;
    e.that(n == 2, || {
        format!("I3: the key rules made {n} orders, expected 2")
    });
    Ok((
        "replays, other body, reordered keys, bad keys, stored 422, another tenant's key".into(),
        e.0,
    ))
}

pub async fn cross_tenant(run: &mut Run, tenant: i64) -> Outcome {
    let victim = tenant + 100;
    run.client
        .stock(victim, &format!("SKU-{victim}"), 100)
        .await?;
    let order = run
        .client
        .order(victim, "victim-1", "c-v", &format!("SKU-{victim}"), 2)
        .await?;
    quiesce(run, victim).await?;
    let (payment, captured_before): (i64, i64) = sqlx::query_as(
        "SELECT payment_id, amount_cents - refunded_cents FROM payments WHERE order_id = $1",
    )
    .bind(order)
    .fetch_one(&run.dbs.payments)
    .await?;
    let stock_before = stock_of(run, victim).await?;

    let token = run.client.token(tenant);
    let t = Some(token.as_str());
    let get = reqwest::Method::GET;
    let mut e = Expect::default();
    let mut leaked = 0;
    for (what, url) in [
        ("orders GET", format!("{ORDERS}/orders/{order}")),
        (
            "projection GET",
            format!("http://127.0.0.1:9084/orders/{order}"),
        ),
        (
            "inventory GET",
            format!("http://127.0.0.1:9082/products/SKU-{victim}"),
        ),
    ] {
        let r = send(run, get.clone(), &url, t, None, None).await?;
        leaked += usize::from(r.status == 200);
        e.status(&format!("another tenant's id, {what}"), &r, &[404]);
    }
    let r = send(
        run,
        get.clone(),
        &format!("http://127.0.0.1:9083/payments?order_id={order}"),
        t,
        None,
        None,
    )
    .await?;
    e.status("another tenant's payments", &r, &[200]);
    e.that(r.body.as_array().is_some_and(Vec::is_empty), || {
        leaked += 1;
        format!("I7: payments of another tenant's order listed: {}", r.body)
    });
    let refund = json!({"payment_id": payment, "amount_cents": 100}).to_string();
    let r = post(
        run,
        "http://127.0.0.1:9083/refunds",
        t,
        b"x-refund",
        refund.into_bytes(),
    )
    .await?;
    e.status("refund of another tenant's payment", &r, &[404]);
    let adjust = json!({"sku": format!("SKU-{victim}"), "delta": -5, "reason": "x"}).to_string();
    let r = post(
        run,
        "http://127.0.0.1:9082/stock/adjustments",
        t,
        b"x-adjust",
        adjust.into_bytes(),
    )
    .await?;
    e.status("stock adjustment of another tenant's sku", &r, &[404, 422]);
    quiesce(run, victim).await?;

    let (_, captured_after): (i64, i64) = sqlx::query_as(
        "SELECT payment_id, amount_cents - refunded_cents FROM payments WHERE order_id = $1",
    )
    .bind(order)
    .fetch_one(&run.dbs.payments)
    .await?;
    let stock_after = stock_of(run, victim).await?;
    e.that(captured_before == captured_after && stock_before == stock_after, || {
        format!("I7: tenant {victim} changed by tenant {tenant}: captured {captured_before}→{captured_after}, stock {stock_before:?}→{stock_after:?}")
    });
    let victim_verdict = run
        .dbs
        .check(victim, &crate::run::ledger(run).await?)
        .await?;
    e.0.extend(victim_verdict.violations);
    e.0.extend(rls_wall().await?);
    Ok((
        format!(
            "tenant {tenant} reads/writes tenant {victim}'s ids ({leaked} leaked); RLS catalog and unscoped queries as commerce_app"
        ),
        e.0,
    ))
}

async fn stock_of(run: &Run, tenant: i64) -> anyhow::Result<(i64, i64)> {
    Ok(
        sqlx::query_as("SELECT on_hand, reserved FROM products WHERE tenant_id = $1")
            .bind(tenant)
            .fetch_one(&run.dbs.inventory)
            .await?,
    )
}
