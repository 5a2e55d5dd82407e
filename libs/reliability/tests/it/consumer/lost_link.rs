//! A link to PostgreSQL that goes silent in the middle of an apply: the lane
//! gives up on it within its bound, and the pool closes the connection
//! instead of waiting on it (docs/adr/0022, amended).

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reliability::TenantTx;
use reliability::consumer::{Consumer, Handler, HandlerError};
use reliability::db;
use reliability::outbox::Envelope;
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use testkit::{TcpProxy, amqp_url, database_url, postgres_addr, wait_until};
use tokio_util::sync::CancellationToken;

use crate::support::{AddingHandler, DEADLINE, effects, envelope, tenant};

use super::setup;

/// Adds, as [`AddingHandler`] does; the first time, it first makes its
/// database fall silent, with the transaction open.
#[derive(Clone)]
struct SilencingHandler {
    proxy: Arc<TcpProxy>,
    silenced: Arc<AtomicBool>,
}

impl Handler for SilencingHandler {
    async fn handle(&self, tx: &mut TenantTx, event: &Envelope) -> Result<(), HandlerError> {
        if !self.silenced.swap(true, Ordering::SeqCst) {
            self.proxy.freeze();
        }
        AddingHandler::default().handle(tx, event).await
    }
}

#[tokio::test]
async fn an_apply_whose_database_falls_silent_is_given_up_within_its_bound_and_applied_once() {
    let (db, broker, mut cfg) = setup().await;
    let queue = cfg.queue.queue.clone();
    cfg.apply_bound = Duration::from_secs(1);
    cfg.batch_max = 1;
    let proxy = Arc::new(TcpProxy::start(postgres_addr()).await);
    let handler = SilencingHandler {
        proxy: proxy.clone(),
        silenced: Arc::default(),
    };
    let consumer = Arc::new(Consumer::new(
        db.pool_via(db::APP_ROLE, proxy.addr).await,
        &amqp_url(),
        cfg,
        handler,
    ));
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (stop, consumer) = (stop.clone(), consumer.clone());
        async move { consumer.run(stop).await }
    });
    broker
        .publish_to_queue(
            &queue,
            &serde_json::to_vec(&envelope("svc", 1, 1, "agg", "Added", 7)).unwrap(),
        )
        .await;
    // Silent, not gone: no error will come. Without a bound of our own the
    // lane would wait here for as long as the link stays silent.
    wait_until(
        DEADLINE,
        "the lane gave up on the silent apply and tried again",
        || async { consumer.stats().retries >= 1 },
    )
    .await;
    assert_eq!(consumer.stats().applied, 0);
    proxy.thaw();
    wait_until(DEADLINE, "applied once the link is back", || async {
        consumer.stats().applied == 1
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(effects(&db).await, vec![(1, "agg".to_owned(), 1, 7)]);
    broker.cleanup(&[&queue]).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_connection_dropped_in_a_transaction_is_closed_when_it_cannot_answer() {
    let db = testkit::TestDb::new().await;
    let proxy = TcpProxy::start(postgres_addr()).await;
    // Plain TCP: over TLS, sqlx's close itself waits to read from the peer
    // (docs/adr/0022, amended in session 27: what this does not cover).
    let options = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .database(&db.name)
        .host(&proxy.addr.ip().to_string())
        .port(proxy.addr.port())
        .ssl_mode(PgSslMode::Disable);
    let pool = db::pool_options()
        .max_connections(1)
        .connect_lazy_with(db::options_for_role(&options, db::APP_ROLE));
    let mut tx = TenantTx::begin(&pool, tenant(1)).await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    assert_eq!(pool.size(), 1);
    proxy.freeze();
    let stuck = tokio::time::timeout(
        Duration::from_millis(300),
        sqlx::query("SELECT 1").execute(&mut *tx),
    )
    .await;
    assert!(stuck.is_err(), "a frozen link answered");
    // Given back with its rollback queued and its answer owed. sqlx's own
    // test of it on release has no bound: the slot would stay taken for as
    // long as the link stays silent.
    drop(tx);
    wait_until(
        db::RELEASE_BOUND + Duration::from_secs(5),
        "the silent connection closed, its slot free",
        || async { pool.size() == 0 },
    )
    .await;
    proxy.thaw();
    // The pool opens a fresh one and is whole.
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(one, 1);
    pool.close().await;
    db.cleanup().await;
}
