//! A SCRAM-SHA-256 verifier for `ALTER ROLE … PASSWORD`, computed here as
//! `psql`'s `\password` does (RFC 5802, RFC 7677; PostgreSQL's
//! `scram_build_secret`), so the password itself never reaches the server:
//! a statement is written to the server's log with `log_statement = ddl`,
//! or when it fails, and a verifier there reveals no password.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

/// PostgreSQL's default (`scram_iterations`).
const ITERATIONS: u32 = 4096;

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`, the form
/// PostgreSQL stores in `pg_authid.rolpassword`, for `password` and `salt`.
/// The password is used as its bytes: PostgreSQL's SASLprep leaves an ASCII
/// password as it is (and uses the raw bytes of one it cannot prepare).
pub fn verifier(password: &str, salt: &[u8], iterations: u32) -> String {
    // Hi(): PBKDF2 with HMAC-SHA-256, one block (the key is 32 bytes).
    let mut u = hmac(password.as_bytes(), &[salt, &1u32.to_be_bytes()].concat());
    let mut salted = u;
    for _ in 1..iterations {
        u = hmac(password.as_bytes(), &u);
        for (s, b) in salted.iter_mut().zip(u) {
            *s ^= b;
        }
    }
    let stored_key = Sha256::digest(hmac(&salted, b"Client Key"));
    let server_key = hmac(&salted, b"Server Key");
    format!(
        "SCRAM-SHA-256${iterations}:{}${}:{}",
        STANDARD.encode(salt),
        STANDARD.encode(stored_key),
        STANDARD.encode(server_key)
    )
}

/// A verifier for `password` with a fresh 16-byte salt (PostgreSQL's
/// length). A salt needs to be unique, not secret: a v4 UUID's random
/// bytes, from the operating system's generator.
pub fn new_verifier(password: &str) -> String {
    verifier(password, uuid::Uuid::new_v4().as_bytes(), ITERATIONS)
}
