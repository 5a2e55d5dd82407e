//! The log relay's needs in tests: a server that decodes its WAL
//! logically, and test databases whose replication slots go with them.

use std::time::{Duration, Instant};

use sqlx::PgPool;

/// Whether the server decodes its WAL logically (`wal_level = logical`),
/// which the log relay's tests need; `false` after saying why they are
/// skipped. Panics under `LOG_RELAY_TESTS=required` (CI, whose server
/// `.ci/run` sets so).
pub async fn logical_decoding(admin: &PgPool) -> bool {
    let level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(admin)
        .await
        .expect("the server answers");
    if level == "logical" {
        return true;
    }
    crate::skipped(
        "LOG_RELAY_TESTS",
        &format!("wal_level is {level}, not logical"),
        ".ci/run sets it",
    )
}

/// Drops `database`'s replication slots, ending their readers first: a
/// database with a slot cannot be dropped.
pub(crate) async fn drop_slots(admin: &PgPool, database: &str) {
    let _ = sqlx::query(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
         WHERE database = $1 AND active_pid IS NOT NULL",
    )
    .bind(database)
    .execute(admin)
    .await;
    // A terminated reader lets go of its slot a moment later.
    let slots_left = || async {
        let _ = sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE database = $1 AND NOT active",
        )
        .bind(database)
        .execute(admin)
        .await;
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_replication_slots WHERE database = $1",
        )
        .bind(database)
        .fetch_one(admin)
        .await
        .unwrap_or(0)
    };
    let until = Instant::now() + Duration::from_secs(5);
    while slots_left().await > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
