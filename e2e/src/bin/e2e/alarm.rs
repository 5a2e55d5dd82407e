//! A broker that blocks publishers: a memory alarm held for several confirm
//! timeouts under load, then cleared. Nothing may reach a DLQ, be lost, or
//! be applied twice; and no outbox row may be charged an attempt for it.

use std::time::Duration;

use e2e::world::World;

use crate::{Outcome, Run, attempts_spent, quiesce};

/// Puts the watermark back however the scenario ends.
struct Watermark(&'static World, String);

impl Drop for Watermark {
    fn drop(&mut self) {
        let (world, before) = (self.0, self.1.clone());
        tokio::spawn(async move {
            world
                .ctl(0, &["set_vm_memory_high_watermark", &before])
                .await
        });
    }
}

pub async fn memory_alarm(run: &mut Run, tenant: i64) -> Outcome {
    let world = run.world;
    let before = world
        .ctl(
            0,
            &["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."],
        )
        .await?;
    let before = if before.parse::<f64>().is_ok() {
        before
    } else {
        "0.4".to_owned()
    };
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 1000)
        .await?;
    let _restore = Watermark(world, before.clone());
    // One node's alarm blocks publishers on every node of the cluster.
    world
        .ctl(0, &["set_vm_memory_high_watermark", "0.0001"])
        .await?;
    // Held for four of e2e's 2 s confirm timeouts while orders keep coming.
    let client = &run.client;
    let (placed, held) = tokio::join!(client.orders(tenant, 100), async {
        tokio::time::sleep(Duration::from_secs(8)).await;
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_messages WHERE tenant_id = $1 AND processed_at IS NULL",
        )
        .bind(tenant)
        .fetch_one(&run.dbs.orders)
        .await?;
        world
            .ctl(0, &["set_vm_memory_high_watermark", &before])
            .await?;
        anyhow::Ok(pending)
    });
    let waiting = held?;
    placed?;
    quiesce(run, tenant).await?;
    let mut violations = Vec::new();
    if waiting == 0 {
        violations.push("scenario: the alarm held nothing back (did it fire?)".to_owned());
    }
    violations.extend(attempts_spent(run, tenant, "the blocked broker").await?);
    Ok((
        format!(
            "memory alarm (watermark 0.0001) for 8 s = 4 confirm timeouts, 100 orders; {waiting} events waited in the outbox; watermark back to {before}"
        ),
        violations,
    ))
}
