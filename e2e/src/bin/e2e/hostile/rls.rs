//! The wall between tenants in PostgreSQL itself, and forged tokens.

use super::*;

/// The second wall (I7): every table with a `tenant_id` that a runtime role
/// (app or relay) may touch has row-level security enabled and forced, with
/// a policy (the archive and its partitions are owner-only: no grants); the
/// runtime role cannot bypass it; and a query that forgets its tenant sees
/// nothing.
pub(super) async fn rls_wall() -> anyhow::Result<Vec<String>> {
    let mut violations = vec![];
    for name in [
        "e2e_orders",
        "e2e_inventory",
        "e2e_payments",
        "e2e_projection",
    ] {
        let base = PgConnectOptions::from_str(&database_url())?.database(name);
        let app = db::pool(db::options_for_role(&base, db::APP_ROLE), 1).await?;
        let tables: Vec<(String, bool, bool, i64, bool, bool, bool)> = sqlx::query_as(
            "SELECT c.relname, c.relrowsecurity, c.relforcerowsecurity,
                    (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid),
                    has_table_privilege('commerce_app', c.oid, 'SELECT, INSERT, UPDATE, DELETE')
                    OR has_table_privilege('commerce_relay', c.oid, 'SELECT, INSERT, UPDATE, DELETE'),
                    has_table_privilege('commerce_app', c.oid, 'SELECT'),
                    has_table_privilege('commerce_relay', c.oid, 'SELECT')
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')
               AND EXISTS (SELECT 1 FROM pg_attribute a
                           WHERE a.attrelid = c.oid AND a.attname = 'tenant_id' AND NOT a.attisdropped)
             ORDER BY 1",
        )
        .fetch_all(&app)
        .await?;
        anyhow::ensure!(!tables.is_empty(), "{name}: no tenant tables found");
        for (table, enabled, forced, policies, reachable, app_reads, relay_reads) in &tables {
            if *reachable && (!(enabled & forced) || *policies == 0) {
                violations.push(format!(
                    "I7: {name}.{table}: rls enabled {enabled}, forced {forced}, {policies} policies"
                ));
            }
            // The relay is cross-tenant by design (ADR 0003), through a policy
            // of its own on the outbox tables and nothing else: the rows
            // and their DLQ, and the aggregates' counters it numbers ordered
            // events from (ADR 0028).
            if *relay_reads
                && !(table.starts_with("outbox_messages") || table == "outbox_sequences")
            {
                violations.push(format!("I7: {name}.{table}: commerce_relay may read it"));
            }
            if *app_reads {
                // No tenant set: the policy must let nothing through.
                let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*) FROM \"{table}\""
                )))
                .fetch_one(&app)
                .await?;
                if n != 0 {
                    violations.push(format!(
                        "I7: {name}.{table}: an unscoped query as commerce_app sees {n} rows"
                    ));
                }
            }
        }
        let (superuser, bypass): (bool, bool) = sqlx::query_as(
            "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user",
        )
        .fetch_one(&app)
        .await?;
        if superuser || bypass {
            violations.push(format!(
                "I7: the runtime role is superuser {superuser}, bypassrls {bypass}"
            ));
        }
        app.close().await;
    }
    Ok(violations)
}

pub(super) fn forged(secret: &[u8], claims: &Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(secret),
    )
    .expect("HS256 signing cannot fail")
}

pub(super) fn b64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
        }
    }
    out
}
