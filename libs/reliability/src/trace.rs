//! W3C trace context carried from an HTTP request through outbox rows and
//! AMQP headers into each consumer, so one order's path is one trace id in
//! the logs of every service.
//!
//! Deliberately small: no exporter (there is no collector here). The id is
//! set per task ([`scope`]); `outbox::enqueue` stamps a child `traceparent`
//! on every event written inside it, and the consumer runtime opens a scope
//! from each delivery's header.

use std::fmt::Write as _;
use std::future::Future;

pub const HEADER: &str = "traceparent";

tokio::task_local! {
    static CURRENT: TraceContext;
}

/// A `traceparent`: version 00, a 16-byte trace id, an 8-byte parent span id, sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: [u8; 16],
    span_id: [u8; 8],
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
    /// A new trace.
    pub fn root() -> Self {
        Self {
            trace_id: random_bytes(),
            span_id: random_bytes(),
        }
    }

    /// The same trace, a new span.
    pub fn child(&self) -> Self {
        Self {
            trace_id: self.trace_id,
            span_id: random_bytes(),
        }
    }

    /// Continues the trace of a `traceparent` header (a new span in it), or
    /// starts one when the header is missing or invalid.
    pub fn continue_from(header: Option<&str>) -> Self {
        header
            .and_then(Self::parse)
            .map_or_else(Self::root, |parent| parent.child())
    }

    /// Parses `00-<32 hex>-<16 hex>-<2 hex>`; all-zero ids are invalid.
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, _flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() {
            return None;
        }
        let ctx = Self {
            trace_id: unhex(trace)?,
            span_id: unhex(span)?,
        };
        (ctx.trace_id != [0; 16] && ctx.span_id != [0; 8]).then_some(ctx)
    }

    pub fn trace_id(&self) -> String {
        hex(&self.trace_id)
    }

    pub fn to_header(&self) -> String {
        format!("00-{}-{}-01", hex(&self.trace_id), hex(&self.span_id))
    }
}

/// The context of the running task, if any.
pub fn current() -> Option<TraceContext> {
    CURRENT.try_with(|c| *c).ok()
}

/// Runs `fut` with `ctx` as the current context.
pub async fn scope<F: Future>(ctx: TraceContext, fut: F) -> F::Output {
    CURRENT.scope(ctx, fut).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_and_children_keep_the_trace() {
        let root = TraceContext::root();
        let parsed = TraceContext::parse(&root.to_header()).unwrap();
        assert_eq!(parsed, root);
        assert_eq!(root.child().trace_id(), root.trace_id());
        assert_ne!(root.child().to_header(), root.to_header());
        assert!(
            TraceContext::parse("00-00000000000000000000000000000000-0000000000000001-01")
                .is_none()
        );
        assert!(TraceContext::parse("garbage").is_none());
    }
}
