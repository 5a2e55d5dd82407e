//! Role passwords reach PostgreSQL as SCRAM verifiers, never as text: a
//! statement lands in the server's log with `log_statement = ddl`, or when
//! it fails.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use reliability::db::{self, scram};
use sqlx::Executor;
use testkit::{TestDb, unique};

const PASSWORD: &str = "correct horse battery staple";

async fn stored(db: &TestDb, role: &str) -> String {
    sqlx::query_scalar("SELECT rolpassword FROM pg_authid WHERE rolname = $1")
        .bind(role)
        .fetch_one(&db.admin)
        .await
        .unwrap()
}

/// The salt and iterations of a stored verifier.
fn salt_of(verifier: &str) -> (Vec<u8>, u32) {
    let rest = verifier
        .strip_prefix("SCRAM-SHA-256$")
        .expect("a SCRAM verifier");
    let (iterations, rest) = rest.split_once(':').unwrap();
    let salt = rest.split_once('$').unwrap().0;
    (STANDARD.decode(salt).unwrap(), iterations.parse().unwrap())
}

#[tokio::test]
async fn a_role_password_is_sent_as_the_verifier_postgresql_itself_computes() {
    let db = TestDb::new().await;
    let role = unique("scram_test_");
    db.admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE ROLE {role} LOGIN")))
        .await
        .unwrap();

    // PostgreSQL's own verifier of the password; ours, with its salt, is
    // the same string.
    let mut conn = db.admin.acquire().await.unwrap();
    conn.execute("SET password_encryption = 'scram-sha-256'")
        .await
        .unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!(
        "ALTER ROLE {role} PASSWORD '{PASSWORD}'"
    )))
    .await
    .unwrap();
    drop(conn);
    let theirs = stored(&db, &role).await;
    let (salt, iterations) = salt_of(&theirs);
    assert_eq!(scram::verifier(PASSWORD, &salt, iterations), theirs);

    // The statement the library sends carries the verifier, not the password.
    let verifier = scram::new_verifier(PASSWORD);
    let sql = db::alter_role_password(&db.admin, &role, &verifier)
        .await
        .unwrap();
    assert!(!sql.contains(PASSWORD), "{sql}");
    assert!(sql.contains(&verifier), "{sql}");
    db::set_role_password(&db.admin, &role, PASSWORD)
        .await
        .unwrap();
    let ours = stored(&db, &role).await;
    assert_ne!(ours, theirs, "a fresh salt");
    let (salt, iterations) = salt_of(&ours);
    assert_eq!((salt.len(), iterations), (16, 4096));
    assert_eq!(scram::verifier(PASSWORD, &salt, iterations), ours);

    db.admin
        .execute(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
        .await
        .unwrap();
    db.cleanup().await;
}
