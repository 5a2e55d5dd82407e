//! I7: row-level security is a second wall that holds even when a query
//! forgets its `WHERE tenant_id`.

use reliability::TenantTx;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, SqlSafeStr};
use testkit::TestDb;

use crate::support::{enqueue_added, tenant};

async fn seed_two_tenants(db: &TestDb) {
    enqueue_added(db, 1, "a-1", 10).await;
    enqueue_added(db, 1, "a-2", 20).await;
    enqueue_added(db, 2, "b-1", 30).await;
}

#[tokio::test]
async fn a_tenant_sees_only_its_own_rows_even_without_a_tenant_filter() {
    let db = TestDb::new().await;
    seed_two_tenants(&db).await;

    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    let tenants: Vec<i64> = sqlx::query_scalar("SELECT tenant_id FROM outbox_messages")
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(tenants, vec![1, 1]);
    // Nor can it change what it cannot see.
    let touched = sqlx::query("UPDATE idempotency_keys SET key = key")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(touched.rows_affected(), 0);
    drop(tx);

    let mut tx = TenantTx::begin(&db.app, tenant(2)).await.unwrap();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(count, 1);
    drop(tx);
    db.cleanup().await;
}

#[tokio::test]
async fn no_tenant_set_sees_nothing_even_on_a_connection_that_served_a_tenant() {
    let db = TestDb::new().await;
    seed_two_tenants(&db).await;
    // One connection, so the second query runs where tenant 1 was set before.
    let opts = db.app.connect_options().as_ref().clone();
    let single = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .unwrap();

    let fresh: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&single)
        .await
        .unwrap();
    assert_eq!(
        fresh, 0,
        "a fresh connection with no tenant must see nothing"
    );

    let tx = TenantTx::begin(&single, tenant(1)).await.unwrap();
    tx.commit().await.unwrap();
    let reused: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&single)
        .await
        .unwrap();
    assert_eq!(reused, 0, "the tenant must not outlive its transaction");
    single.close().await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_tenant_cannot_write_rows_of_another_tenant() {
    let db = TestDb::new().await;
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    let err = sqlx::query(
        "INSERT INTO outbox_messages (tenant_id, aggregate_type, aggregate_id, event_type, payload)
         VALUES (2, 'x', '1', 'Forged', '{}')",
    )
    .execute(&mut *tx)
    .await
    .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("42501"),
        "{err}"
    );
    drop(tx);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    db.cleanup().await;
}

#[tokio::test]
async fn the_app_role_cannot_switch_row_level_security_off() {
    let db = TestDb::new().await;
    seed_two_tenants(&db).await;
    let mut conn = db.app.acquire().await.unwrap();

    let bypass: bool = sqlx::query_scalar(
        "SELECT rolbypassrls OR rolsuper FROM pg_roles WHERE rolname = current_user",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert!(!bypass);
    for sql in [
        "ALTER TABLE outbox_messages DISABLE ROW LEVEL SECURITY",
        "ALTER TABLE outbox_messages NO FORCE ROW LEVEL SECURITY",
        "DROP POLICY tenant_isolation ON outbox_messages",
    ] {
        let err = conn.execute(sql).await.unwrap_err();
        assert_eq!(
            err.as_database_error().unwrap().code().as_deref(),
            Some("42501"),
            "{sql}: {err}"
        );
    }
    // With row_security off, a query that RLS would filter errors out
    // instead of returning everything.
    conn.execute("SET row_security = off").await.unwrap();
    let err = conn
        .execute("SELECT * FROM outbox_messages")
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("42501"),
        "{err}"
    );
    drop(conn);

    // The catalog agrees: every reliability table has RLS enabled and forced.
    let unprotected: Vec<String> = sqlx::query_scalar(
        "SELECT relname::text FROM pg_class
         WHERE relname IN ('outbox_messages', 'outbox_messages_dlq', 'outbox_messages_archive',
                           'idempotency_keys', 'processed_messages', 'consumer_offsets')
           AND NOT (relrowsecurity AND relforcerowsecurity)",
    )
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert!(
        unprotected.is_empty(),
        "tables without forced RLS: {unprotected:?}"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn the_relay_role_reads_every_tenants_outbox_and_nothing_else() {
    let db = TestDb::new().await;
    seed_two_tenants(&db).await;
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&db.relay)
        .await
        .unwrap();
    assert_eq!(all, 3);
    for table in [
        "idempotency_keys",
        "processed_messages",
        "consumer_offsets",
        "outbox_messages_archive",
        "aggregate_positions",
        "parked_aggregates",
        "parked_events",
    ] {
        let sql = format!("SELECT count(*) FROM {table}");
        let err = db
            .relay
            .fetch_one(sqlx::AssertSqlSafe(sql))
            .await
            .unwrap_err();
        assert_eq!(
            err.as_database_error().unwrap().code().as_deref(),
            Some("42501"),
            "{table}: {err}"
        );
    }
    db.cleanup().await;
}

#[tokio::test]
async fn setup_migrations_run_again_on_a_database_a_service_has_migrated() {
    let mut service =
        sqlx::migrate::Migrator::with_migrations(vec![sqlx::migrate::Migration::new(
            1001,
            "service table".into(),
            sqlx::migrate::MigrationType::Simple,
            sqlx::AssertSqlSafe("CREATE TABLE service_thing (id int)").into_sql_str(),
            false,
        )]);
    service.set_locking(true);
    let db = TestDb::with_migrations(&service).await;
    reliability::db::migrate(&db.owner, None).await.unwrap();
    reliability::db::migrate(&db.owner, Some(&service))
        .await
        .unwrap();
    db.cleanup().await;
}

#[tokio::test]
async fn the_relay_cannot_rewrite_an_event_and_the_runtime_cannot_delete_a_key() {
    let db = TestDb::new().await;
    seed_two_tenants(&db).await;
    let denied = |r: Result<sqlx::postgres::PgQueryResult, sqlx::Error>| {
        r.unwrap_err()
            .as_database_error()
            .and_then(|e| e.code().map(|c| c.into_owned()))
    };
    for sql in [
        "UPDATE outbox_messages SET payload = '{}'",
        "UPDATE outbox_messages SET tenant_id = 2",
        "UPDATE outbox_messages SET event_type = 'Forged'",
    ] {
        let r = sqlx::query(sql).execute(&db.relay).await;
        assert_eq!(denied(r), Some("42501".into()), "{sql}");
    }
    // Its own bookkeeping it may change.
    sqlx::query(
        "UPDATE outbox_messages SET attempts = attempts, last_error = NULL, available_at = now()",
    )
    .execute(&db.relay)
    .await
    .unwrap();
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    let r = sqlx::query("DELETE FROM idempotency_keys")
        .execute(&mut *tx)
        .await;
    assert_eq!(denied(r), Some("42501".into()));
    drop(tx);
    db.cleanup().await;
}
