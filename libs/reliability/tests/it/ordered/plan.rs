//! The gate's cost stays one look-up per aggregate whatever the planner
//! knows: a new deployment's tables are not analyzed yet.

use super::*;

/// A tenant with 20 000 positions that no ANALYZE has counted (autovacuum
/// off for the test). Were the positions joined, the planner would read
/// all of the tenant's (a bitmap scan on the key's first columns, then a
/// filter), on every apply: seen at 3 ms a statement where it should be a
/// tenth of that, and growing with the tenant's aggregates.
#[tokio::test]
async fn the_gate_reads_each_position_by_its_whole_key_on_tables_never_analyzed() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "ALTER TABLE aggregate_positions SET (autovacuum_enabled = false);
         ALTER TABLE parked_aggregates SET (autovacuum_enabled = false);
         INSERT INTO aggregate_positions (tenant_id, consumer, source, aggregate_type, aggregate_id, last_seq)
         SELECT 1, 'c', 'svc', 'order', g::text, 1 FROM generate_series(1, 20000) g;",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let mut tx = TenantTx::begin(&db.app, tenant(1)).await.unwrap();
    let explain = |sql: &str| format!("EXPLAIN {sql}");
    let gate: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain(consumer::GATE_SQL)))
        .bind(1_i64)
        .bind("c")
        .bind(vec!["svc"])
        .bind(vec![7_i64])
        .bind(0_i16)
        .bind(vec!["order"])
        .bind(vec!["42"])
        .bind(vec![Some(2_i64)])
        .bind(vec![true])
        // Whole: the position's look-up before a new aggregate's insert
        // is read too.
        .bind(true)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let state: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain(consumer::STATE_SQL)))
        .bind(1_i64)
        .bind("c")
        .bind(vec!["svc"])
        .bind(vec!["order"])
        .bind(vec!["42"])
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // The gate touches a position through its upsert (whose arbiter is
    // the key's index) and, for a whole subscription, a look-up by index;
    // it reads the parked store by index.
    let gate = gate.join("\n");
    let reads: Vec<&str> = gate
        .lines()
        .filter(|l| l.contains(" on aggregate_positions") || l.contains(" on parked_aggregates"))
        .filter(|l| !l.contains("Insert"))
        .collect();
    // The parked store is read at all (an empty list would pass the loop).
    assert!(
        reads.iter().any(|l| l.contains(" on parked_aggregates")),
        "{gate}"
    );
    for read in reads {
        assert!(read.contains("Index"), "a scan in the gate:\n{gate}");
    }
    let state = state.join("\n");
    let reads: Vec<&str> = state
        .lines()
        .filter(|l| l.contains(" on aggregate_positions"))
        .collect();
    assert!(!reads.is_empty(), "{state}");
    for read in reads {
        assert!(
            read.contains("Index"),
            "a position read by a scan:\n{state}"
        );
    }
    let key = state
        .lines()
        .skip_while(|l| !l.contains("Index Scan using aggregate_positions_pkey"))
        .nth(1)
        .unwrap_or_default();
    assert!(
        key.contains("aggregate_id ="),
        "not on the whole key:\n{state}"
    );
    db.cleanup().await;
}
