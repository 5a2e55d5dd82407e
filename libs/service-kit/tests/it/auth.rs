//! Tokens: lifetimes, issuer and audience, and keys of an identity provider
//! (RS256 and ES256 from a JWKS file or URL, rotated), each refused the way
//! an attacker would try.

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::get;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reliability::TenantId;
use serde_json::{Value, json};
use service_kit::auth::{AuthSettings, JwtKeys};

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A private key made by the `openssl` CLI, as DER: PKCS#1 for RSA, PKCS#8
/// for EC (what jsonwebtoken's signers read).
fn openssl_key(alg: Algorithm) -> EncodingKey {
    let dir = std::env::temp_dir().join(format!("jwt-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let pem = dir.join("key.pem");
    let der = dir.join("key.der");
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl is installed (make deps)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let (pem_s, der_s) = (pem.to_str().unwrap(), der.to_str().unwrap());
    let key = match alg {
        Algorithm::RS256 => {
            run(&[
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-out",
                pem_s,
            ]);
            run(&[
                "rsa",
                "-in",
                pem_s,
                "-traditional",
                "-outform",
                "DER",
                "-out",
                der_s,
            ]);
            EncodingKey::from_rsa_der(&std::fs::read(&der).unwrap())
        }
        Algorithm::ES256 => {
            run(&[
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
                pem_s,
            ]);
            run(&[
                "pkcs8", "-topk8", "-nocrypt", "-in", pem_s, "-outform", "DER", "-out", der_s,
            ]);
            EncodingKey::from_ec_der(&std::fs::read(&der).unwrap())
        }
        other => panic!("no test key for {other:?}"),
    };
    std::fs::remove_dir_all(&dir).unwrap();
    key
}

/// A signing key of the "identity provider" and its public JWK.
struct IdpKey {
    alg: Algorithm,
    kid: String,
    key: EncodingKey,
}

impl IdpKey {
    fn new(alg: Algorithm, kid: &str) -> Self {
        Self {
            alg,
            kid: kid.to_owned(),
            key: openssl_key(alg),
        }
    }

    fn jwk(&self) -> Jwk {
        let mut jwk = Jwk::from_encoding_key(&self.key, self.alg).unwrap();
        jwk.common.key_id = Some(self.kid.clone());
        jwk
    }

    fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.key).unwrap()
    }
}

fn claims(tenant: i64) -> Value {
    json!({"tenant_id": tenant, "exp": now() + 600})
}

async fn verify(keys: &JwtKeys, token: &str) -> Option<i64> {
    keys.verify(token).await.ok().map(TenantId::get)
}

#[tokio::test]
async fn hs256_tokens_need_a_bounded_exp_and_honour_nbf_iss_and_aud() {
    let secret = "s".repeat(32);
    let sign = |claims: &Value| {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    };
    let settings = AuthSettings {
        jwt_secret: Some(secret.as_str().into()),
        jwt_max_lifetime_secs: 3600,
        ..AuthSettings::default()
    };
    let keys = settings.load("0.0.0.0").await.unwrap();
    assert_eq!(verify(&keys, &sign(&claims(7))).await, Some(7));
    assert_eq!(
        verify(
            &keys,
            &keys.mint(TenantId::new(7).unwrap(), Duration::from_secs(60))
        )
        .await,
        Some(7)
    );
    let t = now();
    for (why, bad) in [
        ("no exp", json!({"tenant_id": 7})),
        ("expired", json!({"tenant_id": 7, "exp": t - 1})),
        (
            "not yet valid",
            json!({"tenant_id": 7, "exp": t + 600, "nbf": t + 300}),
        ),
        (
            "lives longer than the maximum",
            json!({"tenant_id": 7, "exp": t + 7200}),
        ),
        ("tenant 0", json!({"tenant_id": 0, "exp": t + 600})),
        (
            "tenant as a string",
            json!({"tenant_id": "7", "exp": t + 600}),
        ),
    ] {
        assert_eq!(verify(&keys, &sign(&bad)).await, None, "{why}");
    }
    assert_eq!(
        verify(
            &keys,
            &sign(&json!({"tenant_id": 7, "exp": t + 600, "nbf": t - 1}))
        )
        .await,
        Some(7),
        "nbf in the past is fine"
    );

    let strict = AuthSettings {
        jwt_secret: Some(secret.as_str().into()),
        jwt_issuer: Some("https://idp.example".into()),
        jwt_audience: Some("commerce".into()),
        ..AuthSettings::default()
    }
    .load("127.0.0.1")
    .await
    .unwrap();
    let good = json!({"tenant_id": 7, "exp": t + 600, "iss": "https://idp.example", "aud": ["other", "commerce"]});
    assert_eq!(verify(&strict, &sign(&good)).await, Some(7));
    assert_eq!(
        verify(&strict, &sign(&claims(7))).await,
        None,
        "iss and aud are required once configured"
    );
    let mut wrong_iss = good.clone();
    wrong_iss["iss"] = json!("https://evil.example");
    assert_eq!(verify(&strict, &sign(&wrong_iss)).await, None);
    let mut wrong_aud = good.clone();
    wrong_aud["aud"] = json!("billing");
    assert_eq!(verify(&strict, &sign(&wrong_aud)).await, None);
    // What the stack mints carries the configured claims.
    assert_eq!(
        verify(
            &strict,
            &strict.mint(TenantId::new(7).unwrap(), Duration::from_secs(60))
        )
        .await,
        Some(7)
    );
}

#[tokio::test]
async fn a_service_refuses_the_development_secret_off_loopback() {
    let err = AuthSettings::default()
        .load("0.0.0.0")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("JWT_SECRET") && err.contains("BIND_ADDRESS=127.0.0.1"),
        "{err}"
    );
    let short = AuthSettings {
        jwt_secret: Some("short-secret".into()),
        ..AuthSettings::default()
    };
    assert!(short.load("0.0.0.0").await.is_err());
    assert!(AuthSettings::default().load("127.0.0.1").await.is_ok());
}

#[tokio::test]
async fn rs256_and_es256_tokens_verify_against_a_jwks_file_and_nothing_else_does() {
    let rsa = IdpKey::new(Algorithm::RS256, "rsa-1");
    let ec = IdpKey::new(Algorithm::ES256, "ec-1");
    let path = std::env::temp_dir().join(format!("jwks-{}.json", uuid::Uuid::new_v4()));
    let set = JwkSet {
        keys: vec![rsa.jwk(), ec.jwk()],
    };
    std::fs::write(&path, serde_json::to_vec(&set).unwrap()).unwrap();
    let keys = AuthSettings {
        jwt_jwks: Some(path.to_str().unwrap().to_owned()),
        ..AuthSettings::default()
    }
    .load("0.0.0.0")
    .await
    .expect("an identity provider's keys replace the development secret");
    assert_eq!(verify(&keys, &rsa.sign(&claims(3))).await, Some(3));
    assert_eq!(verify(&keys, &ec.sign(&claims(4))).await, Some(4));

    // HS256 is off when only the key set is configured, whatever secret
    // signs it (the development one included).
    let dev = JwtKeys::from_secret(service_kit::auth::DEV_SECRET.as_bytes());
    assert_eq!(
        verify(
            &keys,
            &dev.mint(TenantId::new(3).unwrap(), Duration::from_secs(60))
        )
        .await,
        None
    );
    // A key of another provider with a known kid.
    let impostor = IdpKey::new(Algorithm::ES256, "ec-1");
    assert_eq!(verify(&keys, &impostor.sign(&claims(4))).await, None);
    // A kid that names a key of the other algorithm.
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some("rsa-1".into());
    let confused = jsonwebtoken::encode(&header, &claims(4), &ec.key).unwrap();
    assert_eq!(verify(&keys, &confused).await, None);
    // No kid.
    let no_kid =
        jsonwebtoken::encode(&Header::new(Algorithm::RS256), &claims(3), &rsa.key).unwrap();
    assert_eq!(verify(&keys, &no_kid).await, None);
    // Expiry rules hold for these tokens too.
    assert_eq!(
        verify(&keys, &rsa.sign(&json!({"tenant_id": 3, "exp": now() - 1}))).await,
        None
    );
    std::fs::remove_file(&path).unwrap();
}

/// An identity provider serving `published` at its JWKS URL: the URL, and
/// how many times the set was fetched.
async fn serve_jwks(published: Arc<Mutex<JwkSet>>) -> (String, Arc<Mutex<usize>>) {
    let fetches = Arc::new(Mutex::new(0));
    let app = {
        let fetches = fetches.clone();
        Router::new().route(
            "/jwks.json",
            get(move || {
                *fetches.lock().unwrap() += 1;
                let body = serde_json::to_string(&*published.lock().unwrap()).unwrap();
                std::future::ready(body)
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, fetches)
}

#[tokio::test]
async fn a_rotated_key_is_fetched_from_the_jwks_url_when_its_kid_first_appears() {
    let old = IdpKey::new(Algorithm::ES256, "2026-01");
    let new = IdpKey::new(Algorithm::RS256, "2026-02");
    let published = Arc::new(Mutex::new(JwkSet {
        keys: vec![old.jwk()],
    }));
    let (url, fetches) = serve_jwks(published.clone()).await;

    let keys = AuthSettings {
        jwt_jwks: Some(url),
        ..AuthSettings::default()
    }
    .load("0.0.0.0")
    .await
    .unwrap();
    assert_eq!(verify(&keys, &old.sign(&claims(5))).await, Some(5));
    assert_eq!(*fetches.lock().unwrap(), 1, "known kids need no fetch");

    published.lock().unwrap().keys.push(new.jwk());
    assert_eq!(
        verify(&keys, &new.sign(&claims(6))).await,
        Some(6),
        "fetched on first sight"
    );
    assert_eq!(*fetches.lock().unwrap(), 2);
    // Junk kids do not turn every request into a fetch.
    let stranger = IdpKey::new(Algorithm::ES256, "unknown");
    for _ in 0..5 {
        assert_eq!(verify(&keys, &stranger.sign(&claims(6))).await, None);
    }
    assert_eq!(
        *fetches.lock().unwrap(),
        2,
        "at most one fetch per interval"
    );
}

/// A fetch that brings no usable key (an identity provider's set emptied
/// by mistake, or keys we cannot read) keeps the last good set: replacing
/// it would refuse every token until the next good answer.
#[tokio::test]
async fn an_empty_key_set_keeps_the_last_good_one() {
    let key = IdpKey::new(Algorithm::ES256, "2026-03");
    let published = Arc::new(Mutex::new(JwkSet {
        keys: vec![key.jwk()],
    }));
    let (url, fetches) = serve_jwks(published.clone()).await;
    let keys = AuthSettings {
        jwt_jwks: Some(url),
        ..AuthSettings::default()
    }
    .load("0.0.0.0")
    .await
    .unwrap();
    assert_eq!(verify(&keys, &key.sign(&claims(7))).await, Some(7));

    published.lock().unwrap().keys.clear();
    let stranger = IdpKey::new(Algorithm::ES256, "unknown");
    assert_eq!(verify(&keys, &stranger.sign(&claims(7))).await, None);
    assert_eq!(
        *fetches.lock().unwrap(),
        2,
        "the unknown kid fetched the set"
    );
    assert_eq!(
        verify(&keys, &key.sign(&claims(8))).await,
        Some(8),
        "the empty answer replaced nothing"
    );
}
