//! A consumer's bindings held to the broker's, through the management API
//! (issue 43). Not in RabbitMQ 4's run: its chroot has no management API.

use std::time::Duration;

use reliability::broker::{self, QueueSpec};
use reliability::health::Health;
use service_kit::bindings;
use testkit::{Broker, management_url, unique, wait_until};
use tokio_util::sync::CancellationToken;

use crate::support::DEADLINE;

/// A queue that lost a binding (an operator's `unbind`, a broker restored
/// from old definitions) receives none of those events while its consumer
/// stays connected: the consumer's `/readyz` part names the binding within
/// the check's period, and is ready again once it is bound. Without the
/// check no part said anything, and the process stayed ready.
#[tokio::test]
async fn a_lost_binding_makes_its_consumer_not_ready_and_is_named() {
    let broker = Broker::new().await;
    let spec = QueueSpec::new(
        &unique("kittest.bind."),
        &broker.exchange,
        &["svc.A", "svc.B"],
    );
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let health = Health::default();
    let stop = CancellationToken::new();
    let watch = tokio::spawn(bindings::watch(
        "shop.views".into(),
        spec.clone(),
        management_url(),
        Duration::from_millis(300),
        health.clone(),
        stop.clone(),
    ));
    let status = || {
        health
            .report()
            .1
            .get("consumer shop.views bindings")
            .and_then(|s| s.as_str().map(str::to_owned))
    };
    wait_until(DEADLINE, "the bindings checked", || async {
        status().as_deref() == Some("ok")
    })
    .await;
    assert!(health.report().0, "{:?}", health.report().1);

    let queue = spec.queue.as_str();
    broker
        .channel
        .queue_unbind(
            queue.into(),
            broker.exchange.as_str().into(),
            "svc.B".into(),
            Default::default(),
        )
        .await
        .unwrap();
    wait_until(DEADLINE, "the lost binding named", || async {
        status().is_some_and(|s| s.contains(&format!("{queue} is not bound to `svc.B`")))
    })
    .await;
    assert!(!health.report().0, "not ready while a binding is lost");

    broker
        .channel
        .queue_bind(
            queue.into(),
            broker.exchange.as_str().into(),
            "svc.B".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    wait_until(DEADLINE, "ready again once bound", || async {
        status().as_deref() == Some("ok")
    })
    .await;
    stop.cancel();
    watch.await.unwrap();
    broker.cleanup(&[queue]).await;
}
