//! A consumer host cut off (docs/adr/0023): a replica of inventory's
//! consumer runs on a host of its own, beside its twin on the servers' host,
//! and loses its link to the broker for 60 s, or to PostgreSQL for 90 s,
//! under load.
//! Nothing is lost, nothing applied twice, and it comes back by itself.
//! SKIP where network namespaces cannot be made.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::hosts::{Host, Link};
use e2e::world::World;
use testkit::wait_until;

use crate::run::{Outcome, Run, SKIPPED, Scenario, orders_of, quiesce};

/// This module's rows of the table.
pub fn scenarios() -> Vec<Scenario> {
    vec![
        (
            "a consumer host cut off from the broker for 60 s",
            |r, t| Box::pin(cut_off(r, t, Link::Broker)),
        ),
        (
            "a consumer host cut off from PostgreSQL for 90 s",
            |r, t| Box::pin(cut_off(r, t, Link::Postgres)),
        ),
    ]
}

/// The replica on the other host.
const ON_HOST: &str = "inventory-consumer-h1";
/// How long the link stays down: past what each cut must show. The
/// broker's: its two missed 15 s heartbeats that drop the host's
/// connections (sampled every 5 s), twice over. PostgreSQL's: the apply's
/// 40 s bound and the server's 15 s end of an idle transaction, with a
/// margin. (Both 90 s until session 30: the broker's half showed nothing
/// more for its extra 30 s of CI.)
fn cut_for(link: Link) -> Duration {
    match link {
        Link::Broker => Duration::from_secs(60),
        Link::Postgres => Duration::from_secs(90),
    }
}
/// Every order decided within this of a heal of the link to PostgreSQL:
/// an apply in flight when the link went is given up within its bound
/// (40 s, on our side) while the link is down, and the server ends its
/// half within `idle_in_transaction_session_timeout` (15 s), so after the
/// heal only the outage backoff (5 s at most) and a connect remain. Without
/// the apply's bound it took 120 s and more (docs/adr/0022, amended).
const DECIDED_AFTER_HEAL: Duration = Duration::from_secs(60);

/// The stack's settings as the host sees them: the servers over its links.
fn host_env(env: &[(String, String)]) -> Vec<(String, String)> {
    env.iter()
        .filter_map(|(k, v)| {
            let link = if k.ends_with("DATABASE_URL") || k == "DB_POOLER" {
                Link::Postgres
            } else if k == "AMQP_URL" {
                Link::Broker
            } else {
                return None;
            };
            Some((k.clone(), v.replace("127.0.0.1", &Host::server_addr(link))))
        })
        .collect()
}

/// Broker connections that come from the host.
async fn host_connections(world: &'static World) -> usize {
    let client = Host::client_addr(Link::Broker);
    world
        .ctl(
            0,
            &["list_connections", "peer_host", "--no-table-headers", "-q"],
        )
        .await
        .map(|out| out.lines().filter(|l| l.trim() == client).count())
        .unwrap_or(0)
}

async fn cut_off(run: &mut Run, tenant: i64, link: Link) -> Outcome {
    let world = run.world;
    let host = match world.host() {
        Ok(host) => host,
        Err(why) => return Ok((format!("{SKIPPED}{why}"), vec![])),
    };
    if !run.cluster.procs.contains_key(ON_HOST) {
        let env = host_env(run.cluster.env());
        run.cluster.add_on(
            ON_HOST,
            host.exec_prefix(),
            env,
            crate::run::bin("inventory"),
            &["consume"],
        );
    }
    run.client
        .stock(tenant, &format!("SKU-{tenant}"), 100_000)
        .await?;
    // Its lanes, each on a connection of its own (ADR 0024): all of them
    // must be up before the cut, and back after the heal.
    let lanes: usize = run
        .cluster
        .env()
        .iter()
        .find(|(k, _)| k == "CONSUMER_LANES")
        .map_or(Ok(4), |(_, v)| v.parse())?;
    run.cluster.start(ON_HOST, None)?;
    wait_until(
        Duration::from_secs(60),
        "every lane of the host's consumer connected to the broker",
        || async { host_connections(world).await >= lanes },
    )
    .await;
    let (client, dbs) = (&run.client, &run.dbs);
    let done = AtomicBool::new(false);
    let (placed, fault) = tokio::join!(client.orders_until(tenant, 5, &done), async {
        let fault = async {
            wait_until(Duration::from_secs(60), "20 orders placed", || async {
                orders_of(dbs, tenant).await >= 20
            })
            .await;
            let cut = cut_for(link);
            host.cut(link)?;
            let cut_at = Instant::now();
            let at = orders_of(dbs, tenant).await;
            // When the broker gave up on the host's connections (a cut
            // from the broker: about two 15 s heartbeats).
            let mut dropped_after = None;
            while cut_at.elapsed() < cut {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if dropped_after.is_none() && host_connections(world).await == 0 {
                    dropped_after = Some(cut_at.elapsed());
                }
            }
            host.heal(link)?;
            anyhow::Ok((at, dropped_after))
        };
        let outcome = fault.await;
        // Heal whatever stopped the fault half way.
        let _ = host.heal(link);
        done.store(true, Ordering::Release);
        outcome
    });
    let (at, dropped_after) = fault?;
    let placed = placed?;
    let healed = Instant::now();
    quiesce(run, tenant).await?;
    let drained = healed.elapsed();
    let mut violations = Vec::new();
    let back = tokio::time::timeout(Duration::from_secs(60), async {
        while host_connections(world).await < lanes {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await
    .is_ok();
    if !back {
        violations.push(format!(
            "{ON_HOST}: not reconnected to the broker 60 s after the heal ({} of {lanes} lanes)",
            host_connections(world).await
        ));
    }
    if link == Link::Postgres && drained > DECIDED_AFTER_HEAL {
        violations.push(format!(
            "orders decided {} s after the heal, past the {} s bound",
            drained.as_secs(),
            DECIDED_AFTER_HEAL.as_secs()
        ));
    }
    if run.cluster.exited(ON_HOST) {
        violations.push(format!("{ON_HOST} exited during the cut"));
    }
    run.cluster.kill9(ON_HOST);
    let what = match link {
        Link::Broker => "the broker",
        Link::Postgres => "PostgreSQL",
    };
    let dropped = match (link, dropped_after) {
        (Link::Broker, Some(d)) => format!(
            "; the broker dropped its {lanes} connections within {} s",
            d.as_secs()
        ),
        (Link::Broker, None) => format!("; its {lanes} connections outlived the cut on the broker"),
        (Link::Postgres, _) => format!("; its {lanes} broker connections stayed"),
    };
    Ok((
        format!(
            "{ON_HOST} (on a host of its own) cut off from {what} for {} s at order {at} of {placed}, 5 orders/s{dropped}; all decided {} s after the heal",
            cut_for(link).as_secs(),
            drained.as_secs()
        ),
        violations,
    ))
}
