//! The Kafka sink's authentication against Apache Kafka itself: one node of this binary's own
//! with SASL (PLAIN, SCRAM-SHA-512, OAUTHBEARER) and TLS listeners (`Kafka::secured`), the
//! service run as a pod runs it (the real binary, debug logs), and `state` reading back what
//! it wrote through the same listener and credentials. Every success publishes and reads back;
//! every failure stops the start (exit 1) naming the sink; no log line of any of these runs
//! holds a password, the client secret or a token.

mod support;

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant, SystemTime},
};

use base64::Engine as _;
use serde_json::{Value, json};
use support::{
    ApiServer,
    config::{ConfigBuilder, kafka_sink},
    kafka::{Kafka, PLAIN_USER, SCRAM_USER, consume},
    objects::{configmap, typed},
    tools::Tools,
    wait::{self, PATIENCE},
};

/// The ConfigMaps each success case publishes.
const OBJECTS: usize = 5;
/// The OIDC client of the OAUTHBEARER cases, and its secret.
const CLIENT_ID: &str = "bridge-client";
const CLIENT_SECRET: &str = "oidc-secret-93ab71";
/// Passwords the failure cases try.
const WRONG_PASSWORD: &str = "wrong-pw-66d1c0";

/// The node of this binary, started by the first test that asks (a start costs 5–20 s).
fn kafka() -> &'static Kafka {
    static NODE: OnceLock<Kafka> = OnceLock::new();
    NODE.get_or_init(Kafka::secured)
}

/// A file holding `secret`, for a `{"file": …}` secret reference (the tools run with a clean
/// environment, so secrets come from files here).
fn secret_file(secret: &str) -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    let path = dir.path().join(secret);
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    path
}

/// What one run of the service (and of `state`, when it started) printed.
struct Run {
    /// The service's exit code when it exited by itself (a failed start), else `None`.
    code: Option<i32>,
    /// Everything it logged, then `state`'s standard error.
    log: String,
}

/// Runs the service as cluster `cluster` with one Kafka sink `sink` (`kafka` holds the fields
/// that differ: brokers, tls, sasl; state mode) over [`OBJECTS`] ConfigMaps, with debug logs. When it
/// starts: waits for every object to be acknowledged, reads the topic back with `state`
/// (through the same sink settings) and on the PLAINTEXT listener after `hold` more, and
/// stops the service.
async fn run(cluster: &str, sink: &str, kafka_settings: Value, hold: Duration) -> Run {
    let node = kafka();
    let api = ApiServer::start().await;
    for i in 0..OBJECTS {
        api.create(typed(&configmap("ns", &format!("cm-{i}"), "1")));
    }
    let dir = tempfile::tempdir().unwrap();
    // State mode: `state` reads it back.
    let mut settings =
        json!({"mode": "state", "checkpoint_topic": format!("{cluster}.checkpoints")});
    for (k, v) in kafka_settings.as_object().unwrap() {
        settings[k] = v.clone();
    }
    let brokers = settings["brokers"][0].as_str().unwrap().to_owned();
    let config = ConfigBuilder::new()
        .cluster(cluster)
        .configmaps()
        .sink(kafka_sink(sink, &brokers, settings))
        .route("configmap", &[sink])
        .value();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, config.to_string()).unwrap();
    let log_path = dir.path().join("service.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"))
        .args(["run", "--config", path.to_str().unwrap()])
        .env_clear()
        .env("KUBECONFIG", api.write_kubeconfig(dir.path()))
        // Everything, librdkafka's and hyper's debug lines included: no secret at any level.
        .env("RUST_LOG", "debug")
        .env("KEB_LOG__FORMAT", "pretty")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let started = Instant::now();
    let mut admin = None;
    // Started (the admin address logged), or exited.
    while admin.is_none() {
        if let Some(status) = child.try_wait().unwrap() {
            return Run {
                code: status.code(),
                log: log(),
            };
        }
        admin = log()
            .lines()
            .find(|l| l.contains(" Started "))
            .and_then(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("admin="))?
                    .parse::<std::net::SocketAddr>()
                    .ok()
            });
        assert!(
            started.elapsed() < PATIENCE * 3,
            "the service neither started nor exited: {}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let admin = admin.unwrap();
    wait::until(
        format_args!("{OBJECTS} acknowledged by sink {sink}"),
        PATIENCE,
        async || {
            let (_, body) = support::http_get(admin, "/metrics").await;
            body.lines()
                .filter(|l| l.starts_with("keb_sink_published_total{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as usize
                >= OBJECTS
        },
    )
    .await;
    // Read back through the secured listener by the service's own reader (`state` folds the
    // topic), and on PLAINTEXT as a check of the check.
    tokio::time::sleep(hold).await;
    let tools = Tools::new(&config, None);
    let (code, stdout, state_stderr) = tokio::task::spawn_blocking({
        let sink = sink.to_owned();
        move || tools.run("state", &sink, &["--output", "json"])
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "state failed: {state_stderr}");
    let objects: Vec<Value> = serde_json::from_str(&stdout).unwrap();
    assert_eq!(objects.len(), OBJECTS, "state read back every object");
    let topic = format!("k8s.{cluster}.core.configmaps");
    let plaintext = node.brokers();
    let records = tokio::task::spawn_blocking(move || consume(&plaintext, &topic, OBJECTS))
        .await
        .unwrap();
    assert_eq!(records.len(), OBJECTS);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "a clean shutdown: {}", log());
    Run {
        code: None,
        log: log() + &state_stderr,
    }
}

/// Fails when `log` holds any of `secrets` (or, for a JWT, its claims segment).
fn assert_no_secret(log: &str, secrets: &[&str]) {
    for secret in secrets {
        assert!(!log.contains(secret), "a secret is in the log: {secret}");
        if let Some(claims) = secret.split('.').nth(1).filter(|c| c.len() > 8) {
            assert!(!log.contains(claims), "a token's claims are in the log");
        }
    }
}

/// Fails unless `run` stopped the start (exit code 1: a sink that cannot start, as opposed to
/// a bad config, 2) with a line naming the sink and saying `reason`.
fn assert_failed_start(run: &Run, sink: &str, reason: &[&str]) {
    assert_eq!(run.code, Some(1), "a failed start exits 1: {}", run.log);
    let line = run
        .log
        .lines()
        .find(|l| l.contains("cannot start") && l.contains(&format!("sink {sink}:")))
        .unwrap_or_else(|| panic!("no line names sink {sink}: {}", run.log));
    for r in reason {
        assert!(line.contains(r), "{line:?} does not say {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_publishes_with_its_password_and_a_wrong_one_fails_the_start() {
    let node = kafka().secured.clone().unwrap();
    let (user, password) = PLAIN_USER;
    let sasl = |var: &str| {
        json!({"brokers": [node.sasl()], "sasl": {
            "mechanism": "PLAIN", "username": user, "password": {"file": secret_file(var)}}})
    };
    let ok = run("auth-plain", "plain", sasl(password), Duration::ZERO).await;
    assert_no_secret(&ok.log, &[password]);
    let bad = run(
        "auth-plain-bad",
        "plain",
        sasl(WRONG_PASSWORD),
        Duration::ZERO,
    )
    .await;
    assert_failed_start(
        &bad,
        "plain",
        &[&node.sasl(), "Invalid username or password"],
    );
    assert_no_secret(&bad.log, &[password, WRONG_PASSWORD]);
}

/// SCRAM-SHA-512 over SASL_SSL: the TLS settings and SASL together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_over_tls_publishes_with_its_password_and_a_wrong_one_fails_the_start() {
    let node = kafka().secured.clone().unwrap();
    let (user, password) = SCRAM_USER;
    let sasl = |var: &str| {
        json!({"brokers": [node.sasl_ssl()], "tls": {"ca_file": node.ca_file}, "sasl": {
            "mechanism": "SCRAM-SHA-512", "username": user, "password": {"file": secret_file(var)}}})
    };
    let ok = run("auth-scram", "scram", sasl(password), Duration::ZERO).await;
    assert_no_secret(&ok.log, &[password]);
    let bad = run(
        "auth-scram-bad",
        "scram",
        sasl(WRONG_PASSWORD),
        Duration::ZERO,
    )
    .await;
    assert_failed_start(
        &bad,
        "scram",
        &[
            &node.sasl_ssl(),
            "invalid credentials with SASL mechanism SCRAM-SHA-512",
        ],
    );
    assert_no_secret(&bad.log, &[password, WRONG_PASSWORD]);
}

/// TLS only: the server certificate checked against the test CA; without the CA (the system
/// roots) the start fails naming the sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_the_test_ca_publishes_and_without_it_fails_the_start() {
    let node = kafka().secured.clone().unwrap();
    run(
        "auth-tls",
        "tls",
        json!({"brokers": [node.ssl()], "tls": {"ca_file": node.ca_file}}),
        Duration::ZERO,
    )
    .await;
    let bad = run(
        "auth-tls-bad",
        "tls",
        json!({"brokers": [node.ssl()], "tls": {}}),
        Duration::ZERO,
    )
    .await;
    assert_failed_start(&bad, "tls", &[&node.ssl(), "certificate verify failed"]);
}

/// A token endpoint on loopback (client credentials grant), as an identity provider serves
/// one: HTTP basic authentication of [`CLIENT_ID`] and [`CLIENT_SECRET`], `grant_type` in a
/// form body; an unsigned JWT (`alg: none`, which the broker's default validator accepts)
/// with `sub`, `iat` and `exp`. Refuses everything with 401 when `refuse` is set.
struct TokenEndpoint {
    url: String,
    /// Every token handed out.
    issued: Arc<Mutex<Vec<String>>>,
    _server: tokio::task::JoinHandle<()>,
}

impl TokenEndpoint {
    async fn start(lifetime_s: u64, refuse: bool) -> Self {
        use axum::{
            Router,
            http::{HeaderMap, StatusCode},
            routing::post,
        };
        let issued: Arc<Mutex<Vec<String>>> = Arc::default();
        let app = Router::new().route(
            "/oauth2/token",
            post({
                let issued = issued.clone();
                move |headers: HeaderMap, body: String| async move {
                    let b64 = base64::engine::general_purpose::STANDARD;
                    let basic = format!(
                        "Basic {}",
                        b64.encode(format!("{CLIENT_ID}:{CLIENT_SECRET}"))
                    );
                    let authorized = headers
                        .get("authorization")
                        .is_some_and(|v| v.as_bytes() == basic.as_bytes());
                    let form_ok = headers
                        .get("content-type")
                        .is_some_and(|v| v == "application/x-www-form-urlencoded")
                        && body
                            .split('&')
                            .any(|p| p == "grant_type=client_credentials");
                    if refuse || !authorized || !form_ok {
                        return (
                            StatusCode::UNAUTHORIZED,
                            json!({"error": "invalid_client",
                                   "error_description": "client authentication failed"})
                            .to_string(),
                        );
                    }
                    let now = SystemTime::now()
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .unwrap()
                        .as_secs();
                    let n = issued.lock().unwrap().len();
                    let b64url = base64::engine::general_purpose::URL_SAFE_NO_PAD;
                    let token = format!(
                        "{}.{}.",
                        b64url.encode(br#"{"alg":"none"}"#),
                        b64url.encode(
                            json!({"sub": "bridge", "iat": now, "exp": now + lifetime_s,
                                   "jti": format!("token-{n}")})
                            .to_string()
                        )
                    );
                    issued.lock().unwrap().push(token.clone());
                    (
                        StatusCode::OK,
                        json!({"access_token": token, "token_type": "bearer",
                               "expires_in": lifetime_s})
                        .to_string(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/oauth2/token", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            issued,
            _server: server,
        }
    }

    fn sink(&self, brokers: &str) -> Value {
        json!({"brokers": [brokers], "sasl": {
            "mechanism": "OAUTHBEARER", "token_endpoint": self.url, "client_id": CLIENT_ID,
            "client_secret": {"file": secret_file(CLIENT_SECRET)}, "scope": "kafka"}})
    }
}

/// OAUTHBEARER: tokens fetched in Rust from the endpoint by the producer, the checkpoint
/// store's reader and admin client and `state`; a 4 s token is refreshed while the service
/// runs (librdkafka asks at 80 % of its lifetime), so more tokens are issued than clients
/// started. An endpoint that refuses (401) fails the start naming the sink, the endpoint and
/// the status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oauthbearer_publishes_with_tokens_from_the_endpoint_and_a_refusal_fails_the_start() {
    let node = kafka().secured.clone().unwrap();
    let endpoint = TokenEndpoint::start(4, false).await;
    // 5 s more than the acknowledgements take: at least one refresh of the service's token
    // (its first one at 3.2 s) besides its first token and `state`'s.
    let ok = run(
        "auth-oauth",
        "oauth",
        endpoint.sink(&node.sasl()),
        Duration::from_secs(5),
    )
    .await;
    let issued = endpoint.issued.lock().unwrap().clone();
    assert!(issued.len() >= 3, "{} tokens issued", issued.len());
    let mut secrets: Vec<&str> = issued.iter().map(String::as_str).collect();
    secrets.push(CLIENT_SECRET);
    assert_no_secret(&ok.log, &secrets);

    let refusing = TokenEndpoint::start(60, true).await;
    let bad = run(
        "auth-oauth-bad",
        "oauth",
        refusing.sink(&node.sasl()),
        Duration::ZERO,
    )
    .await;
    assert_failed_start(
        &bad,
        "oauth",
        &[&refusing.url, "401", "invalid_client", CLIENT_ID],
    );
    assert_no_secret(&bad.log, &[CLIENT_SECRET]);
}
