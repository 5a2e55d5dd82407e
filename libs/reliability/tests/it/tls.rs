//! sqlx is built with rustls: `sslmode=require` encrypts, `verify-ca`
//! checks the server's certificate against the root it is given.

use std::str::FromStr;

use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use testkit::database_url;

async fn server_cert() -> String {
    let mut admin = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let on: String = sqlx::query_scalar("SHOW ssl")
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        on, "on",
        "PostgreSQL has TLS off: run scripts/pg-tls.sh (make test does)"
    );
    sqlx::query_scalar("SHOW ssl_cert_file")
        .fetch_one(&mut admin)
        .await
        .unwrap()
}

#[tokio::test]
async fn connections_to_postgres_are_encrypted_and_verified_when_asked() {
    let cert = server_cert().await;
    let base = PgConnectOptions::from_str(&database_url()).unwrap();

    let mut conn = base
        .clone()
        .ssl_mode(PgSslMode::Require)
        .connect()
        .await
        .unwrap();
    let encrypted: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(encrypted, "sslmode=require gives an encrypted connection");

    let verified = base
        .clone()
        .ssl_mode(PgSslMode::VerifyCa)
        .ssl_root_cert(&cert)
        .connect()
        .await;
    assert!(
        verified.is_ok(),
        "the server's own certificate as root: {verified:?}"
    );

    // A root the server's certificate was not signed with.
    let dir = std::env::temp_dir().join(format!("tls-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let (key, crt) = (dir.join("k.pem"), dir.join("c.pem"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=other",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .output()
        .expect("openssl is installed (make deps)");
    assert!(made.status.success());
    let refused = base
        .ssl_mode(PgSslMode::VerifyCa)
        .ssl_root_cert(&crt)
        .connect()
        .await;
    assert!(
        refused.is_err(),
        "a server not signed by the given root is refused"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
