//! The history: an aggregate's events in the order the consumer applied
//! them (an ordered subscription delivers them in outbox order), once each.

use contracts::event;
use projection::history::{CONSUMER, History};
use reliability::consumer::{Consumer, ConsumerConfig};
use reliability::outbox::Envelope;
use serde_json::json;
use testkit::amqp_url;

use crate::spawn;

fn adjusted(seq: i64, delta: i64, on_hand: i64) -> Envelope {
    Envelope {
        id: 40 + seq,
        source: "inventory".into(),
        tenant_id: 1,
        aggregate_type: "product".into(),
        aggregate_id: "SKU-H".into(),
        event_type: event::STOCK_ADJUSTED.into(),
        event_version: 1,
        occurred_at: chrono::DateTime::from_timestamp(1_700_000_000 + seq, 0).unwrap(),
        payload: json!({"sku": "SKU-H", "delta": delta, "on_hand": on_hand, "reason": "restock"}),
        aggregate_seq: Some(seq),
    }
}

#[tokio::test]
async fn a_product_history_lists_its_events_in_the_order_applied_once_each() {
    let (api, db, stop) = spawn().await;
    let history = Consumer::new(
        db.app.clone(),
        &amqp_url(),
        ConsumerConfig::new(CONSUMER, "unused", &[]),
        History,
    );
    let (status, _) = api.get(1, "/history/product/SKU-H").await;
    assert_eq!(status, 404, "nothing arrived yet");
    let events = [adjusted(1, 10, 10), adjusted(2, -3, 7), adjusted(3, 5, 12)];
    for e in events.iter().chain(events.iter()) {
        history.apply(e).await.unwrap();
    }
    let (status, body) = api.get(1, "/history/product/SKU-H").await;
    assert_eq!(status, 200, "{body}");
    let entries: Vec<(i64, i64)> = body
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["position"].as_i64().unwrap(),
                e["payload"]["on_hand"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        entries,
        [(1, 10), (2, 7), (3, 12)],
        "in order, a repeat absorbed"
    );
    let (status, _) = api.get(2, "/history/product/SKU-H").await;
    assert_eq!(status, 404, "another tenant sees nothing");
    stop.cancel();
    db.cleanup().await;
}
