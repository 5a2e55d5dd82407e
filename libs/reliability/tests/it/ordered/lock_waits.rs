//! A lock wait that gives up (past `lock_timeout`) leaves the pool as it
//! found it: no connection goes back inside a transaction, aborted or
//! open, and the wait costs the message nothing (docs/adr/0034).

use super::*;
use reliability::consumer::{ApplyError, Outcome};
use sqlx::postgres::PgPoolOptions;

#[tokio::test]
async fn a_lock_wait_past_lock_timeout_leaves_no_connection_in_a_transaction() {
    let (db, _, cfg) = gate("reltest.lockwait.").await;
    // One connection, so the next user of the pool is the one that waited;
    // a short lock bound, so the test waits 300 ms rather than the role's 5 s.
    let options = (*db.app.connect_options())
        .clone()
        .options([("lock_timeout", "300ms")]);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    let consumer = Consumer::new(pool.clone(), &amqp_url(), cfg.clone(), Recording::default());
    let event = |id: i64, seq: i64| numbered(id, "held", Some(seq));
    let first = event(20, 1);

    // An operator's session holds the aggregate's lock past the bound.
    let mut holder = db.owner.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(reliability::consumer::lock_id(
            &cfg.name,
            1,
            &first.aggregate_key(),
        ))
        .execute(&mut *holder)
        .await
        .unwrap();
    let waited = consumer.apply(&first).await;
    let Err(ApplyError::Handler(e)) = waited else {
        panic!("the apply did not wait for the held lock: {waited:?}");
    };
    assert!(
        e.to_string().contains("lock timeout") || e.to_string().contains("55P03"),
        "{e}"
    );
    assert!(
        matches!(&e, HandlerError::Database(db_err) if reliability::db::is_retryable_at_no_cost(db_err)),
        "a lock wait costs the message nothing: {e}"
    );

    // The pool's one connection serves the next user, and no session of
    // the runtime role is left in a transaction (the holder's, of the
    // owner role, still is).
    sqlx::query("SELECT 1")
        .execute(&pool)
        .await
        .expect("the connection that waited is fit for its next user (not 25P02)");
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT state FROM pg_stat_activity
         WHERE datname = $1 AND usename = $2 AND state LIKE 'idle in transaction%'",
    )
    .bind(&db.name)
    .bind(reliability::db::APP_ROLE)
    .fetch_all(&db.admin)
    .await
    .unwrap();
    assert!(left.is_empty(), "sessions left in a transaction: {left:?}");

    // Once the holder lets go, the held aggregate applies, in order.
    holder.rollback().await.unwrap();
    assert_eq!(consumer.apply(&first).await.unwrap(), Outcome::Applied);
    assert_eq!(
        consumer.apply(&event(21, 2)).await.unwrap(),
        Outcome::Applied
    );
    assert_eq!(applied(&db).await.into_values().next(), Some(vec![20, 21]));
    pool.close().await;
    db.cleanup().await;
}

/// `park skip` beside a lane parking the aggregate's next event: the skip
/// waits for the lane's transaction (the aggregate's lock), removes only
/// the event it showed, and the lane's event stays parked. Without the
/// lock, the skip saw no other parked event, removed the emptied park, and
/// its cascade deleted the event the lane had just parked (and acked).
#[tokio::test]
async fn a_skip_beside_a_lane_parking_the_next_event_loses_nothing() {
    let (db, consumer, cfg) = gate("reltest.skiprace.").await;
    let event = |id: i64, seq: i64| numbered(id, "P", Some(seq));
    consumer.apply(&event(30, 1)).await.unwrap();
    consumer.apply(&event(31, 3)).await.unwrap();
    assert_eq!(
        consumer.apply(&event(32, 2)).await.unwrap(),
        Outcome::Parked
    );
    let shown = consumer::first_parked(&db.owner, &cfg.name, 1, "test", "P")
        .await
        .unwrap()
        .expect("P parked");
    assert_eq!(shown.message_id, 32);

    // A lane, mid-transaction: it holds P's lock and parks P's next event.
    let next = event(33, 4);
    let mut lane = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(reliability::consumer::lock_id(
            &cfg.name,
            1,
            &next.aggregate_key(),
        ))
        .execute(&mut *lane)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO parked_events (tenant_id, consumer, source, aggregate_type, aggregate_id,
                                    message_id, aggregate_seq, event_type, envelope)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(1_i64)
    .bind(&cfg.name)
    .bind(&next.source)
    .bind(&next.aggregate_type)
    .bind(&next.aggregate_id)
    .bind(next.id)
    .bind(next.aggregate_seq)
    .bind(&next.event_type)
    .bind(serde_json::to_value(&next).unwrap())
    .execute(&mut *lane)
    .await
    .unwrap();

    // The operator's skip of the event shown, meanwhile.
    let skip = tokio::spawn({
        let (owner, name) = (db.owner.clone(), cfg.name.clone());
        async move { consumer::skip(&owner, &name, 1, "test", "P", 32).await }
    });
    wait_until(LONG, "the skip waiting behind the lane", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
        )
        .bind(&db.name)
        .fetch_one(&db.admin)
        .await
        .unwrap()
            > 0
    })
    .await;
    lane.commit().await.unwrap();
    let skipped = skip.await.unwrap().unwrap().expect("the event shown");
    assert_eq!(skipped.message_id, 32);

    let parked = consumer::parked(&db.owner, Some(&cfg.name)).await.unwrap();
    assert_eq!(
        parked
            .iter()
            .map(|p| (p.aggregate_id.as_str(), p.waiting, p.first_message_id))
            .collect::<Vec<_>>(),
        [("P", 1, Some(33))],
        "the lane's event is still parked, P with it"
    );
    db.cleanup().await;
}
