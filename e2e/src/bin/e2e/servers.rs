//! The world's servers go away whole, under load: every broker node's
//! application stopped and started, a memory alarm (`alarm.rs`), and
//! PostgreSQL killed `-m immediate`. Orders keep coming meanwhile and wait.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use testkit::wait_until;

use crate::alarm;
use crate::run::{Outcome, Run, Scenario, orders_of};

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![
        (
            "every broker node restarted with orders in flight",
            |r, t| Box::pin(broker_restart(r, t)),
        ),
        ("broker memory alarm held 45 s under load", |r, t| {
            Box::pin(alarm::memory_alarm(r, t))
        }),
        ("PostgreSQL restart -m immediate under load", |r, t| {
            Box::pin(postgres_restart(r, t))
        }),
    ]
}

fn sku(tenant: i64) -> String {
    format!("SKU-{tenant}")
}

/// Every node of the world's broker stops its application with 1000 orders
/// in flight (unacked deliveries, unconfirmed publishes), then all start
/// again together: a whole-cluster outage. The world heals whatever a
/// failure here leaves stopped.
async fn broker_restart(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 100_000).await?;
    let (client, dbs, world) = (&run.client, &run.dbs, run.world);
    let nodes = world.nodes().len();
    let done = AtomicBool::new(false);
    let (placed, restarted) = tokio::join!(client.orders_until(tenant, 10, &done), async {
        let outage = async {
            wait_until(Duration::from_secs(120), "100 orders placed", || async {
                orders_of(dbs, tenant).await >= 100
            })
            .await;
            // Together: one at a time, the first stops long before the last.
            let stopped =
                futures_util::future::join_all((0..nodes).map(|i| world.ctl(i, &["stop_app"])))
                    .await;
            stopped.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
            let at = orders_of(dbs, tenant).await;
            // Orders keep coming while the broker is away: they wait in the outbox.
            wait_until(
                Duration::from_secs(60),
                "50 orders accepted while the broker is down",
                || async { orders_of(dbs, tenant).await >= at + 50 },
            )
            .await;
            // Together: each node waits for its peers' tables as it starts.
            let started =
                futures_util::future::join_all((0..nodes).map(|i| world.ctl(i, &["start_app"])))
                    .await;
            started.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
            anyhow::Ok(at)
        };
        let at = outage.await;
        done.store(true, Ordering::Release);
        at
    });
    let at = restarted?;
    let placed = placed?;
    Ok((
        format!(
            "stop_app on all {nodes} broker nodes at order {at} of {placed} (unacked deliveries in flight), start_app 50 orders later"
        ),
        vec![],
    ))
}

/// The world's PostgreSQL killed `-m immediate` (as on a power cut) under
/// load, and started again.
async fn postgres_restart(run: &mut Run, tenant: i64) -> Outcome {
    run.client.stock(tenant, &sku(tenant), 1000).await?;
    let (client, dbs, world) = (&run.client, &run.dbs, run.world);
    let load = std::sync::atomic::Ordering::Relaxed;
    let (errors_before, unavailable_before) = (
        client.answered_500.load(load),
        client.answered_503.load(load),
    );
    let (placed, restarted) = tokio::join!(client.orders(tenant, 200), async {
        wait_until(Duration::from_secs(60), "30 orders placed", || async {
            orders_of(dbs, tenant).await >= 30
        })
        .await;
        world.pg_crash_restart().await
    });
    restarted?;
    placed?;
    let errors = client.answered_500.load(load) - errors_before;
    let unavailable = client.answered_503.load(load) - unavailable_before;
    anyhow::ensure!(
        errors == 0,
        "{errors} answers were 500 while the database restarted (503 expected)"
    );
    Ok((
        format!(
            "PostgreSQL restart -m immediate at order 30 of 200; clients retry ({unavailable} answers 503, 0 answers 500)"
        ),
        vec![],
    ))
}
