//! An event that takes its consumer down every time it is tried: the
//! process aborts on it, and a supervisor (here the scenario, as systemd or
//! Kubernetes would) starts it again. On an ordered partition the broker's
//! delivery limit would dead-letter it, a gap the aggregate's later events
//! would be applied over; the lane parks it instead (docs/adr/0028,
//! amended in session 27). The events prefetched behind it, handed back by
//! every crash too, were never tried: they are applied, not parked.

use std::time::Duration;

use super::{HISTORY, applied, churn, written_for};
use crate::run::{Outcome, Run};

const CONSUMER: &str = "projection-consumer";
/// Writes a second over the scenario's products while the consumer crashes.
const PER_SEC: u32 = 24;
/// Products: enough that some share the crashing one's partition (K = 4).
const PRODUCTS: usize = 12;
const SECS: u32 = 6;
/// Bound on the crash and restart cycles until the event parks: the lane
/// parks at half the queue's delivery limit (5 of 10); the rest is margin.
const MOST_RESTARTS: u32 = 12;

pub(crate) async fn worn(run: &mut Run, tenant: i64) -> Outcome {
    let skus: Vec<String> = (0..PRODUCTS).map(|i| format!("W{tenant}-{i}")).collect();
    for sku in &skus {
        run.client.stock(tenant, sku, 100_000).await?;
    }
    let crashing = skus[0].clone();
    let dbs = &run.dbs;
    testkit::wait_until(Duration::from_secs(60), "the stock applied", || async {
        applied(dbs, tenant, None).await >= skus.len() as i64
    })
    .await;
    let point = format!("consumer.handler@{HISTORY}/{tenant}/product:{crashing}=abort*");
    run.cluster.kill9(CONSUMER);
    run.cluster.start(CONSUMER, Some(&point))?;
    run.cluster.ready(&[CONSUMER]).await?;

    let parked_here = async |run: &Run| {
        reliability::consumer::parked(&run.dbs.projection, Some(HISTORY))
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|p| p.tenant_id == tenant)
            .collect::<Vec<_>>()
    };
    // Writes race on every product while the consumer crashes and comes
    // back, until the crashing product is parked.
    let (client, cluster) = (&run.client, &mut run.cluster);
    let writes = churn(client, tenant, "worn", &skus, PER_SEC, SECS);
    let supervise = async {
        let mut restarts = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            let parked = reliability::consumer::parked(&run.dbs.projection, Some(HISTORY))
                .await
                .unwrap_or_default();
            if parked
                .iter()
                .any(|p| p.tenant_id == tenant && p.aggregate_id == crashing)
            {
                return Ok(restarts);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline && restarts <= MOST_RESTARTS,
                "product:{crashing} not parked after {restarts} crashes"
            );
            if cluster.exited(CONSUMER) {
                restarts += 1;
                cluster.start(CONSUMER, Some(&point))?;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let (adjusted, restarts) = tokio::join!(writes, supervise);
    let (adjusted, restarts): (_, u32) = (adjusted?, restarts?);

    let mut violations = Vec::new();
    let parked = parked_here(run).await;
    match parked.as_slice() {
        [p] if p.aggregate_id == crashing && p.error.contains("died each of the") => {}
        other => violations.push(format!(
            "worn: expected product:{crashing} alone parked, as the event its consumer died on; parked: {:?}",
            other
                .iter()
                .map(|p| format!("{}:{} ({})", p.aggregate_type, p.aggregate_id, p.error))
                .collect::<Vec<_>>()
        )),
    }

    // Fixed, the consumer back without the fault; the operator unparks,
    // and every event of the product is applied, in order (the checker
    // holds each history to its outbox).
    run.cluster.kill9(CONSUMER);
    run.cluster.start(CONSUMER, None)?;
    run.cluster.ready(&[CONSUMER]).await?;
    for p in &parked {
        reliability::consumer::unpark(
            &run.dbs.projection,
            HISTORY,
            tenant,
            &p.aggregate_type,
            &p.aggregate_id,
        )
        .await?;
    }
    let total = written_for(&run.dbs, tenant, &crashing).await?;
    let dbs = &run.dbs;
    testkit::wait_until(
        Duration::from_secs(60),
        &format!("product:{crashing} unparked, its {total} events applied"),
        || async { applied(dbs, tenant, Some(&crashing)).await >= total },
    )
    .await;
    let written: u32 = adjusted.values().sum();
    Ok((
        format!(
            "{written} writes over {} products in {SECS} s while the history consumer aborted on product:{crashing} each time it tried it; parked after {restarts} restarts, then fixed and unparked",
            skus.len()
        ),
        violations,
    ))
}
