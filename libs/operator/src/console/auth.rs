//! Who may use the console, and proof that a POST came from its own page.
//!
//! One operator token (`CONSOLE_TOKEN`, or `_FILE`). A browser trades it
//! once at `/login` for a session cookie (HttpOnly, SameSite=Strict); a
//! script sends it as `Authorization: Bearer`. Every form carries a CSRF
//! token, and every POST without the right one is refused before it acts.
//! The cookie and the CSRF token are HMACs keyed by the operator token, so
//! the server keeps no session state and a new token ends every session.
//! Without a token (loopback only, `super::check_bind`), the key is random
//! per start: the CSRF check still holds.

use std::sync::Arc;

use axum::extract::{Form, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, KeyInit, Mac};
use serde::Deserialize;
use sha2::Sha256;

use super::{Console, pages};

type HmacSha256 = Hmac<Sha256>;

/// The session cookie's name.
pub const COOKIE: &str = "reliability_console";
/// The form field every POST carries.
pub const CSRF_FIELD: &str = "csrf";

pub struct Auth {
    token: Option<String>,
    key: Vec<u8>,
}

impl Auth {
    /// Every request must show `token`.
    pub fn token(token: &str) -> Self {
        Self {
            token: Some(token.to_owned()),
            key: token.as_bytes().to_vec(),
        }
    }

    /// Nobody is asked (loopback only): CSRF is keyed by a random key.
    pub fn none() -> Self {
        let key = [
            uuid::Uuid::new_v4().into_bytes(),
            uuid::Uuid::new_v4().into_bytes(),
        ]
        .concat();
        Self { token: None, key }
    }

    pub fn required(&self) -> bool {
        self.token.is_some()
    }

    fn mac(&self, purpose: &[u8]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        mac.update(purpose);
        mac
    }

    fn tag(&self, purpose: &[u8]) -> String {
        hex::encode(self.mac(purpose).finalize().into_bytes())
    }

    /// Whether `presented` (hex) is the tag of `purpose`, compared in
    /// constant time.
    fn verify(&self, purpose: &[u8], presented: &str) -> bool {
        hex::decode(presented).is_ok_and(|tag| self.mac(purpose).verify_slice(&tag).is_ok())
    }

    /// The token every form of this console carries.
    pub fn csrf(&self) -> String {
        self.tag(b"csrf")
    }

    pub fn csrf_ok(&self, presented: &str) -> bool {
        self.verify(b"csrf", presented)
    }

    /// Whether `presented` is the operator token, in constant time: both
    /// are MACed under the same key and the MACs compared.
    fn is_token(&self, presented: &str) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let expected = self.mac(token.as_bytes()).finalize().into_bytes();
        self.mac(presented.as_bytes())
            .verify_slice(&expected)
            .is_ok()
    }

    fn allows(&self, headers: &HeaderMap) -> bool {
        if !self.required() {
            return true;
        }
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if let Some(token) = bearer {
            return self.is_token(token);
        }
        cookie(headers, COOKIE).is_some_and(|c| self.verify(b"session", c))
    }
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The gate in front of every page and action: 401 with the login form
/// without the token; 403 for a POST without this console's CSRF token,
/// or any POST in read-only mode.
pub async fn require(
    State(console): State<Arc<Console>>,
    request: Request,
    next: Next,
) -> Response {
    if !console.auth.allows(request.headers()) {
        return (StatusCode::UNAUTHORIZED, pages::login_page(None)).into_response();
    }
    if request.method() == axum::http::Method::POST && console.read_only {
        return pages::refused(StatusCode::FORBIDDEN, "this console is read-only").into_response();
    }
    next.run(request).await
}

#[derive(Deserialize)]
pub struct Login {
    token: String,
}

pub async fn login_form() -> Response {
    pages::login_page(None).into_response()
}

/// Trades the token for the session cookie.
pub async fn login(State(console): State<Arc<Console>>, Form(login): Form<Login>) -> Response {
    if !console.auth.required() {
        return Redirect::to("/").into_response();
    }
    if !console.auth.is_token(&login.token) {
        return (
            StatusCode::UNAUTHORIZED,
            pages::login_page(Some("that is not the token")),
        )
            .into_response();
    }
    let cookie = format!(
        "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
        console.auth.tag(b"session")
    );
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_opens_and_anything_else_does_not() {
        let auth = Auth::token("s3cret");
        let mut headers = HeaderMap::new();
        assert!(!auth.allows(&headers));
        headers.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(auth.allows(&headers));
        headers.insert(header::AUTHORIZATION, "Bearer s3cre".parse().unwrap());
        assert!(!auth.allows(&headers));
        let mut headers = HeaderMap::new();
        let session = format!("a=b; {COOKIE}={}", auth.tag(b"session"));
        headers.insert(header::COOKIE, session.parse().unwrap());
        assert!(auth.allows(&headers));
        // Another token's session, or its CSRF token as a session: no.
        let other = Auth::token("other");
        assert!(!other.allows(&headers));
        let csrf_as_session = format!("{COOKIE}={}", auth.csrf());
        headers.insert(header::COOKIE, csrf_as_session.parse().unwrap());
        assert!(!auth.allows(&headers));
        assert!(auth.csrf_ok(&auth.csrf()) && !other.csrf_ok(&auth.csrf()));
        assert!(!auth.csrf_ok("") && !auth.csrf_ok("zz"));
    }
}
