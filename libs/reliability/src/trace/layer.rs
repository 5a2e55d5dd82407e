//! A `tracing` layer that exports what a service's own code does inside a
//! step: its spans (`#[instrument]`, `info_span!`) as children of the step
//! they run in, its log events on them, and each SQL statement (sqlx's
//! `sqlx::query` event) as a client span of its own, so that all of it joins
//! the order's trace (docs/adr/0018).
//!
//! The parent is the nearest exported span above, else the running task's
//! step ([`super::CURRENT`]); a span outside any step is not exported (it
//! belongs to no order). Each span goes to the tracer of the service whose
//! step it runs in, so the in-process stack's four services stay four
//! resources. The library's own `tracing` spans are log context only: its
//! steps are exported already.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::KeyValue;
use opentelemetry::trace::Span as _;
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, Filter};
use tracing_subscriber::registry::LookupSpan;

use super::{CURRENT, Kind, TraceContext, export};

/// Where sqlx reports each statement it ran (at `debug`).
const SQL_TARGET: &str = "sqlx::query";

/// Crates whose own spans and events are transport detail, not the
/// service's work: never exported.
const QUIET: &[&str] = &[
    "reliability",
    "sqlx",
    "lapin",
    "amq_protocol",
    "pinky_swear",
    "hyper",
    "hyper_util",
    "h2",
    "tower",
    "reqwest",
    "rustls",
    "tokio",
    "runtime",
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry_otlp",
];

/// The layer, filtered to what it exports; nothing passes while no
/// service exports.
pub(super) fn layer<S>() -> impl Layer<S> + Send + Sync
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    Exporting.with_filter(Worth)
}

/// The exported span a `tracing` span became, and the context its
/// children take as their parent.
struct Exported {
    span: opentelemetry_sdk::trace::Span,
    ctx: TraceContext,
    service: Arc<str>,
}

struct Exporting;

/// The service and parent context of a span or statement at `scope`'s
/// innermost span, or the running task's step.
fn parent_of<S>(
    scope: Option<tracing_subscriber::registry::SpanRef<'_, S>>,
) -> Option<(Arc<str>, TraceContext)>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let from_span = scope.and_then(|span| {
        span.scope().find_map(|s| {
            s.extensions()
                .get::<Exported>()
                .map(|e| (e.service.clone(), e.ctx.clone()))
        })
    });
    from_span
        .or_else(|| {
            CURRENT
                .try_with(|c| (c.service.clone(), c.ctx.clone()))
                .ok()
        })
        .filter(|(_, ctx)| ctx.sampled())
}

impl<S> Layer<S> for Exporting
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let Some((service, parent)) = parent_of(span.parent()) else {
            return;
        };
        let name = Cow::Borrowed(attrs.metadata().name());
        let Some((mut otel, ctx)) =
            export::open(&service, name, Kind::Internal, Some(parent), None)
        else {
            return;
        };
        attrs.record(&mut Attributes::on(&mut otel));
        span.extensions_mut().insert(Exported {
            span: otel,
            ctx,
            service,
        });
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(e) = span.extensions_mut().get_mut::<Exported>()
        {
            values.record(&mut Attributes::on(&mut e.span));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        if event.metadata().target() == SQL_TARGET {
            statement(event, parent_of(ctx.event_span(event)));
            return;
        }
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut exts = span.extensions_mut();
        let Some(e) = exts.get_mut::<Exported>() else {
            return;
        };
        let mut fields = Fields::default();
        event.record(&mut fields);
        let name = fields.message.take().unwrap_or_else(|| "event".to_owned());
        let mut attributes = fields.values;
        attributes.push(KeyValue::new("level", event.metadata().level().as_str()));
        e.span.add_event(name, attributes);
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id)
            && let Some(mut e) = span.extensions_mut().remove::<Exported>()
        {
            e.span.end();
        }
    }
}

/// One SQL statement, as a client span that ends now and began its
/// elapsed time ago (sqlx reports a statement once it is done).
fn statement(event: &Event<'_>, parent: Option<(Arc<str>, TraceContext)>) {
    let Some((service, parent)) = parent else {
        return;
    };
    let mut fields = Fields::default();
    event.record(&mut fields);
    let end = SystemTime::now();
    let start = end - Duration::try_from_secs_f64(fields.elapsed_secs).unwrap_or_default();
    let name = fields.summary.take().unwrap_or_else(|| "sql".to_owned());
    let Some((mut otel, _)) = export::open(
        &service,
        Cow::Owned(name.clone()),
        Kind::Client,
        Some(parent),
        Some(start),
    ) else {
        return;
    };
    let text = match fields.statement.take() {
        Some(s) if !s.trim().is_empty() => s.trim().to_owned(),
        _ => name,
    };
    otel.set_attribute(KeyValue::new("db.system.name", "postgresql"));
    otel.set_attribute(KeyValue::new("db.query.text", text));
    for kv in fields.values {
        otel.set_attribute(kv);
    }
    otel.end_with_timestamp(end);
}

/// Records a span's fields as its attributes.
struct Attributes<'a>(&'a mut opentelemetry_sdk::trace::Span);

impl<'a> Attributes<'a> {
    fn on(span: &'a mut opentelemetry_sdk::trace::Span) -> Self {
        Self(span)
    }
}

impl Visit for Attributes<'_> {
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.set_attribute(KeyValue::new(field.name(), value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.set_attribute(KeyValue::new(
            field.name(),
            i64::try_from(value).unwrap_or(i64::MAX),
        ));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.set_attribute(KeyValue::new(field.name(), value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.set_attribute(KeyValue::new(field.name(), value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0
            .set_attribute(KeyValue::new(field.name(), value.to_owned()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .set_attribute(KeyValue::new(field.name(), format!("{value:?}")));
    }
}

/// An event's fields: its message, sqlx's statement fields, the rest as
/// attributes.
#[derive(Default)]
struct Fields {
    message: Option<String>,
    summary: Option<String>,
    statement: Option<String>,
    elapsed_secs: f64,
    values: Vec<KeyValue>,
}

impl Fields {
    fn text(&mut self, field: &Field, value: String) {
        match field.name() {
            "message" => self.message = Some(value),
            "summary" => self.summary = Some(value),
            "db.statement" => self.statement = Some(value),
            // sqlx's human-readable duration: elapsed_secs says it.
            "elapsed" => {}
            name => self.values.push(KeyValue::new(name, value)),
        }
    }
}

impl Visit for Fields {
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.values.push(KeyValue::new(field.name(), value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        let value = i64::try_from(value).unwrap_or(i64::MAX);
        self.values.push(KeyValue::new(field.name(), value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        match field.name() {
            "elapsed_secs" => self.elapsed_secs = value,
            name => self.values.push(KeyValue::new(name, value)),
        }
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.values.push(KeyValue::new(field.name(), value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.text(field, value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.text(field, format!("{value:?}"));
    }
}

/// What the layer sees: the service's own spans and events at `info` and
/// above, and sqlx's statements, while some service exports. Decided per
/// call for those callsites (export starts after the subscriber), never
/// for the rest, which cost nothing.
struct Worth;

fn quiet(target: &str) -> bool {
    let root = target.split("::").next().unwrap_or(target);
    QUIET.contains(&root)
}

fn considered(meta: &Metadata<'_>) -> bool {
    meta.target() == SQL_TARGET || (*meta.level() <= Level::INFO && !quiet(meta.target()))
}

impl<S> Filter<S> for Worth {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        considered(meta) && export::exporting()
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        match considered(meta) {
            true => Interest::sometimes(),
            false => Interest::never(),
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::DEBUG)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_and_the_services_own_work_are_considered_transport_is_not() {
        assert!(quiet("lapin::channel") && quiet("reliability::consumer") && quiet("sqlx::pool"));
        assert!(!quiet("orders::http") && !quiet("payments"));
    }
}
