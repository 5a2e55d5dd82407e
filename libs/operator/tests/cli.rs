//! The `reliability` binary: a command that deletes asks first, and
//! `--dry-run` changes nothing.

use std::process::{Command, Stdio};

use testkit::{TestDb, database_url};

/// The owner's URL as an operator gives it: the role's password where
/// PostgreSQL asks for one (`DB_ROLE_PASSWORD`, scram on a stock Debian),
/// never the superuser's.
fn owner_url(db: &TestDb) -> String {
    let mut url = reqwest::Url::parse(&database_url()).unwrap();
    url.set_path(&db.name);
    url.set_username(reliability::db::OWNER_ROLE).unwrap();
    let password = std::env::var(reliability::db::ROLE_PASSWORD_ENV).ok();
    url.set_password(password.as_deref().filter(|p| !p.is_empty()))
        .unwrap();
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

#[tokio::test]
async fn park_lists_a_parked_aggregate_skips_after_a_dry_run_and_asks_for_an_unpark() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "INSERT INTO parked_aggregates (tenant_id, consumer, source, aggregate_type, aggregate_id, error)
         VALUES (3, 'shop.orders', 'svc', 'order', '9', 'permanent: no such sku');
         INSERT INTO parked_events (tenant_id, consumer, source, aggregate_type, aggregate_id,
                                    message_id, aggregate_seq, event_type, envelope)
         VALUES (3, 'shop.orders', 'svc', 'order', '9', 41, 2, 'Shipped', '{\"payload\": {\"sku\": \"x\"}}'),
                (3, 'shop.orders', 'svc', 'order', '9', 44, 3, 'Delivered', '{}')",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    let out = cli(&db, &["--json", "park", "list"]);
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            &row["aggregate_id"],
            &row["waiting"],
            &row["first_message_id"],
            &row["error"]
        ),
        (
            &"9".into(),
            &2.into(),
            &41.into(),
            &"permanent: no such sku".into()
        )
    );
    let target = ["--consumer", "shop.orders", "--tenant", "3", "order:9"];

    let out = cli(&db, &[&["park", "skip", "--dry-run"][..], &target].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("message 41 (Shipped, number 2)"));
    let out = cli(&db, &[&["park", "skip"][..], &target].concat());
    assert!(!out.status.success(), "no --yes, no terminal: refused");
    let waiting = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM parked_events")
            .fetch_one(&db.owner)
            .await
            .unwrap()
    };
    assert_eq!(waiting().await, 2);

    let out = cli(&db, &[&["park", "skip", "--yes"][..], &target].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(waiting().await, 1);

    let out = cli(&db, &[&["park", "unpark", "--yes"][..], &target].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let requested: bool = sqlx::query_scalar(
        "SELECT release_requested_at IS NOT NULL FROM parked_aggregates WHERE aggregate_id = '9'",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    assert!(requested, "the consumer is asked to replay it");
    db.cleanup().await;
}

/// For cron and probes: `status --check` fails when something needs an
/// operator (here: a service database that does not answer), after showing
/// it as plain `status` does (which exits 0 whatever it lists).
#[test]
fn status_check_exits_non_zero_on_a_problem() {
    let out = Command::new(env!("CARGO_BIN_EXE_reliability"))
        .args(["status", "--services", "orders", "--check"])
        .env("ORDERS_DATABASE_URL", "postgres://127.0.0.1:1/orders")
        .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("orders: database unreachable"));
    assert!(String::from_utf8_lossy(&out.stderr).contains(" problem(s)"));
}

/// Docker's and Kubernetes' secrets are files: every variable `X` may be
/// given as `X_FILE` instead. Its value is used (here: the token verifies
/// with the secret in the file), the file's path and contents never show in
/// `--help`, and both set, or a file that cannot be read, is refused.
#[tokio::test]
async fn a_variable_may_come_from_the_file_its_file_twin_names() {
    let secret = "a-secret-kept-in-a-file-0123456789abcdef";
    let file = std::env::temp_dir().join(format!("jwt-{}", std::process::id()));
    std::fs::write(&file, format!("{secret}\n")).unwrap();
    let run = |args: &[&str], both: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_reliability"));
        cmd.args(args)
            .env_remove("JWT_SECRET")
            .env("JWT_SECRET_FILE", &file)
            .stdin(Stdio::null());
        if both {
            cmd.env("JWT_SECRET", "another");
        }
        cmd.output().unwrap()
    };
    let out = run(&["token", "--tenant", "3"], false);
    assert!(out.status.success(), "{out:?}");
    let token = String::from_utf8(out.stdout).unwrap();
    let keys = service_kit::auth::JwtKeys::from_secret(secret.as_bytes());
    assert_eq!(keys.verify(token.trim()).await.unwrap().get(), 3);

    let help = run(&["token", "--help"], false);
    assert!(!String::from_utf8_lossy(&help.stdout).contains(secret));

    let both = run(&["token", "--tenant", "3"], true);
    assert_eq!(both.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&both.stderr).contains("both set"));

    std::fs::remove_file(&file).unwrap();
    let gone = run(&["token", "--tenant", "3"], false);
    assert_eq!(gone.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&gone.stderr).contains("JWT_SECRET_FILE="));
}
