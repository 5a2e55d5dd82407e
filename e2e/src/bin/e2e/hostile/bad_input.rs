//! Bad tokens, bad bodies, bad ids and amounts: each a clear 4xx with a JSON
//! error code, none of them a write or a dead process.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::rls::{b64, forged};
use super::{Expect, ORDERS, order_body, post, send};
use crate::run::{Outcome, Run, orders_of};
use e2e::cluster::SECRET;

pub async fn bad_input(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    let mut e = Expect::default();
    let tokens = bad_tokens(run, tenant, &mut e).await?;
    let bodies = bad_bodies(run, tenant, &mut e).await?;
    bad_ids_and_amounts(run, tenant, &mut e).await?;

    let n = orders_of(&run.dbs, tenant).await;
    e.that(n == 0, || format!("bad input wrote {n} orders"));
    for p in ["orders-api", "payments-api", "inventory-api"] {
        e.that(!run.cluster.exited(p), || format!("{p} died on bad input"));
    }
    Ok((
        format!("{tokens} kinds of bad token, {bodies} bad bodies, bad ids and amounts"),
        e.0,
    ))
}

/// Every kind of token that is not a valid one of this tenant: 401 on a
/// write and on a read.
async fn bad_tokens(run: &mut Run, tenant: i64, e: &mut Expect) -> anyhow::Result<usize> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let later = now + 3600;
    let signed = |claims: Value| Some(forged(SECRET.as_bytes(), &claims));
    let unsigned = {
        let enc = |v: &Value| b64(v.to_string().as_bytes());
        format!(
            "{}.{}.",
            enc(&json!({"alg": "none", "typ": "JWT"})),
            enc(&json!({"tenant_id": tenant, "exp": later}))
        )
    };
    let tokens = [
        ("no token", None),
        ("not a JWT", Some("garbage".to_owned())),
        (
            "signed with another secret",
            Some(forged(
                b"not-the-secret",
                &json!({"tenant_id": tenant, "exp": later}),
            )),
        ),
        (
            "expired",
            signed(json!({"tenant_id": tenant, "exp": now - 10})),
        ),
        ("no tenant_id", signed(json!({"exp": later}))),
        ("tenant_id 0", signed(json!({"tenant_id": 0, "exp": later}))),
        (
            "tenant_id as a string",
            signed(json!({"tenant_id": tenant.to_string(), "exp": later})),
        ),
        ("no exp", signed(json!({"tenant_id": tenant}))),
        ("alg none", Some(unsigned)),
    ];
    let url = format!("{ORDERS}/orders");
    for (i, (what, token)) in tokens.iter().enumerate() {
        let key = format!("tok-{i}");
        let body = order_body(tenant, 1);
        let r = post(run, &url, token.as_deref(), key.as_bytes(), body).await?;
        e.status(&format!("POST with {what}"), &r, &[401]);
        let one = format!("{ORDERS}/orders/1");
        let r = send(
            run,
            reqwest::Method::GET,
            &one,
            token.as_deref(),
            None,
            None,
        )
        .await?;
        e.status(&format!("GET with {what}"), &r, &[401]);
    }
    Ok(tokens.len())
}

/// Bodies that are not JSON, not an order, or an order that breaks a rule:
/// 400, 413 or 422, never stored as an order.
async fn bad_bodies(run: &mut Run, tenant: i64, e: &mut Expect) -> anyhow::Result<usize> {
    let sku = format!("SKU-{tenant}");
    let line = |q: Value, p: Value| json!({"sku": sku, "quantity": q, "unit_price_cents": p});
    let order = |customer: Value, currency: Value, lines: Value| {
        json!({"customer_id": customer, "currency": currency, "lines": lines}).to_string()
    };
    let with_line = |q: Value, p: Value| order(json!("c-1"), json!("EUR"), json!([line(q, p)]));
    let with_customer = |c: Value| order(c, json!("EUR"), json!([line(json!(1), json!(1))]));
    let with_currency = |c: Value| order(json!("c-1"), c, json!([line(json!(1), json!(1))]));
    let nested = format!(
        r#"{{"customer_id": {}1{}, "currency": "EUR", "lines": []}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let unprocessable: &[u16] = &[422];
    let bodies: Vec<(&str, String, &[u16])> = vec![
        ("malformed JSON", "{not json".into(), &[400]),
        ("empty body", String::new(), &[400]),
        (
            "truncated JSON",
            r#"{"customer_id": "c-1", "lines": [{"#.into(),
            &[400],
        ),
        ("a JSON array", "[]".into(), unprocessable),
        (
            "missing lines",
            r#"{"customer_id": "c-1", "currency": "EUR"}"#.into(),
            unprocessable,
        ),
        ("5000-deep nesting", nested, &[400, 422]),
        (
            "a 70 KiB body",
            with_customer(json!("c".repeat(70 * 1024))),
            &[413],
        ),
        ("quantity 0", with_line(json!(0), json!(1)), unprocessable),
        ("quantity -1", with_line(json!(-1), json!(1)), unprocessable),
        (
            "quantity 10001",
            with_line(json!(10_001), json!(1)),
            unprocessable,
        ),
        (
            "quantity 2^40",
            with_line(json!(1_u64 << 40), json!(1)),
            unprocessable,
        ),
        (
            "quantity 1.5",
            with_line(json!(1.5), json!(1)),
            unprocessable,
        ),
        (
            "quantity as a string",
            with_line(json!("1"), json!(1)),
            unprocessable,
        ),
        ("price -1", with_line(json!(1), json!(-1)), unprocessable),
        (
            "price 100000001",
            with_line(json!(1), json!(100_000_001)),
            unprocessable,
        ),
        (
            "price 2^63",
            with_line(json!(1), json!(1_u64 << 63)),
            unprocessable,
        ),
        ("currency eur", with_currency(json!("eur")), unprocessable),
        ("currency EURO", with_currency(json!("EURO")), unprocessable),
        ("empty customer", with_customer(json!("")), unprocessable),
        (
            "65-character customer",
            with_customer(json!("c".repeat(65))),
            unprocessable,
        ),
        (
            "NUL in customer",
            with_customer(json!("c\u{0}1")),
            unprocessable,
        ),
        (
            "no lines",
            order(json!("c-1"), json!("EUR"), json!([])),
            unprocessable,
        ),
        (
            "101 lines",
            order(
                json!("c-1"),
                json!("EUR"),
                Value::Array(vec![line(json!(1), json!(1)); 101]),
            ),
            unprocessable,
        ),
        (
            "empty sku",
            order(
                json!("c-1"),
                json!("EUR"),
                json!([{"sku": "", "quantity": 1, "unit_price_cents": 1}]),
            ),
            unprocessable,
        ),
    ];
    let (count, url) = (bodies.len(), format!("{ORDERS}/orders"));
    let token = run.client.token(tenant);
    for (i, (what, body, allowed)) in bodies.into_iter().enumerate() {
        let key = format!("body-{i}");
        let r = post(run, &url, Some(&token), key.as_bytes(), body.into_bytes()).await?;
        e.status(what, &r, allowed);
    }
    Ok(count)
}

/// Ids that name nothing (404, like another tenant's) and refund amounts
/// that break a rule.
async fn bad_ids_and_amounts(run: &mut Run, tenant: i64, e: &mut Expect) -> anyhow::Result<()> {
    let token = run.client.token(tenant);
    let t = Some(token.as_str());
    for (what, url) in [
        ("order id not a number", format!("{ORDERS}/orders/abc")),
        (
            "order id 2^70",
            format!("{ORDERS}/orders/1180591620717411303424"),
        ),
        ("order id -1", format!("{ORDERS}/orders/-1")),
    ] {
        let r = send(run, reqwest::Method::GET, &url, t, None, None).await?;
        e.status(what, &r, &[404]);
    }
    for (i, amount) in [json!(0), json!(-5), json!("5")].into_iter().enumerate() {
        let body = json!({"payment_id": 1, "amount_cents": amount})
            .to_string()
            .into_bytes();
        let key = format!("rf-{i}");
        let refunds = "http://127.0.0.1:9083/refunds";
        let r = send(
            run,
            reqwest::Method::POST,
            refunds,
            t,
            Some(key.as_bytes()),
            Some(body),
        )
        .await?;
        e.status(&format!("refund of {amount}"), &r, &[404, 422]);
    }
    Ok(())
}
