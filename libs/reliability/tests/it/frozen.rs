//! A process frozen in the middle of its work (SIGSTOP, a paused VM, a
//! GC-like stall) holds the others up only for a bound we chose (I9,
//! docs/adr/0022): the server ends a transaction left idle, and the broker
//! a connection left silent.

use std::time::{Duration, Instant};

use reliability::db::ROLE_BOUNDS;
use testkit::{TestDb, amqp_url};

/// The runtime role's idle-in-transaction bound, as `ROLE_BOUNDS` sets it.
fn app_idle_bound() -> Duration {
    bound_of(
        reliability::db::APP_ROLE,
        "idle_in_transaction_session_timeout",
    )
}

fn bound_of(role: &str, setting: &str) -> Duration {
    let (_, _, value) = ROLE_BOUNDS
        .iter()
        .find(|(r, s, _)| *r == role && *s == setting)
        .unwrap_or_else(|| panic!("{role} has no {setting}"));
    Duration::from_secs(value.trim_end_matches('s').parse().expect("seconds"))
}

#[tokio::test]
async fn a_transaction_a_frozen_replica_left_open_gives_its_locks_back_within_the_bound() {
    let db = TestDb::new().await;
    // The frozen replica: it took the aggregate's lock and a row lock in
    // its transaction, then stopped running.
    let mut frozen = db.app.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(4242)")
        .execute(&mut *frozen)
        .await
        .unwrap();
    // Its twin wants the same aggregate. Each wait ends at the lock bound
    // and is retried at no cost, as the consumer does, until the frozen
    // session is gone.
    let bound = app_idle_bound();
    let started = Instant::now();
    let twin = loop {
        assert!(
            started.elapsed() < bound + Duration::from_secs(15),
            "the twin waited past the bound: the frozen transaction kept its lock"
        );
        let mut twin = db.app.begin().await.unwrap();
        match sqlx::query("SELECT pg_advisory_xact_lock(4242)")
            .execute(&mut *twin)
            .await
        {
            Ok(_) => break twin,
            Err(e) if reliability::db::is_retryable_at_no_cost(&e) => {}
            Err(e) => panic!("{e}"),
        }
    };
    let waited = started.elapsed();
    assert!(
        waited + Duration::from_secs(1) >= bound,
        "the twin got the lock after {waited:?}, before the bound: was it ever held?"
    );
    twin.commit().await.unwrap();
    // When the frozen process wakes, its transaction is gone, not resumed.
    let woke = tokio::time::timeout(
        Duration::from_secs(10),
        sqlx::query("SELECT 1").execute(&mut *frozen),
    )
    .await
    .expect("a woken connection answers at once");
    assert!(woke.is_err(), "the server ended the abandoned session");
    drop(frozen);
    db.cleanup().await;
}

#[tokio::test]
async fn a_wait_behind_a_live_holder_gives_up_at_the_roles_lock_bound() {
    let db = TestDb::new().await;
    let bound = bound_of(reliability::db::APP_ROLE, "lock_timeout");
    assert!(
        bound < app_idle_bound(),
        "else the idle bound ends it first"
    );
    // The holder is alive (not frozen): only the lock bound frees its twin.
    let mut holder = db.app.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(4343)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let started = Instant::now();
    let mut twin = db.app.begin().await.unwrap();
    let waited = tokio::time::timeout(
        app_idle_bound() + Duration::from_secs(5),
        sqlx::query("SELECT pg_advisory_xact_lock(4343)").execute(&mut *twin),
    )
    .await
    .expect("the twin waited past the idle bound");
    let gave_up = waited.expect_err("the twin took a lock that was never given back");
    let elapsed = started.elapsed();
    assert!(
        reliability::db::is_retryable_at_no_cost(&gave_up),
        "{gave_up}"
    );
    assert!(
        elapsed + Duration::from_millis(500) >= bound && elapsed < bound + Duration::from_secs(3),
        "gave up after {elapsed:?}, the bound is {bound:?}"
    );
    drop(twin);
    holder.rollback().await.unwrap();
    db.cleanup().await;
}

#[tokio::test]
async fn every_runtime_role_carries_the_bounds_on_abandoned_work() {
    let db = TestDb::new().await;
    for role in [reliability::db::APP_ROLE, reliability::db::RELAY_ROLE] {
        let settings: Vec<String> = sqlx::query_scalar(
            "SELECT unnest(s.setconfig) FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole
             WHERE r.rolname = $1 AND s.setdatabase = 0",
        )
        .bind(role)
        .fetch_all(&db.admin)
        .await
        .unwrap();
        for wanted in [
            "idle_in_transaction_session_timeout",
            "statement_timeout",
            "lock_timeout",
            "tcp_keepalives_idle",
        ] {
            assert!(
                settings
                    .iter()
                    .any(|s| s.starts_with(&format!("{wanted}="))),
                "{role} has no {wanted}: {settings:?}"
            );
        }
    }
    db.cleanup().await;
}

#[tokio::test]
async fn the_broker_agrees_to_our_heartbeat() {
    let conn = reliability::broker::connect(&amqp_url(), "reltest-heartbeat")
        .await
        .unwrap();
    assert_eq!(
        conn.configuration().heartbeat(),
        reliability::broker::HEARTBEAT_SECS,
        "negotiated with the broker: a silent peer is dead within ~2 intervals"
    );
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test]
async fn a_url_list_reaches_the_node_that_answers() {
    // Port 1 refuses at once: a dead node of the cluster, listed first
    // and last, so that whichever node a call starts from, one is passed over.
    let dead = "amqp://guest:guest@127.0.0.1:1/%2f";
    let list = format!("{dead}, {}, {dead}", amqp_url());
    for _ in 0..3 {
        let conn = reliability::broker::connect(&list, "reltest-nodes")
            .await
            .expect("a live node in the list is found");
        assert!(conn.status().connected());
        let _ = conn.close(200, "done".into()).await;
    }
    let none = reliability::broker::connect(&format!("{dead},{dead}"), "reltest-nodes").await;
    assert!(none.is_err(), "no live node: an error, not a hang");
}

#[tokio::test]
async fn one_classifier_tells_a_dependency_down_from_a_settled_conflict_from_bad_data() {
    use reliability::db::{is_retryable_at_no_cost, is_unavailable};
    use sqlx::Connection as _;
    use std::str::FromStr as _;

    let db = TestDb::new().await;
    // A lock wait the server ended (55P03): retried at no cost, not a
    // dependency down.
    let mut holder = db.app.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(77)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut waiter = db.app.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '50ms'")
        .execute(&mut *waiter)
        .await
        .unwrap();
    let gave_up = sqlx::query("SELECT pg_advisory_xact_lock(77)")
        .execute(&mut *waiter)
        .await
        .unwrap_err();
    assert!(
        is_retryable_at_no_cost(&gave_up) && !is_unavailable(&gave_up),
        "{gave_up}"
    );
    drop(waiter);
    holder.rollback().await.unwrap();
    // Bad data is the message's fault: it costs an attempt.
    let bad = sqlx::query("SELECT 'x'::int")
        .execute(&db.app)
        .await
        .unwrap_err();
    assert!(
        !is_retryable_at_no_cost(&bad) && !is_unavailable(&bad),
        "{bad}"
    );
    // Nobody listening: the database is down.
    let options = sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(1);
    let down = sqlx::PgConnection::connect_with(&options)
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        is_unavailable(&down) && is_retryable_at_no_cost(&down),
        "{down}"
    );
    // The server refuses our own credentials (SQLSTATE class 28: here a
    // role that does not exist; a password rotated on one side only under
    // scram): our configuration, never a message's fault. Counted as
    // bad data, it dead-lettered every message a consumer took (seen on a
    // stock Debian, whose PostgreSQL asks for passwords).
    let options = sqlx::postgres::PgConnectOptions::from_str(&testkit::database_url())
        .unwrap()
        .username("reltest_no_such_role");
    let refused = sqlx::PgConnection::connect_with(&options)
        .await
        .expect_err("no such role");
    assert!(
        is_unavailable(&refused) && is_retryable_at_no_cost(&refused),
        "{refused}"
    );
    db.cleanup().await;
}
