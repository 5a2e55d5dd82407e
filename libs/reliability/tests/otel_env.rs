//! The standard `OTEL_*` variables configure span export, read by the
//! OpenTelemetry SDK, not overridden by our defaults: the signal's own
//! endpoint used as given, the protocol, the headers, the service name.
//! The exporting side runs as a child process of this test binary, given
//! the variables the way an operator gives them.

use std::process::Command;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::routing::post;
use reliability::trace::{self, Kind, Span};

type Seen = Arc<Mutex<Vec<(String, HeaderMap, serde_json::Value)>>>;

async fn seen(State(seen): State<Seen>, uri: Uri, headers: HeaderMap, body: axum::body::Bytes) {
    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    seen.lock()
        .unwrap()
        .push((uri.path().to_owned(), headers, json));
}

/// Runs [`exporting_process`] in a child with `vars`; true if it passed.
async fn child(vars: &[(&str, &str)]) -> bool {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || run_child(vars))
        .await
        .unwrap()
}

fn run_child(vars: Vec<(String, String)>) -> bool {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["exporting_process", "--exact", "--ignored", "--nocapture"]);
    for var in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_EXPORTER",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(vars);
    cmd.status().unwrap().success()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sdk_reads_the_standard_variables() {
    let got = Seen::default();
    let app = Router::new()
        .route("/collector/spans", post(seen))
        .with_state(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let endpoint = format!("{url}/collector/spans");
    let vars = [
        // The signal's own endpoint wins over the base one, used as given.
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9/ignored"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-token=s3cret"),
        ("OTEL_SERVICE_NAME", "named-by-env"),
        ("EXPECT_EXPORT", "1"),
    ];
    let ok = child(&vars).await;
    assert!(ok, "the exporting process failed");

    let got = got.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "one export, flushed at shutdown");
    let (path, headers, body) = &got[0];
    assert_eq!(path, "/collector/spans", "the signal's endpoint, as given");
    assert_eq!(
        headers["content-type"], "application/json",
        "the protocol asked for"
    );
    assert_eq!(headers["x-collector-token"], "s3cret");
    let resource = &body["resourceSpans"][0];
    let name = resource["resource"]["attributes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["key"] == "service.name")
        .unwrap();
    assert_eq!(name["value"]["stringValue"], "named-by-env");
    assert_eq!(resource["scopeSpans"][0]["spans"][0]["name"], "a step");

    // What turns export off, and that nothing set means nothing exported.
    for off in [
        &[
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", url.as_str()),
        ][..],
        &[
            ("OTEL_TRACES_EXPORTER", "none"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", url.as_str()),
        ],
        &[],
    ] {
        let mut vars = off.to_vec();
        vars.push(("EXPECT_EXPORT", "0"));
        assert!(child(&vars).await, "{off:?}");
    }
}

/// The child: says whether the variables ask for export, as
/// `EXPECT_EXPORT` expects, and if so exports one span and flushes.
#[tokio::test]
#[ignore = "run by the_sdk_reads_the_standard_variables, with its variables"]
async fn exporting_process() {
    let expected = std::env::var("EXPECT_EXPORT").unwrap() == "1";
    assert_eq!(trace::wanted_by_env(), expected);
    if expected {
        trace::export("orders", None).unwrap();
        let mut step = Span::start("orders", "a step", Kind::Internal, None);
        step.set("k", "v");
        drop(step);
        // Shutting the exporter down flushes what the step handed it.
        trace::shutdown("orders");
    }
}
