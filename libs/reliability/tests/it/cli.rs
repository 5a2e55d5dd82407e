//! The `reliability` binary: a command that deletes asks first, and
//! `--dry-run` changes nothing.

use std::process::{Command, Stdio};

use reliability::testing::{TestDb, database_url};

fn owner_url(db: &TestDb) -> String {
    let mut url = reqwest::Url::parse(&database_url()).unwrap();
    url.set_path(&db.name);
    url.set_username(reliability::db::OWNER_ROLE).unwrap();
    url.set_password(None).unwrap();
    url.to_string()
}

async fn dlq_rows(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_messages_dlq")
        .fetch_one(&db.owner)
        .await
        .unwrap()
}

fn cli(db: &TestDb, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_reliability"))
        .args(args)
        .args(["--database-url", &owner_url(db)])
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[tokio::test]
async fn a_purge_without_yes_or_with_dry_run_deletes_nothing_and_with_yes_deletes() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "INSERT INTO outbox_messages_dlq (id, tenant_id, aggregate_type, aggregate_id, event_type,
                                          event_version, payload, headers, occurred_at, attempts)
         VALUES (1, 1, 'a', '1', 'E', 1, '{}', '{}', now(), 10),
                (2, 1, 'a', '2', 'E', 1, '{}', '{}', now(), 10)",
    )
    .execute(&db.owner)
    .await
    .unwrap();

    // No terminal to ask on and no --yes: refused.
    let out = cli(&db, &["outbox", "dlq", "purge", "--all"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("pass --yes"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(dlq_rows(&db).await, 2);

    let out = cli(
        &db,
        &["--json", "outbox", "dlq", "purge", "--all", "--dry-run"],
    );
    assert!(out.status.success());
    let done: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&done["matched"], &done["changed"], &done["dry_run"]),
        (&2.into(), &0.into(), &true.into())
    );
    assert_eq!(dlq_rows(&db).await, 2);

    let out = cli(&db, &["outbox", "dlq", "purge", "1", "--yes"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(dlq_rows(&db).await, 1);

    // Reading needs no confirmation; --json is one object per line.
    let out = cli(&db, &["--json", "outbox", "status"]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["dlq"], 1);
    db.cleanup().await;
}

#[test]
fn help_names_the_variables_it_reads_but_never_their_values() {
    let secret = "s3cret-in-the-environment";
    for args in [&["--help"][..], &["setup", "--help"], &["token", "--help"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_reliability"))
            .args(args)
            .env("JWT_SECRET", secret)
            .env("AMQP_URL", format!("amqp://u:{secret}@127.0.0.1:1/%2f"))
            .env(
                "ADMIN_DATABASE_URL",
                format!("postgres://u:{secret}@127.0.0.1:1/db"),
            )
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {help}");
        assert!(!help.contains(secret), "{args:?} printed a secret:\n{help}");
    }
}
