//! A subscriber's queues deleted under load: declared again, nothing lost.

use super::*;

/// For each subscriber in turn: its consumer is down, an operator deletes
/// its queue, orders keep coming; the relays declare the queue again before
/// they publish, the events wait in it, and when the consumer returns every
/// order completes.
pub async fn deleted_queues(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 1000).await?;
    let conn = broker::connect(&amqp_url(), "e2e-operator").await?;
    let channel = broker::bounded(conn.create_channel()).await?;
    for (i, (svc, consumer)) in [
        ("inventory", "inventory.stock"),
        ("payments", "payments.charges"),
        ("orders", "orders.saga"),
        ("projection", "projection.views"),
    ]
    .into_iter()
    .enumerate()
    {
        // Deleting a queue deletes what it holds: the operator of this story
        // deletes it once everything delivered so far has been applied.
        let charges = ledger(run).await?;
        let dbs = &run.dbs;
        wait_until(
            Duration::from_secs(60),
            "every event so far applied",
            || async {
                dbs.check(tenant, &charges)
                    .await
                    .is_ok_and(|v| v.violations.is_empty())
            },
        )
        .await;
        let process = format!("{svc}-consumer");
        run.cluster.kill9(&process);
        broker::bounded(channel.queue_delete(
            format!("{PREFIX}{consumer}").as_str().into(),
            QueueDeleteOptions::default(),
        ))
        .await?;
        let placed: anyhow::Result<Vec<i64>> = join_all((0..5).map(|n| {
            let key = format!("deleted-{tenant}-{i}-{n}");
            let sku = sku(tenant);
            let client = &run.client;
            async move { client.order(tenant, &key, "c-1", &sku, 1).await }
        }))
        .await
        .into_iter()
        .collect();
        // The events are relayed (into the recreated queue) while the
        // consumer is still away.
        let dbs = &run.dbs;
        wait_until(Duration::from_secs(30), "the orders' events relayed", || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outbox_messages WHERE tenant_id = $1 AND processed_at IS NULL",
            )
            .bind(tenant)
            .fetch_one(&dbs.orders)
            .await
            .is_ok_and(|n| n == 0)
        })
        .await;
        run.cluster.start(&process, None)?;
        placed?;
        quiesce(run, tenant).await?;
    }
    let _ = broker::bounded(conn.close(200, "done".into())).await;
    Ok((
        "inventory, payments, orders, projection in turn: consumer killed, its queue deleted, 5 orders, consumer back".into(),
        vec![],
    ))
}
