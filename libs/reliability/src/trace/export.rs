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

pub(super) fn install(service: &str, endpoint: &str) -> Result<(), String> {
    let base = endpoint.trim_end_matches('/');
    let url = match base.ends_with("/v1/traces") {
        true => base.to_owned(),
        false => format!("{base}/v1/traces"),
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(url.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| format!("OTLP exporter to {url}: {e}"))?;
    // A second's delay: a trace appears in the viewer about when the order settles.
    let batch = BatchConfigBuilder::default()
        .with_scheduled_delay(Duration::from_secs(1))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(
            BatchSpanProcessor::builder(exporter)
                .with_batch_config(batch)
                .build(),
        )
        .with_resource(
            Resource::builder()
                .with_service_name(service.to_owned())
                .build(),
        )
        .build();
    let tracer = provider.tracer("reliability");
    let mut all = EXPORTERS.write().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = all.iter().position(|(name, ..)| name == service) {
        let (_, old, _) = all.remove(i);
        let _ = old.shutdown();
    }
    all.push((service.to_owned(), provider, tracer));
    ANY.store(true, Ordering::Release);
    tracing::info!(service, endpoint = %url, "exporting spans over OTLP/HTTP JSON");
    Ok(())
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
    let span = tracer.build_with_context(SpanBuilder::from_name(name).with_kind(kind), &parent_cx);
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
