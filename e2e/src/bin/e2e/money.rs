//! Money follows the order (I4) where it hurts: payments killed between
//! the provider's answer and our record of it, then refused by the
//! provider, or run out of time; a refund killed the same way; charges that
//! land after the worker gave up on them, under load. The checker's money
//! rule (charged − refunded per key, from the provider's ledger) judges.

use std::time::Duration;

use serde_json::json;
use testkit::wait_until;

use crate::run::{Outcome, Run, Scenario, quiesce, sim_faults};

const PAYMENTS: &str = "payments-consumer";

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![
        (
            "payments killed after the provider charged, then refused",
            |r, t| Box::pin(killed_then_refused(r, t)),
        ),
        (
            "payments killed after the provider charged, down past its deadline",
            |r, t| Box::pin(killed_then_deadline(r, t)),
        ),
        (
            "a refund killed after the provider refunded, then refused",
            |r, t| Box::pin(refund_killed_then_refused(r, t)),
        ),
        (
            "provider lands charges after the worker timed out, under load",
            |r, t| Box::pin(late_landings(r, t)),
        ),
    ]
}

/// Runs the payments consumer with `payments.after_provider=abort` until it
/// has aborted on an answered call.
async fn crash_after_answer(run: &mut Run, env: &[(&str, &str)]) -> anyhow::Result<()> {
    run.cluster.kill9(PAYMENTS);
    run.cluster
        .start_with(PAYMENTS, Some("payments.after_provider=abort"), env)?;
    Ok(())
}

/// Once the crash happened, payments comes back to a provider that refuses
/// the next 20 calls: a 4xx that says nothing of the call whose answer died
/// with the process.
async fn restart_to_refusals(run: &mut Run, tenant: i64) -> anyhow::Result<()> {
    run.cluster
        .wait_exit(PAYMENTS, Duration::from_secs(60))
        .await;
    sim_faults(run, json!({"reject_next": 20})).await?;
    run.cluster.start(PAYMENTS, None)?;
    quiesce(run, tenant).await?;
    sim_faults(run, json!({})).await
}

async fn killed_then_refused(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    crash_after_answer(run, &[]).await?;
    run.client.orders(tenant, 3).await?;
    restart_to_refusals(run, tenant).await?;
    Ok((
        "payments.after_provider=abort, restart, the next 20 calls refused (422)".into(),
        vec![],
    ))
}

async fn killed_then_deadline(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    let short = [("PSP_DEADLINE_SECS", "3")];
    crash_after_answer(run, &short).await?;
    run.client.orders(tenant, 3).await?;
    run.cluster
        .wait_exit(PAYMENTS, Duration::from_secs(60))
        .await;
    // Payments stays down past every payment's deadline (an outage of
    // ours), and comes back to a provider that refuses.
    let dbs = &run.dbs;
    wait_until(Duration::from_secs(30), "every payment 4 s old", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT coalesce(bool_and(created_at < now() - interval '4 seconds'), false)
             FROM payments WHERE tenant_id = $1",
        )
        .bind(tenant)
        .fetch_one(&dbs.payments)
        .await
        .unwrap_or(false)
    })
    .await;
    sim_faults(run, json!({"reject_next": 20})).await?;
    run.cluster.start_with(PAYMENTS, None, &short)?;
    let dbs = &run.dbs;
    wait_until(Duration::from_secs(60), "every payment decided", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM payments WHERE tenant_id = $1 AND status = 'pending'",
        )
        .bind(tenant)
        .fetch_one(&dbs.payments)
        .await
        .is_ok_and(|n| n == 0)
    })
    .await;
    // Whatever refunds by key remain go on under the stack's own settings.
    run.cluster.kill9(PAYMENTS);
    run.cluster.start(PAYMENTS, None)?;
    sim_faults(run, json!({})).await?;
    quiesce(run, tenant).await?;
    Ok((
        "payments.after_provider=abort, down past a 3 s deadline, restart to 20 refusals".into(),
        vec![],
    ))
}

async fn refund_killed_then_refused(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    run.client.orders(tenant, 2).await?;
    quiesce(run, tenant).await?;
    let captured: Vec<i64> = sqlx::query_scalar(
        "SELECT payment_id FROM payments WHERE tenant_id = $1 AND status = 'captured' ORDER BY payment_id",
    )
    .bind(tenant)
    .fetch_all(&run.dbs.payments)
    .await?;
    let Some(&payment_id) = captured.first() else {
        return Ok((
            "no captured payment to refund".into(),
            vec!["setup: no order was captured".into()],
        ));
    };
    crash_after_answer(run, &[]).await?;
    let url = format!("{}/refunds", run.client.payments);
    let (status, body) = run
        .client
        .post(
            tenant,
            &url,
            &format!("refund-{tenant}"),
            &json!({"payment_id": payment_id, "amount_cents": 500}),
        )
        .await?;
    anyhow::ensure!(status == 201, "refund: {status} {body}");
    restart_to_refusals(run, tenant).await?;
    Ok((
        "a 500-cent refund: payments.after_provider=abort, restart, the next 20 calls refused"
            .into(),
        vec![],
    ))
}

async fn late_landings(run: &mut Run, tenant: i64) -> Outcome {
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100)
        .await?;
    // The worker gives up after 1 s; each of these lands 1.8 s after it
    // was sent, inside its 2 s lease (past it, the request's X-Not-After
    // would drop it), and until then a replay of its key is 409.
    sim_faults(
        run,
        json!({"land_late_next": 10, "land_after_ms": 1800, "hang_ms": 1500}),
    )
    .await?;
    run.client.orders(tenant, 40).await?;
    quiesce(run, tenant).await?;
    sim_faults(run, json!({})).await?;
    Ok((
        "40 orders; 10 charges answered 504 after 1.5 s and landed at 1.8 s".into(),
        vec![],
    ))
}
