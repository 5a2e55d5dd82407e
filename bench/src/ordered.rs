//! The ordered path's apply rate next to the order-free one (ADR 0028),
//! in the same run: the same events, the same handler, the same replicas
//! and lanes; only the subscription differs.

use reliability::broker::{self, Outgoing, QueueSpec};
use reliability::consumer::ConsumerConfig;
use reliability::outbox::Envelope;
use serde_json::{Value, json};
use testkit::{TestDb, amqp_url, unique};

use crate::pipeline::{STATE_SQL, apply_all, outgoing, sliding_window_publish};
use crate::{Sizes, Table, pct};

/// Partitions of the ordered subscription, replicas and lanes of both
/// (`BENCH_ORDERED=partitions,replicas,lanes` to try others).
fn shape() -> (u16, usize, usize) {
    let v: Vec<usize> = std::env::var("BENCH_ORDERED")
        .unwrap_or_default()
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect();
    match v[..] {
        [k, r, l] => (u16::try_from(k).unwrap_or(4), r, l),
        _ => (4, 2, 4),
    }
}

/// `m` events over 100 tenants and 1000 aggregates, numbered in each
/// aggregate as a relay with an ordered subscriber numbers them.
fn messages(m: u64) -> anyhow::Result<Vec<Outgoing>> {
    let mut seq = std::collections::HashMap::<(i64, i64), i64>::new();
    (1..=i64::try_from(m)?)
        .map(|id| {
            let (tenant, aggregate) = (1 + id % 100, id % 1000);
            let n = seq.entry((tenant, aggregate)).or_insert(0);
            *n += 1;
            let e = Envelope {
                id,
                source: "bench".into(),
                tenant_id: tenant,
                aggregate_type: "order".into(),
                aggregate_id: aggregate.to_string(),
                event_type: "OrderPlaced".into(),
                event_version: 1,
                occurred_at: Default::default(),
                payload: json!({"order_id": id, "total_cents": 2500}),
                aggregate_seq: Some(*n),
            };
            let headers: serde_json::Map<String, Value> = serde_json::from_value(json!({
                broker::PARTITION_HEADER: format!("{tenant}/{}", e.aggregate_key()),
            }))?;
            outgoing(&e, broker::headers_from_json(&headers))
        })
        .collect()
}

/// Applies what waits in `spec`'s queues with the replicas and lanes of
/// [`shape`]; events per second.
async fn apply(db: &TestDb, spec: &QueueSpec, m: u64) -> anyhow::Result<f64> {
    let (_, replicas, lanes) = shape();
    let mut config = ConsumerConfig::new(&spec.queue, &spec.exchange, &[]);
    config.queue = spec.clone();
    config.lanes = lanes;
    apply_all(db, &config, replicas, m).await
}

pub(crate) async fn ordered_apply(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let (partitions, replicas, lanes) = shape();
    let db = TestDb::new().await;
    sqlx::raw_sql(STATE_SQL).execute(&db.owner).await?;
    let exchange = unique("reltest.bench.ord.");
    let free = QueueSpec::new(&format!("{exchange}.free"), &exchange, &["bench.*"]);
    let mut ordered = QueueSpec::new(&format!("{exchange}.ordered"), &exchange, &["bench.*"]);
    ordered.partitions = partitions;
    let conn = broker::connect(&amqp_url(), "bench-ordered").await?;
    let channel = conn.create_channel().await?;
    broker::declare_exchange(&channel, &exchange).await?;
    broker::declare_queue(&channel, &free).await?;
    broker::declare_queue(&channel, &ordered).await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions { nowait: false })
        .await?;
    let m = s.consume;
    let messages = messages(m)?;
    // Three rounds, each applying the same publish with both, back to
    // back: the ratio is taken per round (a pair shares the machine's
    // state of the moment) and the median of the three is reported. One
    // publish reaches both subscriptions; each run applies it afresh (its
    // own tables' rows are forgotten first).
    let mut pairs = Vec::new();
    for _ in 0..3 {
        sqlx::raw_sql(
            "TRUNCATE bench_state, processed_messages, consumer_offsets, aggregate_positions",
        )
        .execute(&db.owner)
        .await?;
        sliding_window_publish(&channel, &exchange, &messages).await?;
        let mut shares = Vec::new();
        for q in ordered.queues() {
            shares.push(broker::queue_depth(&channel, &q).await?);
        }
        println!("   events per partition: {shares:?}");
        let free_rate = apply(&db, &free, m).await?;
        let ordered_rate = apply(&db, &ordered, m).await?;
        println!(
            "   round: order-free {free_rate:.0}/s, ordered {ordered_rate:.0}/s, {}",
            pct(ordered_rate / free_rate)
        );
        pairs.push((free_rate, ordered_rate));
    }
    pairs.sort_by(|a, b| (a.1 / a.0).total_cmp(&(b.1 / b.0)));
    let (free_rate, ordered_rate) = pairs[pairs.len() / 2];
    let ratios: Vec<String> = pairs.iter().map(|(f, o)| pct(o / f)).collect();
    println!(
        "   consumer apply, {replicas} replicas x {lanes} lanes: order-free {free_rate:.0}/s, ordered over {partitions} partitions {ordered_rate:.0}/s (median round of {})",
        ratios.join(", ")
    );
    t.row([
        &format!(
            "ordered apply, {m} events, {partitions} partitions, {replicas} replicas x {lanes} lanes (median of 3 rounds: {})",
            ratios.join(", ")
        ),
        &format!("{ordered_rate:.0} events/s"),
        &format!("order-free, same replicas and lanes, {free_rate:.0}/s"),
        &pct(ordered_rate / free_rate),
        ">= 70%",
    ]);
    conn.close(200, "bench done".into()).await?;
    let mut queues = ordered.queues();
    queues.extend([ordered.queue.clone(), free.queue.clone()]);
    testkit::delete_broker_objects(&queues, &exchange).await;
    db.cleanup().await;
    Ok(())
}
