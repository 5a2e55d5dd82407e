//! One order is one trace across the five services, exported over
//! OTLP/HTTP (protobuf, the default): an in-test collector receives the
//! spans of every step (the request, each enqueue, publish and apply, the
//! charge and its provider call), and the service's own `#[instrument]`
//! span and SQL statements inside them, all under the order's trace id, as
//! one tree.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use e2e::Stack;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message as _;
use serde_json::Value;

/// One received span: its service (the resource's `service.name`), name,
/// ids and parent.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
}

type Inbox = Arc<Mutex<Vec<Received>>>;

/// An OTLP/HTTP receiver: `POST /v1/traces` with an
/// `ExportTraceServiceRequest`, in protobuf (the default) or JSON, as its
/// content type says.
async fn collector() -> (String, Inbox) {
    let inbox = Inbox::default();
    let app = Router::new()
        .route("/v1/traces", post(receive))
        .with_state(inbox.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, inbox)
}

async fn receive(
    State(inbox): State<Inbox>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> &'static str {
    let json = headers
        .get("content-type")
        .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    let received = match json {
        true => from_json(&serde_json::from_slice(&body).expect("OTLP JSON")),
        false => from_protobuf(ExportTraceServiceRequest::decode(body).expect("OTLP protobuf")),
    };
    inbox.lock().unwrap().extend(received);
    "{}"
}

fn from_protobuf(request: ExportTraceServiceRequest) -> Vec<Received> {
    let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let mut out = Vec::new();
    for rs in request.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                any_value::Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for span in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
            out.push(Received {
                service: service.clone(),
                name: span.name.to_lowercase(),
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent: hex(&span.parent_span_id),
            });
        }
    }
    out
}

fn from_json(request: &Value) -> Vec<Received> {
    let mut out = Vec::new();
    for rs in request["resourceSpans"].as_array().into_iter().flatten() {
        let service = rs["resource"]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["key"] == "service.name")
            .and_then(|a| a["value"]["stringValue"].as_str())
            .unwrap_or("")
            .to_owned();
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for span in ss["spans"].as_array().into_iter().flatten() {
                let text = |k: &str| span[k].as_str().unwrap_or("").to_lowercase();
                out.push(Received {
                    service: service.clone(),
                    name: text("name"),
                    trace_id: text("traceId"),
                    span_id: text("spanId"),
                    parent: text("parentSpanId"),
                });
            }
        }
    }
    out
}

#[tokio::test]
async fn one_order_is_one_trace_across_the_five_services() {
    let (url, inbox) = collector().await;
    let stack = Stack::start_with(|common| common.otlp_endpoint = Some(url))
        .await
        .unwrap();
    stack.stock(7, "SKU-T", 5).await;
    let order_id = stack.order(7, "c-7", "SKU-T", 1).await;
    let view = stack.settled(7, order_id).await;
    assert_eq!(view["status"], "confirmed", "{view}");

    // The trace id the order's first event carries is the exported one.
    let placed: String = sqlx::query_scalar(
        "SELECT headers->>'traceparent' FROM outbox_messages
         WHERE aggregate_id = $1 AND event_type = 'OrderPlaced'",
    )
    .bind(order_id.to_string())
    .fetch_one(&stack.dbs.orders.owner)
    .await
    .unwrap();
    let trace_id = placed.split('-').nth(1).unwrap().to_owned();

    let wanted: [(&str, &str); 11] = [
        ("orders", "post /orders"),
        // The service's own `#[instrument]` function, inside the request.
        ("orders", "insert_order"),
        ("orders", "enqueue orderplaced"),
        ("orders", "publish orderplaced"),
        ("inventory", "apply orderplaced"),
        ("payments", "charge payment"),
        ("payments", "post /charges"),
        ("orders", "apply paymentcaptured"),
        ("orders", "publish orderconfirmed"),
        ("projection", "apply orderconfirmed"),
        ("graph", "apply orderplaced"),
    ];
    let trace = |inbox: &Inbox| -> Vec<Received> {
        let all = inbox.lock().unwrap();
        all.iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    };
    // Complete: every step arrived, and every parent is a span of the trace
    // but the request's (one tree, not pieces joined only by the id). What
    // is still missing is named if the deadline passes.
    let missing = |spans: &[Received]| -> Vec<String> {
        let ids: BTreeSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
        let have: BTreeSet<(&str, &str)> = spans
            .iter()
            .map(|s| (s.service.as_str(), s.name.as_str()))
            .collect();
        let mut missing: Vec<String> = wanted
            .iter()
            .filter(|w| !have.contains(*w))
            .map(|(service, name)| format!("{service} {name}"))
            .collect();
        missing.extend(
            spans
                .iter()
                .filter(|s| !s.parent.is_empty() && !ids.contains(s.parent.as_str()))
                .map(|s| format!("the parent of {} {}", s.service, s.name)),
        );
        // Its SQL, a span of each statement under the function that ran it.
        let under = |s: &Received, name: &str| {
            spans
                .iter()
                .any(|p| p.span_id == s.parent && p.name == name)
        };
        if !spans
            .iter()
            .any(|s| s.name.starts_with("insert into orders") && under(s, "insert_order"))
        {
            missing.push("insert_order's INSERT INTO orders".to_owned());
        }
        missing
    };
    let started = std::time::Instant::now();
    loop {
        let spans = trace(&inbox);
        let gaps = missing(&spans);
        if gaps.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "after 30 s, {} spans of the order's trace ({} received in all); missing: {gaps:?}",
            spans.len(),
            inbox.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let spans = trace(&inbox);
    let root: Vec<&Received> = spans.iter().filter(|s| s.parent.is_empty()).collect();
    assert_eq!(root.len(), 1, "one root: {root:?}");
    assert_eq!(
        (root[0].service.as_str(), root[0].name.as_str()),
        ("orders", "post /orders")
    );
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services,
        BTreeSet::from(["graph", "inventory", "orders", "payments", "projection"])
    );
    // The apply of OrderPlaced in inventory is the child of orders' publish.
    let by_id: HashMap<&str, &Received> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let apply = spans
        .iter()
        .find(|s| s.service == "inventory" && s.name == "apply orderplaced")
        .unwrap();
    assert_eq!(by_id[apply.parent.as_str()].name, "publish orderplaced");
    stack.stop().await;
}

/// A caller's trace context is kept as it came (W3C): its unsampled flag
/// on every event the order causes, in every service, and nothing of it
/// exported; its `tracestate` beside the `traceparent` across the broker.
#[tokio::test]
async fn a_callers_unsampled_trace_and_its_state_are_kept_and_nothing_of_it_is_exported() {
    let (url, inbox) = collector().await;
    let stack = Stack::start_with(|common| common.otlp_endpoint = Some(url))
        .await
        .unwrap();
    stack.stock(8, "SKU-U", 5).await;
    let theirs = "4bf92f3577b34da6a3ce929d0e0e4736";
    let body = serde_json::json!({"customer_id": "c-8", "currency": "EUR",
        "lines": [{"sku": "SKU-U", "quantity": 1, "unit_price_cents": 1250}]});
    let response = stack
        .orders
        .http
        .post(format!("{}/orders", stack.orders.url))
        .bearer_auth(stack.orders.token(8))
        .header("idempotency-key", testkit::unique("order-"))
        .header("traceparent", format!("00-{theirs}-00f067aa0ba902b7-00"))
        .header("tracestate", "caller=kept,other=1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let order_id = response.json::<Value>().await.unwrap()["order_id"]
        .as_i64()
        .unwrap();
    let view = stack.settled(8, order_id).await;
    assert_eq!(view["status"], "confirmed", "{view}");

    let headers = |db: &sqlx::PgPool| {
        let db = db.clone();
        async move {
            let rows: Vec<(String, Option<String>, Option<String>)> = sqlx::query_as(
                "SELECT event_type, headers->>'traceparent', headers->>'tracestate'
                 FROM outbox_messages WHERE payload->>'order_id' = $1",
            )
            .bind(order_id.to_string())
            .fetch_all(&db)
            .await
            .unwrap();
            rows
        }
    };
    let mut events = Vec::new();
    for db in [&stack.dbs.orders, &stack.dbs.inventory, &stack.dbs.payments] {
        events.extend(headers(&db.owner).await);
    }
    assert!(events.len() >= 4, "{events:?}");
    for (event, parent, _) in &events {
        let parent = parent.as_deref().unwrap_or_default();
        assert!(
            parent.starts_with(&format!("00-{theirs}-")) && parent.ends_with("-00"),
            "{event}: {parent}"
        );
    }
    // Through the orders' outbox, the broker and inventory's consumer.
    for wanted in ["OrderPlaced", "InventoryReserved"] {
        let (_, _, state) = events.iter().find(|(e, ..)| e == wanted).unwrap();
        assert_eq!(state.as_deref(), Some("caller=kept,other=1"), "{wanted}");
    }

    // A sampled order after it is exported (the exporter works and has
    // flushed past the first): the unsampled one sent nothing.
    let sampled = stack.order(8, "c-8", "SKU-U", 1).await;
    stack.settled(8, sampled).await;
    let placed: String = sqlx::query_scalar(
        "SELECT headers->>'traceparent' FROM outbox_messages
         WHERE aggregate_id = $1 AND event_type = 'OrderPlaced'",
    )
    .bind(sampled.to_string())
    .fetch_one(&stack.dbs.orders.owner)
    .await
    .unwrap();
    let ours = placed.split('-').nth(1).unwrap().to_owned();
    testkit::wait_until(
        Duration::from_secs(30),
        "the sampled order's projection step exported",
        || async {
            let all = inbox.lock().unwrap();
            all.iter()
                .any(|s| s.trace_id == ours && s.name == "apply orderconfirmed")
        },
    )
    .await;
    let leaked: Vec<Received> = inbox
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace_id == theirs)
        .cloned()
        .collect();
    assert!(leaked.is_empty(), "spans of an unsampled trace: {leaked:?}");
    stack.stop().await;
}
