//! Group commit across lanes (docs/adr/0039): groups that find another
//! lane's transaction in flight wait for it, and go as one transaction
//! when it ends; a lane alone does not wait.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reliability::TenantTx;
use reliability::consumer::{Handler, HandlerError};
use reliability::outbox::Envelope;
use testkit::wait_until;
use tokio::sync::Semaphore;

use super::setup;
use crate::support::{DEADLINE, envelope};

/// Records the transaction each event was applied in; a `Hold` event
/// waits, inside its transaction, until the test lets it go.
#[derive(Clone)]
struct TxidHandler {
    holding: Arc<AtomicBool>,
    release: Arc<Semaphore>,
}

impl Handler for TxidHandler {
    async fn handle(&self, tx: &mut TenantTx, event: &Envelope) -> Result<(), HandlerError> {
        if event.event_type == "Hold" {
            self.holding.store(true, Ordering::SeqCst);
            let _ = self.release.acquire().await;
        }
        sqlx::query("INSERT INTO test_txids (id, txid) VALUES ($1, txid_current())")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn groups_waiting_behind_another_lanes_commit_go_as_one_transaction_and_a_lane_alone_does_not_wait()
 {
    let (db, broker, mut cfg) = setup().await;
    sqlx::raw_sql(
        "CREATE TABLE test_txids (id bigint PRIMARY KEY, txid bigint NOT NULL);
         GRANT SELECT, INSERT ON test_txids TO commerce_app;",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let queue = cfg.queue.queue.clone();
    cfg.lanes = 4;
    // One unacked delivery per lane: the events after the held one go to
    // the three other lanes, one each.
    cfg.prefetch = 1;
    // Far past the test's deadlines: only another lane's commit can end a
    // wait here, and a lane that waited alone would fail the first step.
    cfg.gather_wait = Duration::from_secs(60);
    let handler = TxidHandler {
        holding: Arc::default(),
        release: Arc::new(Semaphore::new(0)),
    };
    let (stop, consumer, task) = super::start(&db, cfg, handler.clone());
    let publish = |id: i64, event_type: &'static str| {
        let body = serde_json::to_vec(&envelope("svc", id, 1, &format!("a{id}"), event_type, id));
        let (broker, queue) = (&broker, &queue);
        async move { broker.publish_to_queue(queue, &body.unwrap()).await }
    };

    // Alone: no other lane is applying, so the lone event does not wait.
    publish(1, "Added").await;
    wait_until(DEADLINE, "a lone event applied", || async {
        consumer.stats().applied == 1
    })
    .await;

    // A transaction in flight, held; three events arrive on the others.
    publish(2, "Hold").await;
    wait_until(DEADLINE, "the held event in its transaction", || async {
        handler.holding.load(Ordering::SeqCst)
    })
    .await;
    for id in 3..=5 {
        publish(id, "Added").await;
    }
    // (Or, where lanes did not gather, applied at once, each alone: the
    // assertions below then say so.)
    wait_until(
        DEADLINE,
        "three groups waiting for the held commit",
        || async { consumer.gathering() == 3 || consumer.stats().applied == 4 },
    )
    .await;
    handler.release.add_permits(1);
    wait_until(DEADLINE, "all five applied", || async {
        consumer.stats().applied == 5
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();

    let txids: Vec<(i64, i64)> = sqlx::query_as("SELECT id, txid FROM test_txids ORDER BY id")
        .fetch_all(&db.owner)
        .await
        .unwrap();
    let txid = |id: i64| txids.iter().find(|(i, _)| *i == id).unwrap().1;
    assert_eq!(txids.len(), 5, "{txids:?}");
    assert!(
        txid(3) == txid(4) && txid(4) == txid(5),
        "the three waiting groups committed as one transaction: {txids:?}"
    );
    assert_ne!(txid(2), txid(3), "{txids:?}");
    let stats = consumer.stats();
    assert_eq!((stats.gathered, stats.duplicates), (2, 0), "{stats:?}");
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}
