//! `reliability queue`: what the CLI says of a dead-letter queue and of an
//! ordered subscription's partitions, against the real broker. What it
//! moves is the library's (`libs/reliability/tests/it/consumer/redrive.rs`).

use std::process::{Command, Stdio};

use reliability::broker;
use testkit::{Broker, amqp_url};

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_reliability"))
        .args(args)
        .env("AMQP_URL", amqp_url())
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[tokio::test]
async fn a_redrive_dry_run_counts_what_a_filter_matches_and_moves_nothing() {
    let broker = Broker::new().await;
    let queue = broker.queue(&["svc.*"]).await;
    let dlq = broker
        .dead_letters(&queue, &[("svc:1", "A"), ("svc:2", "B"), ("svc:3", "A")])
        .await;
    let dry_run = |filter: &[&str]| {
        let mut args = vec!["--json", "queue", "dlq", "redrive", &queue, "--dry-run"];
        args.extend_from_slice(filter);
        let out = cli(&args);
        assert!(out.status.success(), "{out:?}");
        let done: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            done["matched"].as_u64().unwrap(),
            done["changed"].as_u64().unwrap(),
        )
    };
    assert_eq!(dry_run(&[]), (3, 0));
    assert_eq!(dry_run(&["--event-type", "A"]), (2, 0));
    assert_eq!(dry_run(&["--message-id", "svc:3"]), (1, 0));
    assert_eq!(broker.depth(&dlq).await, 3);
    assert_eq!(broker.depth(&queue).await, 0);
    broker.cleanup(&[&queue]).await;
}

#[tokio::test]
async fn drained_says_no_while_a_partition_holds_a_message_and_yes_once_empty() {
    let broker = Broker::new().await;
    let mut spec =
        broker::QueueSpec::new(&testkit::unique("reltest.q."), &broker.exchange, &["svc.*"]);
    spec.partitions = 2;
    broker::declare_queue(&broker.channel, &spec).await.unwrap();
    let partitions = spec.queues();
    let drained = || cli(&["queue", "drained", &spec.queue, "--partitions", "2"]);

    broker.publish_to_queue(&partitions[1], b"waiting").await;
    let out = drained();
    assert!(!out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("not drained") && said.contains(&partitions[1]),
        "{said}"
    );

    broker
        .channel
        .queue_purge(partitions[1].as_str().into(), Default::default())
        .await
        .unwrap();
    let out = drained();
    assert!(out.status.success(), "{out:?}");
    broker.cleanup_ordered(&spec).await;
}
