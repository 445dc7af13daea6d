//! A `kafka` sink's librdkafka clients: one configuration (brokers, TLS, SASL, producer
//! settings) and one client context (OAUTHBEARER tokens, error filtering) for its producer,
//! its admin client and its readers (checkpoint store, `tail`, `state`) alike.
//!
//! # Contract
//! - Secrets (SASL password, TLS key password, OIDC client secret) are read here, at start,
//!   and never logged; nor is a token.
//! - With `OAUTHBEARER`, every client has a token before it first connects (set at creation,
//!   so that a reader's first metadata request, made before any poll, authenticates), and
//!   librdkafka asks the context for a new one as it nears expiry. A token endpoint that
//!   fails makes the creation fail, naming the endpoint.

use std::{
    ffi::CString,
    sync::{Arc, Mutex},
};

use rdkafka::{
    ClientConfig, ClientContext,
    admin::AdminClient,
    client::{Client, OAuthToken},
    consumer::ConsumerContext,
    error::{KafkaError, RDKafkaErrorCode},
    producer::Producer as _,
};

use super::{
    config::{KafkaSinkConfig, SaslMechanism},
    oauth::OAuthTokenSource,
};

/// The sink's producer (see `producer`).
pub type SinkProducer = super::producer::ReportingProducer<KafkaContext>;

/// Drops a librdkafka client (an admin client made for one request) on a blocking thread,
/// without waiting for it: destroying a client waits for its threads to end, about 100 ms
/// here, which must hold neither an async worker nor the task that made it (a start).
pub fn close_later<T: Send + 'static>(client: T) {
    drop(tokio::task::spawn_blocking(move || drop(client)));
}

/// The client context of every client of a sink. rdkafka's default logs every consumer error
/// event as a "Global error" at ERROR level, the end of a partition (`PartitionEOF`, which a
/// read to the end asks for) included; that one is how a read ends, not an error, and is
/// dropped. With `OAUTHBEARER`, tokens come from the sink's [`OAuthTokenSource`].
/// The newest error (but "all brokers down") is kept, so that a failed start can say why the
/// brokers did not answer (librdkafka's metadata error says only "broker transport failure").
#[derive(Clone, Default)]
pub struct KafkaContext {
    oauth: Option<Arc<OAuthTokenSource>>,
    newest_error: Arc<Mutex<Option<String>>>,
}

impl ClientContext for KafkaContext {
    // Only consulted by librdkafka with `sasl.mechanism=OAUTHBEARER`.
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn error(&self, error: KafkaError, reason: &str) {
        if error != KafkaError::Global(RDKafkaErrorCode::PartitionEOF) {
            tracing::error!("librdkafka: {error}: {reason}");
            // "All brokers down" follows the cause (a refused authentication, an untrusted
            // certificate) and would hide it.
            if error != KafkaError::Global(RDKafkaErrorCode::AllBrokersDown) {
                *self.newest_error.lock().unwrap() = Some(format!("{error}: {reason}"));
            }
        }
    }

    fn generate_oauth_token(
        &self,
        _oauthbearer_config: Option<&str>,
    ) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        let source = self
            .oauth
            .as_ref()
            .ok_or("sasl.mechanism is OAUTHBEARER but the sink has no token endpoint")?;
        let token = source.token()?;
        Ok(OAuthToken {
            token: token.value,
            principal_name: token.principal,
            lifetime_ms: token.expires_at_ms,
        })
    }
}

impl ConsumerContext for KafkaContext {}

/// A sink's client settings and context: what its clients are made from. Cheap to clone (the
/// token source is shared, so the clients of one sink share its newest token).
#[derive(Clone)]
pub struct KafkaClient {
    /// The librdkafka settings.
    pub config: ClientConfig,
    context: KafkaContext,
}

/// Settings without OAUTHBEARER (tests and benches that build their own).
impl From<&ClientConfig> for KafkaClient {
    fn from(config: &ClientConfig) -> Self {
        Self {
            config: config.clone(),
            context: KafkaContext::default(),
        }
    }
}

impl From<&mut ClientConfig> for KafkaClient {
    fn from(config: &mut ClientConfig) -> Self {
        Self::from(&*config)
    }
}

impl From<&KafkaClient> for KafkaClient {
    fn from(client: &KafkaClient) -> Self {
        client.clone()
    }
}

impl KafkaClient {
    /// The clients of sink `name`: [`client_config`] and, with `OAUTHBEARER`, its token
    /// source (no token is fetched yet).
    pub fn new(name: &str, cfg: &KafkaSinkConfig) -> Result<Self, String> {
        let oauth = match &cfg.sasl {
            Some(sasl) if sasl.mechanism == SaslMechanism::OAuthBearer => {
                Some(Arc::new(OAuthTokenSource::new(sasl)?))
            }
            _ => None,
        };
        Ok(Self {
            config: client_config(name, cfg)?,
            context: KafkaContext {
                oauth,
                newest_error: Arc::default(),
            },
        })
    }

    /// The newest error librdkafka reported for a client of this sink (an authentication or
    /// TLS failure, a broker down), for messages.
    pub fn newest_error(&self) -> Option<String> {
        self.context.newest_error.lock().unwrap().clone()
    }

    /// The sink's idempotent, acks=all producer. Blocking with `OAUTHBEARER` (a token
    /// request, unless the newest token is young).
    pub fn producer(&self) -> Result<SinkProducer, String> {
        // The token first: the producer's reports thread serves librdkafka's first refresh at
        // once, and finds it cached instead of asking the endpoint a second time.
        self.warm_token()?;
        let producer = SinkProducer::create(&self.config, self.context.clone())
            .map_err(|e| format!("cannot create a Kafka producer: {e}"))?;
        self.authenticate(producer.client())?;
        Ok(producer)
    }

    /// A transactional producer of the sink (its settings, and `transactional.id` `id`): not
    /// initialised yet. Blocking like [`KafkaClient::producer`].
    pub fn transactional_producer(
        &self,
        id: &str,
        timeout: std::time::Duration,
    ) -> Result<SinkProducer, String> {
        self.warm_token()?;
        let mut config = self.config.clone();
        config
            .set("transactional.id", id)
            .set("transaction.timeout.ms", timeout.as_millis().to_string());
        let producer = SinkProducer::create(&config, self.context.clone())
            .map_err(|e| format!("cannot create a transactional Kafka producer: {e}"))?;
        self.authenticate(producer.client())?;
        Ok(producer)
    }

    /// An admin client (topic creation). Blocking like [`KafkaClient::producer`].
    pub fn admin(&self) -> Result<AdminClient<KafkaContext>, String> {
        let admin: AdminClient<KafkaContext> = self
            .config
            .create_with_context(self.context.clone())
            .map_err(|e| format!("cannot create a Kafka admin client: {e}"))?;
        self.authenticate(admin.inner())?;
        Ok(admin)
    }

    /// A client of kind `T` made from `config` (these settings changed by the caller) with
    /// this context. Blocking like [`KafkaClient::producer`].
    pub fn create<T>(
        &self,
        config: &ClientConfig,
        client: impl Fn(&T) -> &Client<KafkaContext>,
    ) -> Result<T, String>
    where
        T: rdkafka::config::FromClientConfigAndContext<KafkaContext>,
    {
        let made: T = config
            .create_with_context(self.context.clone())
            .map_err(|e| e.to_string())?;
        self.authenticate(client(&made))?;
        Ok(made)
    }

    /// Hands a new client its first token. librdkafka asks for one through an event that only
    /// a poll of the client's main queue serves: a producer's background thread polls at
    /// once, but a reader asks the brokers for metadata before its first poll, and rdkafka's
    /// admin client never polls that queue. So the token is set here, at creation; later
    /// refreshes come through [`KafkaContext::generate_oauth_token`] (the admin client's
    /// never do: it lives for a few requests, well within a token's lifetime).
    fn warm_token(&self) -> Result<(), String> {
        match &self.context.oauth {
            Some(source) => source.token().map(drop),
            None => Ok(()),
        }
    }

    fn authenticate<C: ClientContext>(&self, client: &Client<C>) -> Result<(), String> {
        let Some(source) = &self.context.oauth else {
            return Ok(());
        };
        let token = source.token()?;
        let value = CString::new(token.value).map_err(|_| "the token holds a NUL byte")?;
        let principal =
            CString::new(token.principal).map_err(|_| "the token's subject holds a NUL byte")?;
        let mut error = [0 as std::ffi::c_char; 512];
        // SAFETY: the client pointer is live for the borrow of `client`; the strings are
        // NUL-terminated and outlive the call, which copies them; no extensions (null, 0);
        // `error` is writable for its length, which is passed.
        let code = unsafe {
            rdkafka::bindings::rd_kafka_oauthbearer_set_token(
                client.native_ptr(),
                value.as_ptr(),
                token.expires_at_ms,
                principal.as_ptr(),
                std::ptr::null_mut(),
                0,
                error.as_mut_ptr(),
                error.len(),
            )
        };
        if code == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            Ok(())
        } else {
            // SAFETY: librdkafka wrote a NUL-terminated message into `error`.
            let why = unsafe { std::ffi::CStr::from_ptr(error.as_ptr()) };
            Err(format!(
                "librdkafka refused the token from {}: {}",
                source.endpoint(),
                why.to_string_lossy()
            ))
        }
    }
}

/// The librdkafka configuration of a sink (brokers, security, producer settings). Secrets are
/// read here and never logged. `OAUTHBEARER` needs the context of a [`KafkaClient`] too.
pub fn client_config(
    name: &str,
    cfg: &KafkaSinkConfig,
) -> std::result::Result<ClientConfig, String> {
    let mut c = ClientConfig::new();
    for (k, v) in &cfg.properties {
        c.set(k, v);
    }
    c.set("bootstrap.servers", cfg.brokers.join(","))
        .set("client.id", format!("kube-event-bridge-{name}"))
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("compression.type", cfg.compression.as_str())
        .set("linger.ms", cfg.linger.as_millis().to_string())
        .set(
            "message.timeout.ms",
            cfg.delivery_timeout.as_millis().to_string(),
        );
    // A new client waits reconnect.backoff.ms / 2 between its first connections (as it
    // starts, its bootstrap broker's, then the partition leader's), 50 ms with librdkafka's
    // default of 100: a start's metadata check and each checkpoint read paid it. Later
    // reconnects still back off exponentially to `reconnect.backoff.max.ms` (10 s).
    if !cfg.properties.contains_key("reconnect.backoff.ms") {
        c.set("reconnect.backoff.ms", "10");
    }
    let protocol = match (&cfg.tls, &cfg.sasl) {
        (None, None) => "plaintext",
        (Some(_), None) => "ssl",
        (None, Some(_)) => "sasl_plaintext",
        (Some(_), Some(_)) => "sasl_ssl",
    };
    c.set("security.protocol", protocol);
    if let Some(tls) = &cfg.tls {
        if let Some(ca) = &tls.files.ca_file {
            c.set("ssl.ca.location", ca.display().to_string());
        }
        if let Some((cert, key)) = tls.files.client_pair() {
            c.set("ssl.certificate.location", cert.display().to_string());
            c.set("ssl.key.location", key.display().to_string());
        }
        if let Some(p) = &tls.key_password {
            c.set(
                "ssl.key.password",
                p.resolve().map_err(|e| format!("tls.key_password: {e}"))?,
            );
        }
    }
    if let Some(sasl) = &cfg.sasl {
        c.set("sasl.mechanism", sasl.mechanism.as_str());
        if sasl.mechanism != SaslMechanism::OAuthBearer {
            let missing = |field: &str| {
                format!(
                    "sasl.{field}: required with mechanism {}",
                    sasl.mechanism.as_str()
                )
            };
            let password = sasl.password.as_ref().ok_or_else(|| missing("password"))?;
            c.set(
                "sasl.username",
                sasl.username.as_ref().ok_or_else(|| missing("username"))?,
            )
            .set(
                "sasl.password",
                password
                    .resolve()
                    .map_err(|e| format!("sasl.password: {e}"))?,
            );
        }
    }
    Ok(c)
}
