//! Changing an ordered subscription's partitions (K) under load: the runbook's
//! switch, 4 -> 8 -> 4, with nothing lost and every history in order.

use super::*;

const RELAYS: [&str; 3] = ["orders-relay", "inventory-relay", "payments-relay"];

const CONSUMER: &str = "projection-consumer";

/// K from 4 to 8 and back while writes go on, each time by the runbook's
/// drain and switch (docs/runbooks.md), with the real CLI's check.
pub(super) async fn change_k(run: &mut Run, tenant: i64) -> Outcome {
    let skus = stocked(run, tenant).await?;
    let (client, cluster, dbs) = (&run.client, &mut run.cluster, &run.dbs);
    let switches = async {
        for (from, to) in [(4, 8), (8, 4)] {
            let n = applied(dbs, tenant, None).await + 60;
            wait_until(
                Duration::from_secs(60),
                &format!("{n} history entries"),
                || async { applied(dbs, tenant, None).await >= n },
            )
            .await;
            switch_k(cluster, from, to).await?;
        }
        anyhow::Ok(())
    };
    let (sent, switched) = tokio::join!(churn(client, tenant, "k", &skus, 15, 30), switches);
    switched?;
    let adjusted: u32 = sent?.values().sum();
    Ok((
        format!(
            "relays stopped, partitions drained, consumers stopped, `reliability queue drained`, restarted with ORDERED_PARTITIONS; 4 -> 8 -> 4 (p4-p7 deleted) under {adjusted} adjustments and orders"
        ),
        vec![],
    ))
}

async fn switch_k(cluster: &mut Cluster, from: u16, to: u16) -> anyhow::Result<()> {
    let queue = format!("{PREFIX}{HISTORY}");
    let reliability = bin("reliability");
    let cli = reliability.to_str().unwrap_or("reliability");
    // 1. The relays stop: new events wait in the outboxes.
    for r in RELAYS {
        cluster.kill9(r);
    }
    // 2.-3. The consumer empties the partitions and stops; the CLI says
    // whether anything is left (a delivery it held goes back when it stops).
    let mut tries = 0;
    loop {
        let conn = reliability::broker::connect(&testkit::amqp_url(), "e2e-k").await?;
        let channel = conn.create_channel().await?;
        let mut spec = reliability::broker::QueueSpec::new(&queue, "", &[]);
        spec.partitions = from;
        let partitions = spec.queues();
        wait_until(
            Duration::from_secs(60),
            &format!("{queue}'s {from} partitions empty"),
            || async {
                let mut ready = 0;
                for p in &partitions {
                    ready += reliability::broker::queue_depth(&channel, p)
                        .await
                        .unwrap_or(1);
                }
                ready == 0
            },
        )
        .await;
        let _ = conn.close(200, "drained".into()).await;
        cluster.signal(CONSUMER, "TERM")?;
        cluster.wait_exit(CONSUMER, Duration::from_secs(30)).await;
        let k = from.to_string();
        let out = run_cmd(cli, &["queue", "drained", &queue, "--partitions", &k]).await?;
        if out.status.success() {
            break;
        }
        tries += 1;
        anyhow::ensure!(
            tries < 5,
            "{queue} not drained after {tries} tries: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        start(cluster, CONSUMER, from)?;
        cluster.ready(&[CONSUMER]).await?;
    }
    // 4. Shrinking: the partitions above the new K go first, empty and
    // unread. Deleting a queue drops its binding; left bound, the hash
    // exchange would go on routing some aggregates to them, where no
    // consumer reads (the first run of this row lost 9 events so).
    if to < from {
        let gone: Vec<String> = (to..from).map(|p| format!("{queue}.p{p}")).collect();
        let mut args = vec!["queue", "delete", "--yes"];
        args.extend(gone.iter().map(String::as_str));
        let out = run_cmd(cli, &args).await?;
        anyhow::ensure!(
            out.status.success(),
            "reliability queue delete: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // 5. The new K: the consumer first, then the relays.
    start(cluster, CONSUMER, to)?;
    cluster.ready(&[CONSUMER]).await?;
    for r in RELAYS {
        start(cluster, r, to)?;
    }
    cluster.ready(&RELAYS).await?;
    println!("   K of {queue}: {from} -> {to}");
    Ok(())
}

/// Starts `name` with the history's K: the code's 4 needs no setting.
fn start(cluster: &mut Cluster, name: &str, k: u16) -> anyhow::Result<()> {
    if k == contracts::topology::PROJECTION_HISTORY.partitions {
        cluster.start(name, None)
    } else {
        let value = format!("{HISTORY}={k}");
        cluster.start_with(name, None, &[("ORDERED_PARTITIONS", value.as_str())])
    }
}
