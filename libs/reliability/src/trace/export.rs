//! One tracer provider per service name (one process of the in-process
//! test stack runs four services, each its own OpenTelemetry resource).

use std::borrow::Cow;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::trace::{
    self as otel, Span as _, SpanBuilder, SpanContext, SpanId, TraceContextExt as _, TraceFlags,
    TraceId, TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider,
};

use super::{Kind, TraceContext, Value};

type Exporters = Vec<(String, SdkTracerProvider, SdkTracer)>;

static ANY: AtomicBool = AtomicBool::new(false);
static EXPORTERS: RwLock<Exporters> = RwLock::new(Vec::new());

/// Sends `service`'s spans over OTLP/HTTP. The SDK reads the standard
/// variables (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, `_PROTOCOL`,
/// `_HEADERS`, `_TIMEOUT`, `_COMPRESSION`, `OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`); only
/// where one is unset does a default of ours apply: http/protobuf, one
/// second between batches, and `service` as the name. `endpoint`, given
/// in code (a collector's base URL), wins over the variables.
pub(super) fn install(service: &str, endpoint: Option<&str>) -> Result<(), String> {
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_http();
    if let Some(base) = endpoint {
        builder = builder.with_endpoint(traces_url(base));
    }
    if unset(&[
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]) {
        builder = builder.with_protocol(Protocol::HttpBinary);
    }
    let exporter = builder.build().map_err(|e| format!("OTLP exporter: {e}"))?;
    let mut batch = BatchConfigBuilder::default();
    if unset(&["OTEL_BSP_SCHEDULE_DELAY"]) {
        // A trace appears in the viewer about when the order settles.
        batch = batch.with_scheduled_delay(Duration::from_secs(1));
    }
    let mut resource = Resource::builder();
    let named_by_env = !unset(&["OTEL_SERVICE_NAME"])
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.name="));
    if !named_by_env {
        resource = resource.with_service_name(service.to_owned());
    }
    let provider = SdkTracerProvider::builder()
        .with_span_processor(
            BatchSpanProcessor::builder(exporter)
                .with_batch_config(batch.build())
                .build(),
        )
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("reliability");
    let mut all = EXPORTERS.write().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = all.iter().position(|(name, ..)| name == service) {
        let (_, old, _) = all.remove(i);
        let _ = old.shutdown();
    }
    all.push((service.to_owned(), provider, tracer));
    ANY.store(true, Ordering::Release);
    tracing::info!(
        service,
        endpoint = endpoint.unwrap_or("from the OTEL_* variables"),
        "exporting spans over OTLP/HTTP"
    );
    Ok(())
}

fn traces_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    match base.ends_with("/v1/traces") {
        true => base.to_owned(),
        false => format!("{base}/v1/traces"),
    }
}

fn unset(vars: &[&str]) -> bool {
    vars.iter()
        .all(|v| std::env::var(v).map_or(true, |s| s.trim().is_empty()))
}

/// Whether the standard variables ask for span export: an OTLP endpoint,
/// or `OTEL_TRACES_EXPORTER=otlp`; and neither `OTEL_SDK_DISABLED=true`
/// nor an `OTEL_TRACES_EXPORTER` without `otlp` (such as `none`).
pub(super) fn wanted_by_env() -> bool {
    let var = |v: &str| std::env::var(v).unwrap_or_default().trim().to_lowercase();
    if var("OTEL_SDK_DISABLED") == "true" {
        return false;
    }
    let exporters = var("OTEL_TRACES_EXPORTER");
    match exporters.is_empty() {
        true => !unset(&[
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]),
        false => exporters.split(',').any(|e| e.trim() == "otlp"),
    }
}

/// Whether any service of this process exports.
pub(super) fn exporting() -> bool {
    ANY.load(Ordering::Acquire)
}

pub(super) fn shutdown(service: &str) {
    let mut all = EXPORTERS.write().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = all.iter().position(|(name, ..)| name == service) {
        let (_, provider, _) = all.remove(i);
        if let Err(e) = provider.shutdown() {
            tracing::warn!(service, error = %e, "span exporter did not flush");
        }
    }
}

fn tracer(service: &str) -> Option<SdkTracer> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let all = EXPORTERS.read().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .find(|(name, ..)| name == service)
        .map(|(_, _, t)| t.clone())
}

pub(super) fn open(
    service: &str,
    name: Cow<'static, str>,
    kind: Kind,
    parent: Option<TraceContext>,
    start: Option<std::time::SystemTime>,
) -> Option<(opentelemetry_sdk::trace::Span, TraceContext)> {
    let tracer = tracer(service)?;
    // The caller's flags and state as they came: the SDK's parent-based
    // sampler records what the caller sampled, and only that.
    let state = parent.as_ref().and_then(|p| p.state.clone());
    let parent_cx = match parent {
        Some(p) => Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_bytes(p.trace_id),
            SpanId::from_bytes(p.span_id),
            TraceFlags::new(p.flags),
            true,
            p.state()
                .and_then(|s| s.parse::<TraceState>().ok())
                .unwrap_or_default(),
        )),
        None => Context::new(),
    };
    let kind = match kind {
        Kind::Server => otel::SpanKind::Server,
        Kind::Client => otel::SpanKind::Client,
        Kind::Producer => otel::SpanKind::Producer,
        Kind::Consumer => otel::SpanKind::Consumer,
        Kind::Internal => otel::SpanKind::Internal,
    };
    let mut builder = SpanBuilder::from_name(name).with_kind(kind);
    builder.start_time = start;
    let span = tracer.build_with_context(builder, &parent_cx);
    let sc = span.span_context();
    let ctx = TraceContext {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        flags: sc.trace_flags().to_u8(),
        state,
    };
    sc.is_valid().then_some((span, ctx))
}

pub(super) fn set(span: &mut opentelemetry_sdk::trace::Span, key: &'static str, value: Value) {
    span.set_attribute(match value {
        Value::Str(v) => KeyValue::new(key, v),
        Value::Int(v) => KeyValue::new(key, v),
    });
}

pub(super) fn fail(span: &mut opentelemetry_sdk::trace::Span, reason: String) {
    span.set_status(otel::Status::error(reason));
}
