//! W3C trace context carried from an HTTP request through outbox rows and
//! AMQP headers into each consumer and out to the payment provider, so one
//! order's path is one trace id in the logs of every service; and, built
//! with the `otel` feature and given `OTEL_EXPORTER_OTLP_ENDPOINT`, the
//! same path exported as OpenTelemetry spans (docs/adr/0018).
//!
//! The ids are ours ([`TraceContext`], a task-local scope), so propagation
//! works with export off; a [`Span`] opens a step (request, enqueue,
//! publish, apply, provider call) and, with export on, is the exported span
//! whose ids the scope then carries on.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;

pub const HEADER: &str = "traceparent";
/// The vendors' part of the context, carried on unchanged beside it.
pub const STATE_HEADER: &str = "tracestate";
/// W3C trace-flags: the caller recorded this trace.
const SAMPLED: u8 = 0x01;
/// The longest `tracestate` W3C lets a system pass on (32 members).
const MAX_STATE: usize = 512;

/// The running task's trace: its context and the service whose steps it runs.
#[derive(Clone)]
struct Scope {
    ctx: TraceContext,
    service: Arc<str>,
}

tokio::task_local! {
    static CURRENT: Scope;
}

/// A W3C trace context: the `traceparent` (version 00, a 16-byte trace id,
/// an 8-byte parent span id, the flags as they came: sampled or not) and
/// the `tracestate` that came with it, both passed on to every step after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
    state: Option<Arc<str>>,
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        let chunk = uuid::Uuid::new_v4().into_bytes();
        let n = (N - filled).min(16);
        out[filled..filled + n].copy_from_slice(&chunk[..n]);
        filled += n;
    }
    out
}

fn hex<const N: usize>(bytes: &[u8; N]) -> String {
    bytes.iter().fold(String::with_capacity(2 * N), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl TraceContext {
    /// A new trace, sampled.
    pub fn root() -> Self {
        Self {
            trace_id: random_bytes(),
            span_id: random_bytes(),
            flags: SAMPLED,
            state: None,
        }
    }

    /// The same trace, a new span: its flags and state as they were.
    pub fn child(&self) -> Self {
        Self {
            span_id: random_bytes(),
            ..self.clone()
        }
    }

    /// Parses `00-<32 hex>-<16 hex>-<2 hex>`; all-zero ids are invalid.
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() {
            return None;
        }
        let ctx = Self {
            trace_id: unhex(trace)?,
            span_id: unhex(span)?,
            flags: unhex::<1>(flags)?[0],
            state: None,
        };
        (ctx.trace_id != [0; 16] && ctx.span_id != [0; 8]).then_some(ctx)
    }

    /// [`Self::parse`], with the `tracestate` that came beside it: kept if
    /// it is one a system may pass on (printable, at most 512 bytes),
    /// dropped otherwise, as W3C asks.
    pub fn parse_with_state(header: &str, state: Option<&str>) -> Option<Self> {
        let mut ctx = Self::parse(header)?;
        ctx.state = state
            .map(str::trim)
            .filter(|s| !s.is_empty() && s.len() <= MAX_STATE)
            .filter(|s| s.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .map(Arc::from);
        Some(ctx)
    }

    pub fn trace_id(&self) -> String {
        hex(&self.trace_id)
    }

    /// Whether the trace is recorded: a caller's choice, kept.
    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    pub fn to_header(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            self.flags
        )
    }

    /// The `tracestate` to send beside [`Self::to_header`], if one came.
    pub fn state(&self) -> Option<&str> {
        self.state.as_deref()
    }
}

/// The context of the running task, if any.
pub fn current() -> Option<TraceContext> {
    CURRENT.try_with(|c| c.ctx.clone()).ok()
}

/// What a span is, in OpenTelemetry's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An HTTP request this service answers.
    Server,
    /// A call this service makes (the payment provider).
    Client,
    /// An event written or published.
    Producer,
    /// An event applied.
    Consumer,
    Internal,
}

/// An attribute's value.
#[derive(Debug, Clone)]
pub enum Value {
    Str(String),
    Int(i64),
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Self::Str(v.to_owned())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Self {
        Self::Str(v)
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Self::Int(v)
    }
}

/// One step of a trace, ended when dropped. Its [`context`](Span::context)
/// is what the step hands on (a `traceparent`, or the scope of the work it
/// runs).
pub struct Span {
    ctx: TraceContext,
    service: Arc<str>,
    #[cfg(feature = "otel")]
    otel: Option<opentelemetry_sdk::trace::Span>,
}

impl Span {
    /// A step of `service`, the child of `parent`, or the root of a new
    /// trace. When `service` exports, its ids are the exported span's.
    pub fn start(
        service: &str,
        name: impl Into<Cow<'static, str>>,
        kind: Kind,
        parent: Option<TraceContext>,
    ) -> Self {
        Self::open(Arc::from(service), name.into(), kind, parent)
    }

    /// A step of the running task's trace (its service, its context as the
    /// parent); None outside any scope.
    pub fn child(name: impl Into<Cow<'static, str>>, kind: Kind) -> Option<Self> {
        let scope = CURRENT.try_with(Scope::clone).ok()?;
        Some(Self::open(
            scope.service,
            name.into(),
            kind,
            Some(scope.ctx),
        ))
    }

    #[cfg(feature = "otel")]
    fn open(
        service: Arc<str>,
        name: Cow<'static, str>,
        kind: Kind,
        parent: Option<TraceContext>,
    ) -> Self {
        match export::open(&service, name, kind, parent.clone(), None) {
            Some((otel, ctx)) => Self {
                ctx,
                service,
                otel: Some(otel),
            },
            None => Self {
                ctx: parent.map_or_else(TraceContext::root, |p| p.child()),
                service,
                otel: None,
            },
        }
    }

    #[cfg(not(feature = "otel"))]
    fn open(
        service: Arc<str>,
        _name: Cow<'static, str>,
        _kind: Kind,
        parent: Option<TraceContext>,
    ) -> Self {
        Self {
            ctx: parent.map_or_else(TraceContext::root, |p| p.child()),
            service,
        }
    }

    pub fn context(&self) -> TraceContext {
        self.ctx.clone()
    }

    /// Records `key = value` on the exported span (nothing without export).
    pub fn set(&mut self, key: &'static str, value: impl Into<Value>) {
        #[cfg(feature = "otel")]
        if let Some(span) = &mut self.otel {
            export::set(span, key, value.into());
        }
        #[cfg(not(feature = "otel"))]
        let _ = (key, value);
    }

    /// Marks the step failed, with why.
    pub fn fail(&mut self, reason: impl std::fmt::Display) {
        #[cfg(feature = "otel")]
        if let Some(span) = &mut self.otel {
            export::fail(span, reason.to_string());
        }
        #[cfg(not(feature = "otel"))]
        let _ = reason;
    }

    /// Runs `fut` inside this step: its events and calls are its children.
    pub async fn scope<F: Future>(&self, fut: F) -> F::Output {
        let scope = Scope {
            ctx: self.ctx.clone(),
            service: self.service.clone(),
        };
        CURRENT.scope(scope, fut).await
    }

    /// Runs `fut` inside this step and ends it, failed if `fut` failed.
    pub async fn run<T, E, F>(mut self, fut: F) -> Result<T, E>
    where
        E: std::fmt::Display,
        F: Future<Output = Result<T, E>>,
    {
        let done = self.scope(fut).await;
        if let Err(e) = &done {
            self.fail(e);
        }
        done
    }
}

/// Sends `service`'s spans over OTLP/HTTP from now on: to `endpoint` (a
/// collector's base URL; `/v1/traces` is added) when given in code, else
/// where the standard `OTEL_*` variables say (see [`wanted_by_env`]).
/// Without the `otel` feature it only warns.
pub fn export(service: &str, endpoint: Option<&str>) -> Result<(), String> {
    #[cfg(feature = "otel")]
    {
        export::install(service, endpoint)
    }
    #[cfg(not(feature = "otel"))]
    {
        tracing::warn!(
            service,
            ?endpoint,
            "built without the otel feature: spans are not exported"
        );
        Ok(())
    }
}

/// Whether the standard variables ask for spans: an
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`,
/// or `OTEL_TRACES_EXPORTER=otlp`; not with `OTEL_SDK_DISABLED=true` or
/// `OTEL_TRACES_EXPORTER=none`.
pub fn wanted_by_env() -> bool {
    #[cfg(feature = "otel")]
    {
        export::wanted_by_env()
    }
    #[cfg(not(feature = "otel"))]
    {
        [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
    }
}

/// The `tracing` layer that exports the service's own spans, log events
/// and SQL statements inside each step, as part of its trace; nothing
/// without the `otel` feature. `service_kit::service::init_tracing` installs it.
pub fn layer<S>() -> impl tracing_subscriber::Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    #[cfg(feature = "otel")]
    {
        layer::layer()
    }
    #[cfg(not(feature = "otel"))]
    {
        tracing_subscriber::layer::Identity::new()
    }
}

/// Sends what `service` has not yet exported and stops its exporter.
pub fn shutdown(service: &str) {
    #[cfg(feature = "otel")]
    export::shutdown(service);
    #[cfg(not(feature = "otel"))]
    let _ = service;
}

#[cfg(feature = "otel")]
mod export;
#[cfg(feature = "otel")]
mod layer;

#[cfg(test)]
mod tests;
