//! Archival, partition upkeep and key cleanup touch only what they should.

use std::time::Duration;

use chrono::{Datelike, Months, Utc};
use testkit::TestDb;

const DAY: Duration = Duration::from_secs(24 * 3600);

#[tokio::test]
async fn archival_moves_only_processed_rows_older_than_the_cutoff_in_batches() {
    let db = TestDb::new().await;
    maintenance::ensure_archive_partitions(&db.owner, 1)
        .await
        .unwrap();
    // 5 old processed rows (some occurred months ago: default partition),
    // 2 recently processed, 3 old but still pending.
    sqlx::raw_sql(
        "INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload, occurred_at, processed_at)
         SELECT 1, 'a', 'old-' || g, 'E', '{}', now() - (g * 20 || ' days')::interval, now() - '8 days'::interval
         FROM generate_series(1, 5) g;
         INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload, processed_at)
         SELECT 2, 'a', 'recent-' || g, 'E', '{}', now() - '1 day'::interval FROM generate_series(1, 2) g;
         INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload, occurred_at)
         SELECT 1, 'a', 'pending-' || g, 'E', '{}', now() - '10 days'::interval FROM generate_series(1, 3) g;",
    )
    .execute(&db.owner)
    .await
    .unwrap();

    let moved = maintenance::archive_processed(&db.owner, 7 * DAY, 2)
        .await
        .unwrap();
    assert_eq!(moved, 5);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT aggregate_id FROM outbox_messages ORDER BY aggregate_id")
            .fetch_all(&db.owner)
            .await
            .unwrap();
    assert_eq!(
        left,
        [
            "pending-1",
            "pending-2",
            "pending-3",
            "recent-1",
            "recent-2"
        ]
    );
    let archived: Vec<String> = sqlx::query_scalar(
        "SELECT aggregate_id FROM outbox_messages_archive ORDER BY aggregate_id",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert_eq!(archived, ["old-1", "old-2", "old-3", "old-4", "old-5"]);
    db.cleanup().await;
}

#[tokio::test]
async fn archive_partitions_are_created_ahead_and_dropped_after_ninety_days() {
    let db = TestDb::new().await;
    let created = maintenance::ensure_archive_partitions(&db.owner, 3)
        .await
        .unwrap();
    assert_eq!(created.len(), 4, "this month and three ahead: {created:?}");
    assert!(
        maintenance::ensure_archive_partitions(&db.owner, 3)
            .await
            .unwrap()
            .is_empty(),
        "idempotent"
    );

    let this_month = Utc::now().date_naive().with_day(1).unwrap();
    for months_ago in [2u32, 5] {
        let start = this_month - Months::new(months_ago);
        let end = start + Months::new(1);
        let sql = format!(
            "CREATE TABLE outbox_messages_archive_y{:04}m{:02} PARTITION OF outbox_messages_archive FOR VALUES FROM ('{start}') TO ('{end}')",
            start.year(),
            start.month()
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&db.owner)
            .await
            .unwrap();
    }
    let dropped = maintenance::drop_old_archive_partitions(&db.owner, 90 * DAY)
        .await
        .unwrap();
    let five_ago = this_month - Months::new(5);
    assert_eq!(
        dropped,
        vec![format!(
            "outbox_messages_archive_y{:04}m{:02}",
            five_ago.year(),
            five_ago.month()
        )]
    );
    let remaining: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox_messages_archive'::regclass",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(
        remaining,
        4 + 1 + 1,
        "4 ahead, the 2-month-old one, and the default"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn expired_idempotency_keys_are_deleted_in_batches_and_live_ones_kept() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "INSERT INTO idempotency_keys (tenant_id, scope, key, request_hash, response_status, expires_at)
         SELECT 1 + g % 2, 'POST /x', 'expired-' || g, '\\x00', 201, now() - '1 minute'::interval FROM generate_series(1, 5) g;
         INSERT INTO idempotency_keys (tenant_id, scope, key, request_hash, response_status, expires_at)
         SELECT 1, 'POST /x', 'live-' || g, '\\x00', 201, now() + '1 hour'::interval FROM generate_series(1, 2) g;",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    assert_eq!(
        maintenance::delete_expired_idempotency_keys(&db.owner, 2)
            .await
            .unwrap(),
        5
    );
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
        .fetch_all(&db.owner)
        .await
        .unwrap();
    assert_eq!(left, ["live-1", "live-2"]);
    db.cleanup().await;
}

#[tokio::test]
async fn an_operator_can_show_and_purge_outbox_dlq_rows() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "INSERT INTO outbox_messages_dlq (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, occurred_at, attempts, last_error)
         SELECT g, 1, 'order', g::text, 'OrderPlaced', 1, jsonb_build_object('n', g), '{}', now(), 11, 'unroutable' FROM generate_series(1, 3) g",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let entry = operator::ops::outbox::show_dlq(&db.owner, 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((entry.payload["n"].as_i64(), entry.attempts), (Some(2), 11));
    assert!(
        operator::ops::outbox::show_dlq(&db.owner, 9)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        operator::ops::outbox::purge_dlq(&db.owner, Some(&[1, 9]))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        operator::ops::outbox::list_dlq(&db.owner, 10)
            .await
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        operator::ops::outbox::purge_dlq(&db.owner, None)
            .await
            .unwrap(),
        2
    );
    db.cleanup().await;
}

fn archive_row(occurred: &str) -> String {
    format!(
        "INSERT INTO outbox_messages_archive (id, tenant_id, aggregate_type, aggregate_id, event_type, event_version,
                                              payload, headers, occurred_at, available_at, processed_at, attempts)
         VALUES ((random() * 1e9)::bigint, 1, 'a', 'x', 'E', 1, '{{}}', '{{}}', {occurred}, now(), now(), 0)"
    )
}

#[tokio::test]
async fn the_default_partition_is_pruned_and_a_months_rows_move_into_its_new_partition() {
    let db = TestDb::new().await;
    // No monthly partition yet: every row lands in the default partition.
    for occurred in [
        "now() - interval '200 days'",
        "now() - interval '120 days'",
        "now() - interval '10 days'",
        "now()",
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(archive_row(occurred)))
            .execute(&db.owner)
            .await
            .unwrap();
    }
    let report = maintenance::run_once(&db.owner, &maintenance::MaintenanceConfig::default())
        .await
        .unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(
        report.default_partition_pruned, 2,
        "older than 90 days: gone"
    );
    let this_month: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_messages_archive_default WHERE occurred_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert_eq!(this_month, 0, "this month's rows moved into its partition");
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages_archive")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    assert_eq!(total, 2, "nothing younger than the retention lost");
    db.cleanup().await;
}

#[tokio::test]
async fn partitions_are_cut_at_utc_month_starts_and_secured_like_their_parent() {
    let db = TestDb::new().await;
    // A session in a far time zone must not shift the bounds.
    let owner = db.pool_as(reliability::db::OWNER_ROLE, 1).await;
    // One connection: the session setting stays with the pool.
    sqlx::query("SET timezone = 'Pacific/Kiritimati'")
        .execute(&owner)
        .await
        .unwrap();
    let zone: String = sqlx::query_scalar("SHOW timezone")
        .fetch_one(&owner)
        .await
        .unwrap();
    assert_eq!(zone, "Pacific/Kiritimati");
    let created = maintenance::ensure_archive_partitions(&owner, 1)
        .await
        .unwrap();
    let bound: String = sqlx::query_scalar(
        "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c WHERE relname = $1",
    )
    .bind(&created[0])
    .fetch_one(&owner)
    .await
    .unwrap();
    let month = Utc::now().date_naive().with_day(1).unwrap();
    // Shown in the session's zone (UTC+14): midnight UTC is 14:00 there.
    assert!(bound.contains(&format!("{month} 14:00:00+14")), "{bound}");

    for name in created
        .iter()
        .chain(["outbox_messages_archive_default".to_owned()].iter())
    {
        let (enabled, forced, policies): (bool, bool, i64) = sqlx::query_as(
            "SELECT relrowsecurity, relforcerowsecurity,
                    (SELECT count(*) FROM pg_policy WHERE polrelid = c.oid AND polname = 'tenant_isolation')
             FROM pg_class c WHERE relname = $1",
        )
        .bind(name)
        .fetch_one(&owner)
        .await
        .unwrap();
        assert_eq!((enabled, forced, policies), (true, true, 1), "{name}");
    }
    owner.close().await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_failing_step_does_not_keep_the_others_from_running() {
    let db = TestDb::new().await;
    // Another process created next month's table and has not attached it.
    let next = Utc::now().date_naive().with_day(1).unwrap() + Months::new(1);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE outbox_messages_archive_y{:04}m{:02} (x int)",
        next.year(),
        next.month()
    )))
    .execute(&db.owner)
    .await
    .unwrap();
    sqlx::raw_sql(
        "INSERT INTO idempotency_keys (tenant_id, scope, key, request_hash, response_status, expires_at)
         VALUES (1, 's', 'gone', 'h', 201, now() - interval '1 hour')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let report = maintenance::run_once(&db.owner, &maintenance::MaintenanceConfig::default())
        .await
        .unwrap();
    assert_eq!(
        report
            .errors
            .iter()
            .map(|(step, _)| step.as_str())
            .collect::<Vec<_>>(),
        ["partitions"]
    );
    assert_eq!(report.expired_keys_deleted, 1, "a later step still ran");
    // What `reliability status` shows: the failed step's error, the others' success.
    let runs = maintenance::last_runs(&db.owner).await.unwrap();
    let partitions = runs.iter().find(|r| r.step == "partitions").unwrap();
    assert!(partitions.last_success_at.is_none() && partitions.last_failure_at.is_some());
    assert!(partitions.last_error.is_some(), "{partitions:?}");
    let keys = runs.iter().find(|r| r.step == "idempotency_keys").unwrap();
    assert!(
        keys.last_success_at.is_some() && keys.last_failure_at.is_none(),
        "{keys:?}"
    );
    db.cleanup().await;
}
