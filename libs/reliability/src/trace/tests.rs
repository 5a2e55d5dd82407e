//! The W3C header: parsing, children, the caller's flags and state.

use super::*;

#[test]
fn a_traceparent_round_trips_and_children_keep_the_trace() {
    let root = TraceContext::root();
    let parsed = TraceContext::parse(&root.to_header()).unwrap();
    assert_eq!(parsed, root);
    assert_eq!(root.child().trace_id(), root.trace_id());
    assert_ne!(root.child().to_header(), root.to_header());
    assert!(
        TraceContext::parse("00-00000000000000000000000000000000-0000000000000001-01").is_none()
    );
    assert!(TraceContext::parse("garbage").is_none());
    assert!(
        TraceContext::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-zz").is_none(),
        "flags are two hex digits"
    );
}

#[test]
fn the_callers_sampled_flag_and_tracestate_are_kept_on_every_step() {
    let header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    let state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
    let unsampled = TraceContext::parse_with_state(header, Some(state)).unwrap();
    assert!(!unsampled.sampled());
    let next = unsampled.child().child();
    assert!(next.to_header().ends_with("-00"), "{}", next.to_header());
    assert_eq!(next.state(), Some(state));
    assert_eq!(next.trace_id(), "0af7651916cd43dd8448eb211c80319c");

    let sampled = header.replace("-00", "-01");
    let ctx = TraceContext::parse_with_state(&sampled, None).unwrap();
    assert!(ctx.sampled() && ctx.to_header() == sampled && ctx.state().is_none());
    assert!(
        TraceContext::root().sampled(),
        "a trace of our own is recorded"
    );

    // A state no system may pass on is dropped, the context kept.
    for bad in ["", "a=\u{7}", &"k=v,".repeat(200)] {
        let ctx = TraceContext::parse_with_state(header, Some(bad)).unwrap();
        assert_eq!(ctx.state(), None, "{bad:?}");
    }
}
