//! An aggregate's lock held past `lock_timeout` under load (ADR 0034):
//! an operator's session (or any slow transaction) holds the advisory lock
//! the projection's ordered history consumer takes for five orders, for
//! 15 s, while their later events arrive and reads go on. No session is
//! left in an aborted transaction, no read answers 5xx, nothing is parked,
//! and the held orders complete once the lock is released (the checker).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::run::{LAYOUT, Outcome, Run};

/// Longer than the runtime role's `lock_timeout` (5 s) three times over.
const HOLD: Duration = Duration::from_secs(15);

pub(crate) async fn lock_held(run: &mut Run, tenant: i64) -> Outcome {
    let sku = format!("SKU-{tenant}");
    run.client.stock(tenant, &sku, 1000).await?;
    let mut held = Vec::new();
    for i in 0..5 {
        let key = format!("held-{tenant}-{i}");
        held.push(run.client.order(tenant, &key, "c-held", &sku, 1).await?);
    }
    // Taken as soon as the orders are placed: their confirmations come
    // after the provider's answer, so they meet the lock.
    let consumer = contracts::topology::PROJECTION_HISTORY.consumer;
    let keys: Vec<i64> = held
        .iter()
        .map(|id| reliability::consumer::lock_id(consumer, tenant, &format!("order:{id}")))
        .collect();
    let mut holder = run.dbs.projection.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) AS u(k)")
        .bind(&keys)
        .execute(&mut *holder)
        .await?;

    // A superuser's look: pg_stat_activity shows another role's state only to one.
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            testkit::database_url()
                .parse::<sqlx::postgres::PgConnectOptions>()?
                .database(&format!("{}_projection", LAYOUT.name)),
        )
        .await?;
    let client = &run.client;
    let done = AtomicBool::new(false);
    let url = LAYOUT.url("projection");
    let token = client.token(tenant);
    let (placed, watched) = tokio::join!(client.orders_until(tenant, 4, &done), async {
        let (mut reads, mut failed, mut aborted, mut waited) = (0, Vec::new(), 0i64, false);
        let started = Instant::now();
        while started.elapsed() < HOLD {
            for id in &held {
                let answer = client
                    .http
                    .get(format!("{url}/orders/{id}"))
                    .bearer_auth(&token)
                    .send()
                    .await;
                reads += 1;
                if let Ok(a) = answer
                    && a.status().is_server_error()
                {
                    failed.push(a.status().as_u16());
                }
            }
            // Aborted for over a second: a lane whose lock wait just
            // failed is aborted too, for the round trip of its ROLLBACK
            // (a 250 ms sample caught two such in a rehearsal); a
            // connection back in the pool inside one stays until reused.
            let (now_aborted, now_waiting): (i64, bool) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM pg_stat_activity
                         WHERE datname = current_database() AND state = 'idle in transaction (aborted)'
                           AND state_change < now() - interval '1 second'),
                        EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                                WHERE l.locktype = 'advisory' AND NOT l.granted
                                  AND a.datname = current_database())",
            )
            .fetch_one(&admin)
            .await?;
            aborted = aborted.max(now_aborted);
            waited |= now_waiting;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        done.store(true, Ordering::Release);
        anyhow::Ok((reads, failed, aborted, waited))
    });
    holder.rollback().await?;
    let placed = placed?;
    let (reads, failed, aborted, waited) = watched?;
    crate::run::quiesce(run, tenant).await?;
    let mut violations = Vec::new();
    if !failed.is_empty() {
        violations.push(format!(
            "lock held: {} of {reads} reads of the held orders answered 5xx: {failed:?}",
            failed.len()
        ));
    }
    if aborted > 0 {
        violations.push(format!(
            "lock held: {aborted} session(s) sat idle in an aborted transaction for over a second"
        ));
    }
    if !waited {
        violations.push(
            "lock held: no applier waited on the held lock (the scenario proved nothing)".into(),
        );
    }
    Ok((
        format!(
            "the history consumer's lock of 5 orders held {}s by another session while {placed} more orders came; {reads} reads of them",
            HOLD.as_secs()
        ),
        violations,
    ))
}
