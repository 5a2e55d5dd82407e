//! The graph consumer's apply rate next to the raw rate of the same
//! statements on the same FalkorDB (issue 26, ADR 0030), in the same run:
//! the same orders' events, once through the broker and a consumer with
//! lanes, once handed to the sink directly by as many tasks as there are
//! lanes (the statements alone, no broker, no acks).

use std::sync::Arc;
use std::time::Instant;

use graph::apply::Edges;
use graph::store::Store;
use reliability::broker::{self, Outgoing, QueueSpec};
use reliability::consumer::{Consumer, ConsumerConfig, Sink};
use reliability::outbox::Envelope;
use serde_json::json;
use testkit::{amqp_url, unique};

use crate::pipeline::{apply_with, outgoing, sliding_window_publish};
use crate::{Sizes, Table, pct};

const LANES: usize = 4;
const CONSUMER: &str = contracts::topology::GRAPH_EDGES.consumer;

/// `m` events: orders of 4 tenants, each placed (two lines), reserved,
/// paid and confirmed.
fn events(m: u64) -> Vec<Envelope> {
    let mut out = Vec::new();
    let mut ids = std::collections::HashMap::<&str, i64>::new();
    let mut ev = |source: &'static str, tenant, aggregate: (&str, i64), t: &str, payload| {
        let id = ids.entry(source).or_insert(0);
        *id += 1;
        testkit::event(source, *id, tenant, aggregate, t, payload)
    };
    for order in 1..=i64::try_from(m.div_ceil(4)).unwrap_or(1) {
        let tenant = 1 + order % 4;
        let o = ("order", order);
        out.push(ev("orders", tenant, o, "OrderPlaced", json!({
            "order_id": order, "customer_id": format!("c-{}", order % 50), "currency": "EUR",
            "total_cents": 3000, "lines": [
                {"sku": format!("SKU-{}", order % 20), "quantity": 1, "unit_price_cents": 1000},
                {"sku": format!("SKU-{}", (order + 7) % 20), "quantity": 2, "unit_price_cents": 1000}]})));
        out.push(ev(
            "inventory",
            tenant,
            o,
            "InventoryReserved",
            json!({
            "order_id": order, "customer_id": "c", "currency": "EUR", "total_cents": 3000}),
        ));
        out.push(ev(
            "payments",
            tenant,
            ("payment", order),
            "PaymentCaptured",
            json!({
            "order_id": order, "payment_id": order, "amount_cents": 3000, "currency": "EUR"}),
        ));
        out.push(ev(
            "orders",
            tenant,
            o,
            "OrderConfirmed",
            json!({"order_id": order}),
        ));
    }
    out
}

pub(crate) async fn graph_apply(s: &Sizes, t: &mut Table) -> anyhow::Result<()> {
    let url = graph::test_url();
    let events = events(s.consume);
    let m = events.len() as u64;

    // The statements alone: LANES tasks, each a share of the events in
    // groups of 32, as the lanes hand them to the sink.
    let raw = Arc::new(Store::new(&url, &unique("bench.graph.raw.")));
    let shares: Vec<Vec<Envelope>> = (0..LANES)
        .map(|i| events.iter().skip(i).step_by(LANES).cloned().collect())
        .collect();
    let t0 = Instant::now();
    let tasks: Vec<_> = shares
        .into_iter()
        .map(|share| {
            let sink = Edges::new(raw.clone(), CONSUMER);
            tokio::spawn(async move {
                for group in share.chunks(32) {
                    let group: Vec<&Envelope> = group.iter().collect();
                    sink.apply(&group).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let raw_rate = m as f64 / t0.elapsed().as_secs_f64();

    // Through the broker: published first, then applied by one consumer
    // with LANES lanes.
    let exchange = unique("reltest.bench.graph.");
    let spec = QueueSpec::new(&format!("{exchange}.edges"), &exchange, &["#"]);
    let conn = broker::connect(&amqp_url(), "bench-graph").await?;
    let channel = conn.create_channel().await?;
    broker::declare_exchange(&channel, &exchange).await?;
    broker::declare_queue(&channel, &spec).await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions { nowait: false })
        .await?;
    let messages: Vec<Outgoing> = events
        .iter()
        .map(|e| outgoing(e, Default::default()))
        .collect::<anyhow::Result<_>>()?;
    sliding_window_publish(&channel, &exchange, &messages).await?;
    let live = Arc::new(Store::new(&url, &unique("bench.graph.live.")));
    let mut config = ConsumerConfig::new(CONSUMER, &exchange, &[]);
    config.queue = spec.clone();
    config.lanes = LANES;
    let rate = apply_with(1, m, || {
        Consumer::with_sink(
            &amqp_url(),
            config.clone(),
            Edges::new(live.clone(), CONSUMER),
        )
        .expect("an order-free subscription")
    })
    .await?;
    println!(
        "   graph apply: through the consumer {rate:.0}/s, the statements alone {raw_rate:.0}/s"
    );
    t.row([
        &format!("graph apply (FalkorDB), {m} events, {LANES} lanes"),
        &format!("{rate:.0} events/s"),
        &format!("the same statements, {LANES} tasks, no broker: {raw_rate:.0}/s"),
        &pct(rate / raw_rate),
        "issue 26: next to its raw rate",
    ]);
    conn.close(200, "bench done".into()).await?;
    testkit::delete_broker_objects(std::slice::from_ref(&spec.queue), &exchange).await;
    raw.delete().await?;
    live.delete().await?;
    Ok(())
}
