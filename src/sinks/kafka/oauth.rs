//! OAUTHBEARER access tokens from an OIDC token endpoint (OAuth 2 client credentials grant,
//! RFC 6749 §4.4), fetched in Rust for librdkafka's token-refresh callback.
//!
//! librdkafka's own OIDC support needs its `curl` feature and a libcurl in the image, which the
//! distroless image lacks; so librdkafka asks the client context for a token
//! ([`super::client::KafkaContext`]), and this module answers with an HTTP POST through hyper
//! and rustls (the client kube's API connections use, with the system's root certificates).
//!
//! # Contract
//! - A token is fetched at start, before any client connects, so that a token endpoint that
//!   refuses or cannot be reached fails the start naming the sink; afterwards whenever
//!   librdkafka asks (at 80 % of the token's lifetime). A token younger than half its lifetime
//!   is handed out again instead of being fetched anew (the sink's clients start together).
//! - Neither the client secret nor a token appears in an error, a log line or `Debug`. What the
//!   endpoint says in a refusal is reported only through RFC 6749's `error` and
//!   `error_description` fields.
//!
//! # Recovery
//! A refresh that fails is reported to librdkafka (`rd_kafka_oauthbearer_set_token_failure`),
//! which logs it and asks again after 10 s; the token in use stays valid until it expires.

use std::{
    sync::Mutex,
    time::{Duration, Instant, SystemTime},
};

use base64::Engine as _;
use http_body_util::{BodyExt, Full};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Deserialize;

use super::config::{KafkaSaslConfig, check_token_endpoint};

/// How long a token request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest answer read from the token endpoint.
const MAX_ANSWER: usize = 64 * 1024;

/// `application/x-www-form-urlencoded` escaping: everything but the unreserved characters.
const FORM: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// A token as librdkafka wants it: the JWT, the principal it names, and when it expires.
#[derive(Clone)]
pub struct Token {
    /// The access token (a JWT for Kafka's validators).
    pub value: String,
    /// The token's `sub` claim, else the client id (librdkafka uses it in its logs).
    pub principal: String,
    /// When it expires, in milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
    /// When it was fetched, and for how long it is valid from then.
    fetched: Instant,
    lifetime: Duration,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token")
            .field("principal", &self.principal)
            .field("expires_at_ms", &self.expires_at_ms)
            .finish_non_exhaustive()
    }
}

/// The OIDC client credentials of one sink, and its newest token. See the module docs.
pub struct OAuthTokenSource {
    endpoint: http::Uri,
    client_id: String,
    client_secret: String,
    scope: Option<String>,
    newest: Mutex<Option<Token>>,
}

impl std::fmt::Debug for OAuthTokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthTokenSource")
            .field("endpoint", &self.endpoint)
            .field("client_id", &self.client_id)
            .finish_non_exhaustive()
    }
}

/// What a token endpoint answers on success (RFC 6749 §5.1).
#[derive(Deserialize)]
struct Answer {
    access_token: String,
    #[serde(default, deserialize_with = "seconds")]
    expires_in: Option<u64>,
}

/// `expires_in` as a number, or as a string of digits (as some providers send it).
fn seconds<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Seconds {
        Number(u64),
        Text(String),
    }
    match Option::<Seconds>::deserialize(d)? {
        None => Ok(None),
        Some(Seconds::Number(n)) => Ok(Some(n)),
        Some(Seconds::Text(t)) => t
            .parse()
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("expires_in {t:?} is not a number"))),
    }
}

/// What it answers on refusal (RFC 6749 §5.2).
#[derive(Deserialize)]
struct Refusal {
    error: String,
    #[serde(default)]
    error_description: Option<String>,
}

/// The claims of a JWT this module reads.
#[derive(Deserialize)]
struct Claims {
    #[serde(default)]
    sub: Option<String>,
    #[serde(default)]
    exp: Option<i64>,
}

impl OAuthTokenSource {
    /// The source an `OAUTHBEARER` SASL section describes; reads the client secret. Errors
    /// name the field, never the secret.
    pub fn new(sasl: &KafkaSaslConfig) -> Result<Self, String> {
        let missing = |field: &str| format!("sasl.{field}: required with mechanism OAUTHBEARER");
        let endpoint = sasl
            .token_endpoint
            .as_deref()
            .ok_or_else(|| missing("token_endpoint"))?;
        let endpoint =
            check_token_endpoint(endpoint).map_err(|e| format!("sasl.token_endpoint: {e}"))?;
        let client_secret = sasl
            .client_secret
            .as_ref()
            .ok_or_else(|| missing("client_secret"))?
            .resolve()
            .map_err(|e| format!("sasl.client_secret: {e}"))?;
        Ok(Self {
            endpoint,
            client_id: sasl.client_id.clone().ok_or_else(|| missing("client_id"))?,
            client_secret,
            scope: sasl.scope.clone(),
            newest: Mutex::new(None),
        })
    }

    /// The token endpoint, for messages.
    pub fn endpoint(&self) -> &http::Uri {
        &self.endpoint
    }

    /// A valid token: the newest one while it is younger than half its lifetime, else a new
    /// one from the endpoint. Blocks for up to the request timeout (call it off the async
    /// threads); the HTTP exchange runs on a thread of its own with its own runtime, so any
    /// thread may call it, librdkafka's included.
    pub fn token(&self) -> Result<Token, String> {
        if let Some(t) = self.newest.lock().unwrap().as_ref()
            && t.fetched.elapsed() < t.lifetime / 2
        {
            return Ok(t.clone());
        }
        let token = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("oauth-token".into())
                .spawn_scoped(scope, || self.fetch_blocking())
                .map_err(|e| format!("cannot start the token request: {e}"))?
                .join()
                .unwrap_or_else(|_| Err("the token request panicked".into()))
        })
        .map_err(|e| format!("OAUTHBEARER token from {}: {e}", self.endpoint))?;
        *self.newest.lock().unwrap() = Some(token.clone());
        Ok(token)
    }

    fn fetch_blocking(&self) -> Result<Token, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a runtime: {e}"))?;
        let answer = runtime.block_on(async {
            tokio::time::timeout(REQUEST_TIMEOUT, self.fetch())
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {REQUEST_TIMEOUT:?}")))
        });
        // A name lookup still running on a blocking thread after a timeout must not hold
        // the caller (dropping the runtime would wait for it).
        runtime.shutdown_background();
        answer
    }

    /// One client credentials request: the credentials in HTTP basic authentication (each
    /// form-encoded first, as RFC 6749 §2.3.1 says), the grant and scope in the form body.
    async fn fetch(&self) -> Result<Token, String> {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_native_roots()
            .map_err(|e| format!("no root certificates: {e}"))?
            .https_or_http()
            .enable_http1()
            .build();
        let client: hyper_util::client::legacy::Client<_, Full<bytes::Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(connector);
        let form = |s: &str| utf8_percent_encode(s, FORM).to_string();
        let credentials = base64::engine::general_purpose::STANDARD.encode(format!(
            "{}:{}",
            form(&self.client_id),
            form(&self.client_secret)
        ));
        let mut body = "grant_type=client_credentials".to_owned();
        if let Some(scope) = &self.scope {
            body += &format!("&scope={}", form(scope));
        }
        let request = http::Request::post(self.endpoint.clone())
            .header(http::header::AUTHORIZATION, format!("Basic {credentials}"))
            .header(
                http::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .header(http::header::ACCEPT, "application/json")
            .body(Full::new(bytes::Bytes::from(body)))
            .map_err(|e| format!("cannot make the request: {e}"))?;
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("cannot reach the endpoint: {}", chain(&e)))?;
        let status = response.status();
        let answer = http_body_util::Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| format!("answer unreadable ({status}): {e}"))?
            .to_bytes();
        if !status.is_success() {
            let why = serde_json::from_slice::<Refusal>(&answer)
                .map(|r| match r.error_description {
                    Some(d) => format!(": {} ({d})", r.error),
                    None => format!(": {}", r.error),
                })
                .unwrap_or_default();
            return Err(format!(
                "the endpoint refused the client credentials of {}: {status}{why}",
                self.client_id
            ));
        }
        let answer: Answer = serde_json::from_slice(&answer).map_err(|e| {
            format!("the endpoint's answer ({status}) is not an access token (RFC 6749 §5.1): {e}")
        })?;
        self.token_from(answer)
    }

    /// The token of an answer: its lifetime from `expires_in`, else from the JWT's `exp`.
    fn token_from(&self, answer: Answer) -> Result<Token, String> {
        let claims = jwt_claims(&answer.access_token);
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as i64;
        let lifetime = match (answer.expires_in, claims.as_ref().and_then(|c| c.exp)) {
            (Some(seconds), _) => Duration::from_secs(seconds),
            (None, Some(exp)) => Duration::from_millis((exp * 1000 - now_ms).max(0) as u64),
            (None, None) => {
                return Err(
                    "the answer has no expires_in and the token no exp claim: its lifetime is \
                     unknown"
                        .into(),
                );
            }
        };
        if lifetime.is_zero() {
            return Err("the endpoint handed out an expired token".into());
        }
        Ok(Token {
            value: answer.access_token,
            principal: claims
                .and_then(|c| c.sub)
                .unwrap_or_else(|| self.client_id.clone()),
            expires_at_ms: now_ms + lifetime.as_millis() as i64,
            fetched: Instant::now(),
            lifetime,
        })
    }
}

/// The claims of a JWT (`header.claims.signature`, each base64url), if it is one. Nothing is
/// verified: the broker does that; this only reads the subject and expiry.
fn jwt_claims(token: &str) -> Option<Claims> {
    let claims = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(claims.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice(&json).ok()
}

/// An error with its sources (hyper's own says only "client error (Connect)").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out += &format!(": {s}");
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expires_in_is_read_as_a_number_or_a_string_of_digits() {
        let read = |json: &str| serde_json::from_str::<Answer>(json).map(|a| a.expires_in);
        assert_eq!(
            read(r#"{"access_token":"t","expires_in":3599}"#).unwrap(),
            Some(3599)
        );
        assert_eq!(
            read(r#"{"access_token":"t","expires_in":"3599"}"#).unwrap(),
            Some(3599)
        );
        assert_eq!(read(r#"{"access_token":"t"}"#).unwrap(), None);
        let e = read(r#"{"access_token":"t","expires_in":"soon"}"#).unwrap_err();
        assert!(e.to_string().contains("not a number"), "{e}");
    }

    fn source(endpoint: &str) -> OAuthTokenSource {
        OAuthTokenSource {
            endpoint: endpoint.parse().unwrap(),
            client_id: "bridge".into(),
            client_secret: "s3cret".into(),
            scope: None,
            newest: Mutex::new(None),
        }
    }

    fn jwt(claims: serde_json::Value) -> String {
        let b64 = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
        format!(
            "{}.{}.",
            b64(br#"{"alg":"none"}"#),
            b64(claims.to_string().as_bytes())
        )
    }

    #[test]
    fn lifetime_from_expires_in_else_exp_and_principal_from_sub() {
        let s = source("http://127.0.0.1:1/token");
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let token = jwt(serde_json::json!({"sub": "svc", "exp": now + 600}));
        let t = s
            .token_from(Answer {
                access_token: token.clone(),
                expires_in: Some(60),
            })
            .unwrap();
        assert_eq!(t.principal, "svc");
        assert_eq!(t.lifetime, Duration::from_secs(60));
        let t = s
            .token_from(Answer {
                access_token: token,
                expires_in: None,
            })
            .unwrap();
        assert!(t.lifetime > Duration::from_secs(590) && t.lifetime <= Duration::from_secs(600));
        let opaque = s.token_from(Answer {
            access_token: "opaque".into(),
            expires_in: None,
        });
        assert!(opaque.unwrap_err().contains("lifetime is unknown"));
        let t = s
            .token_from(Answer {
                access_token: "opaque".into(),
                expires_in: Some(5),
            })
            .unwrap();
        assert_eq!(t.principal, "bridge");
    }

    #[test]
    fn debug_shows_no_secret_and_no_token() {
        let s = source("https://idp.example/token");
        *s.newest.lock().unwrap() = Some(
            s.token_from(Answer {
                access_token: "tok-value".into(),
                expires_in: Some(5),
            })
            .unwrap(),
        );
        let shown = format!("{s:?} {:?}", s.newest.lock().unwrap());
        assert!(
            !shown.contains("s3cret") && !shown.contains("tok-value"),
            "{shown}"
        );
    }

    #[test]
    fn an_unreachable_endpoint_is_named_and_its_secret_is_not() {
        // A port nothing listens on: bound, then released.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = source(&format!("http://127.0.0.1:{port}/token"))
            .token()
            .unwrap_err();
        assert!(e.contains(&format!("127.0.0.1:{port}/token")), "{e}");
        assert!(e.contains("cannot reach"), "{e}");
        assert!(!e.contains("s3cret"), "{e}");
    }
}
