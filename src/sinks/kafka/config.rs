//! Settings of a `kafka` sink.

use std::{collections::BTreeMap, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    message::Encoding,
    sinks::{
        SecretRef,
        template::{Field, Template},
        tls::TlsFiles,
    },
};

/// How long `init_transactions`, a commit and an abort of `exactly_once` may take.
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The `transactional.id` of sink `sink`'s producer for shard `shard` of cluster `cluster`
/// with `exactly_once`: `kube-event-bridge.{cluster}.{sink}`, with `.{shard}` (its label)
/// when sharded. The same on every replica: a new owner's producer fences the last one's.
pub fn transactional_id(cluster: &str, sink: &str, shard: crate::shard::Shard) -> String {
    let id = format!("kube-event-bridge.{cluster}.{sink}");
    if shard.is_whole() {
        id
    } else {
        format!("{id}.{}", shard.label())
    }
}

/// Settings of a `kafka` sink.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// Bootstrap brokers, `host:port`.
    pub brokers: Vec<String>,
    /// Topic template; placeholders `{cluster}` `{group}` `{version}` `{kind}` `{resource}`
    /// `{namespace}` (an empty group is written `core`, the namespace of a cluster-scoped
    /// object `_`).
    #[serde(default = "default_topic")]
    pub topic: String,
    /// Key template; unset means `{namespace}/{name}`, or `{name}` for cluster-scoped objects.
    /// Messages with one key go to one partition, in order.
    #[serde(default)]
    pub key: Option<String>,
    /// Headers added to every message.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// `events`: one CloudEvent per notification. `state`: value = the newest object,
    /// delete = tombstone (null value), for a compacted topic that holds the cluster's state.
    #[serde(default)]
    pub mode: KafkaMode,
    /// CloudEvents content mode in `events` mode: `structured` or `binary` (`ce_*` headers).
    #[serde(default)]
    pub encoding: Encoding,
    /// Compression codec: `none`, `gzip`, `snappy`, `lz4` or `zstd`.
    #[serde(default)]
    pub compression: Compression,
    /// How long the producer waits to fill a batch (`linger.ms`).
    #[serde(default = "default_linger", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub linger: Duration,
    /// How long the producer retries a message before reporting it failed
    /// (`message.timeout.ms`); the pipeline then retries it again with backoff. With leader
    /// election, a new leader waits this long less `lease_duration - renew_deadline`.
    #[serde(default = "default_delivery_timeout", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub delivery_timeout: Duration,
    /// Any other librdkafka producer property, passed through (`batch.size`,
    /// `queue.buffering.max.messages`, …). Secrets do not belong here: use `sasl` and `tls`.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// TLS towards the brokers.
    #[serde(default)]
    pub tls: Option<KafkaTlsConfig>,
    /// SASL authentication.
    #[serde(default)]
    pub sasl: Option<KafkaSaslConfig>,
    /// Create missing topics at start through the admin API (off by default).
    #[serde(default)]
    pub create_topics: Option<KafkaTopicsConfig>,
    /// Compacted topic holding the checkpoints of this sink's routes (see `sinks[].resume`):
    /// one record per route and object, a tombstone when its delete was acknowledged. Created
    /// at start when missing (one partition, `cleanup.policy=compact`, the replication factor
    /// of `create_topics`, else 1).
    #[serde(default = "default_checkpoint_topic")]
    pub checkpoint_topic: String,
    /// Exactly-once delivery to `read_committed` consumers: the sink writes through a
    /// transactional producer (`transactional.id` `kube-event-bridge.{cluster}.{sink}`, with
    /// `.{shard}` per shard when sharded; the same on every replica, so a new leader's
    /// producer fences the last one's), and each message's checkpoint record goes in the same
    /// transaction as the message. Needs Apache Kafka 0.11 or newer (any current Kafka, MSK,
    /// Confluent, Strimzi) and the `WRITE` and `DESCRIBE` ACLs on those transactional ids. Not
    /// for a `dead_letter` sink. Off by default (at least once).
    #[serde(default)]
    pub exactly_once: bool,
    /// With `exactly_once`: how often the open transaction is committed. A message's
    /// acknowledgement (and the next message of the same object) waits for its commit.
    #[serde(default = "default_transaction_interval", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub transaction_interval: Duration,
    /// With `exactly_once`: `transaction.timeout.ms`. The broker aborts a transaction left
    /// open this long (a replica killed mid-transaction that no new leader replaced);
    /// `read_committed` consumers of its partitions wait until then.
    #[serde(default = "default_transaction_timeout", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub transaction_timeout: Duration,
}

/// What a `kafka` sink writes.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum KafkaMode {
    /// Every notification, as a CloudEvent.
    #[default]
    Events,
    /// The newest state of each object, deletes as tombstones.
    State,
}

/// Producer compression codecs.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// No compression.
    None,
    /// gzip.
    Gzip,
    /// Snappy.
    Snappy,
    /// LZ4: cheap and effective on JSON.
    #[default]
    Lz4,
    /// Zstandard: the best ratio.
    Zstd,
}

impl Compression {
    /// librdkafka's name for the codec.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Gzip => "gzip",
            Self::Snappy => "snappy",
            Self::Lz4 => "lz4",
            Self::Zstd => "zstd",
        }
    }
}

/// TLS towards the brokers.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaTlsConfig {
    /// The certificate files (`ca_file`, `cert_file`, `key_file`), as every sink has them.
    #[serde(flatten)]
    pub files: TlsFiles,
    /// Password of an encrypted `key_file`.
    #[serde(default)]
    pub key_password: Option<SecretRef>,
}

/// SASL authentication.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSaslConfig {
    /// `PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512` or `OAUTHBEARER`.
    pub mechanism: SaslMechanism,
    /// User name (`PLAIN` and `SCRAM-*`).
    #[serde(default)]
    pub username: Option<String>,
    /// Password (`PLAIN` and `SCRAM-*`).
    #[serde(default)]
    pub password: Option<SecretRef>,
    /// `OAUTHBEARER`: the OIDC token endpoint (`https://…`; `http://` only on loopback) that
    /// hands out access tokens for the client credentials grant.
    #[serde(default)]
    pub token_endpoint: Option<String>,
    /// `OAUTHBEARER`: the client id sent to `token_endpoint`.
    #[serde(default)]
    pub client_id: Option<String>,
    /// `OAUTHBEARER`: the client secret sent to `token_endpoint` (HTTP basic authentication).
    #[serde(default)]
    pub client_secret: Option<SecretRef>,
    /// `OAUTHBEARER`: the scope to ask for (space-separated); unset asks for none.
    #[serde(default)]
    pub scope: Option<String>,
}

/// SASL mechanisms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum SaslMechanism {
    /// Clear-text user and password (use with TLS).
    #[serde(rename = "PLAIN")]
    Plain,
    /// SCRAM with SHA-256.
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    /// SCRAM with SHA-512.
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
    /// OAuth 2 bearer tokens (RFC 7628) from an OIDC token endpoint, client credentials grant.
    #[serde(rename = "OAUTHBEARER")]
    OAuthBearer,
}

impl SaslMechanism {
    /// librdkafka's name for the mechanism.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
            Self::OAuthBearer => "OAUTHBEARER",
        }
    }
}

impl KafkaSaslConfig {
    /// Field checks; each error is `(path below sasl, reason)`. `PLAIN` and `SCRAM-*` take a
    /// user and password, `OAUTHBEARER` an endpoint and client credentials, never both.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        let mut err = |path: &str, reason: String| errors.push((path.to_owned(), reason));
        let mechanism = self.mechanism.as_str();
        let password = [
            ("username", self.username.is_some()),
            ("password", self.password.is_some()),
        ];
        let oauth = [
            ("token_endpoint", self.token_endpoint.is_some()),
            ("client_id", self.client_id.is_some()),
            ("client_secret", self.client_secret.is_some()),
        ];
        let scope = ("scope", self.scope.is_some());
        let (needed, unused) = match self.mechanism {
            SaslMechanism::OAuthBearer => (oauth.to_vec(), password.to_vec()),
            _ => (password.to_vec(), [&oauth[..], &[scope]].concat()),
        };
        for (field, set) in needed {
            if !set {
                err(field, format!("required with mechanism {mechanism}"));
            }
        }
        for (field, set) in unused {
            if set {
                err(field, format!("not used by mechanism {mechanism}"));
            }
        }
        for (field, secret) in [
            ("password", &self.password),
            ("client_secret", &self.client_secret),
        ] {
            if let Some(reason) = secret.as_ref().and_then(SecretRef::problem) {
                err(field, reason);
            }
        }
        if let Some(url) = &self.token_endpoint
            && let Err(reason) = check_token_endpoint(url)
        {
            err("token_endpoint", reason);
        }
        errors
    }
}

/// Whether `url` may receive the client secret: an `https` URL with a host, or `http` to a
/// loopback address (a local token proxy); anything else would send the secret in clear.
pub fn check_token_endpoint(url: &str) -> std::result::Result<http::Uri, String> {
    // Credentials in the URL would be printed wherever the endpoint is named (errors,
    // librdkafka's log): refused, without echoing the URL.
    if url.split_once("://").is_some_and(|(_, rest)| {
        rest.split(['/', '?', '#'])
            .next()
            .unwrap_or("")
            .contains('@')
    }) {
        return Err(
            "holds credentials (user:password@host): the client secret belongs in \
                    sasl.client_secret"
                .into(),
        );
    }
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    let host = uri.host().unwrap_or_default();
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    match uri.scheme_str() {
        _ if host.is_empty() => Err(format!("{url:?} names no host")),
        Some("https") => Ok(uri),
        Some("http") if loopback => Ok(uri),
        Some("http") => Err(format!(
            "{url:?} would send the client secret unencrypted: use https (http only to a \
             loopback address)"
        )),
        _ => Err(format!("{url:?} is not an http(s) URL")),
    }
}

/// Topic creation at start.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaTopicsConfig {
    /// Partitions of each created topic.
    #[serde(default = "default_partitions")]
    pub partitions: i32,
    /// Replication factor of each created topic.
    #[serde(default = "default_replication")]
    pub replication_factor: i32,
}

fn default_topic() -> String {
    "k8s.{cluster}.{group}.{resource}".into()
}
// Small enough not to add latency a person notices, large enough to batch under load.
fn default_linger() -> Duration {
    Duration::from_millis(5)
}
fn default_delivery_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_transaction_interval() -> Duration {
    Duration::from_millis(100)
}
fn default_transaction_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_checkpoint_topic() -> String {
    "kube-event-bridge.checkpoints".into()
}
fn default_partitions() -> i32 {
    3
}
fn default_replication() -> i32 {
    1
}

/// Properties the sink sets itself; `properties` may not change them, because the delivery
/// contract depends on them.
pub const RESERVED_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "sasl.password",
    "ssl.key.password",
    "sasl.username",
    "sasl.mechanism",
    "sasl.mechanisms",
    "security.protocol",
    "transactional.id",
    "transaction.timeout.ms",
];

/// Whether a librdkafka property holds a secret (`ssl.keystore.password`, `ssl.key.pem`,
/// `sasl.oauthbearer.client.secret`, `sasl.oauthbearer.config`): refused in `properties`.
fn is_secret_property(name: &str) -> bool {
    name.contains("password")
        || name.contains("secret")
        || matches!(name, "ssl.key.pem" | "sasl.oauthbearer.config")
}

/// Whether `topic` is a valid Kafka topic name.
pub fn is_valid_topic(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

impl KafkaSinkConfig {
    /// Field checks; each error is `(path below the sink, reason)`.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        let mut err = |path: &str, reason: String| errors.push((path.to_owned(), reason));
        if self.brokers.is_empty() {
            err("brokers", "at least one broker is required".into());
        }
        if !is_valid_topic(&self.checkpoint_topic) {
            err(
                "checkpoint_topic",
                format!(
                    "{:?} is not a valid topic name (letters, digits, `.`, `_`, `-`)",
                    self.checkpoint_topic
                ),
            );
        }
        match Template::parse(&self.topic) {
            Err(e) => err("topic", e.to_string()),
            Ok(t) => {
                if let Err(e) = t.forbid(&[Field::Name, Field::Type]) {
                    err(
                        "topic",
                        format!(
                            "{e}: one topic per object or event type is not what topics are for"
                        ),
                    );
                }
                let literal: String = t
                    .segments()
                    .iter()
                    .map(|s| match s {
                        crate::sinks::template::Segment::Literal(l) => l.as_str(),
                        crate::sinks::template::Segment::Placeholder(_) => "x",
                    })
                    .collect();
                if !is_valid_topic(&literal) {
                    err(
                        "topic",
                        format!(
                            "{:?} does not make valid topic names (letters, digits, `.`, `_`, `-`)",
                            self.topic
                        ),
                    );
                }
            }
        }
        if let Some(key) = &self.key
            && let Err(e) = Template::parse(key)
        {
            err("key", e.to_string());
        }
        if self.mode == KafkaMode::State && self.encoding != Encoding::Structured {
            err(
                "encoding",
                "state mode writes objects, not CloudEvents; leave encoding unset".into(),
            );
        }
        for name in self.properties.keys() {
            if name == "delivery.report.only.error" {
                err(
                    &format!("properties.{name}"),
                    "the sink needs every message's delivery report: it is the message's \
                     acknowledgement"
                        .into(),
                );
            } else if RESERVED_PROPERTIES.contains(&name.as_str()) {
                err(
                    &format!("properties.{name}"),
                    "set by the sink itself (use brokers, sasl, tls)".into(),
                );
            } else if is_secret_property(name) {
                err(
                    &format!("properties.{name}"),
                    "a secret may not be inline (the config is logged and stored in a \
                     ConfigMap); use tls.key_file and tls.key_password, sasl.password or \
                     sasl.oauthbearer with a file or environment variable"
                        .into(),
                );
            }
        }
        if let Some(tls) = &self.tls {
            if let Some(reason) = tls.files.problem() {
                err("tls", reason);
            }
            if let Some(reason) = tls.key_password.as_ref().and_then(SecretRef::problem) {
                err("tls.key_password", reason);
            }
        }
        if let Some(sasl) = &self.sasl {
            for (path, reason) in sasl.validate() {
                err(&format!("sasl.{path}"), reason);
            }
        }
        if self.exactly_once {
            if self.transaction_interval < Duration::from_millis(10) {
                err(
                    "transaction_interval",
                    "must be at least 10ms (each commit is a round trip to the brokers)".into(),
                );
            }
            if self.transaction_timeout < Duration::from_secs(1)
                || self.transaction_timeout < self.transaction_interval * 2
                || self.transaction_timeout > Duration::from_secs(900)
            {
                err(
                    "transaction_timeout",
                    "must be between 1s (and twice transaction_interval) and 15m (the \
                     brokers' default transaction.max.timeout.ms)"
                        .into(),
                );
            }
            // A transaction stays open for its interval, the deliveries of its last records
            // and the commit call: the broker must not abort it meanwhile.
            let longest = self.transaction_interval + self.delivery_timeout + CALL_TIMEOUT;
            if self.transaction_timeout <= longest {
                err(
                    "transaction_timeout",
                    format!(
                        "must exceed transaction_interval + delivery_timeout + {:?} ({:?}) \
                         with exactly_once: a transaction stays open that long at most",
                        CALL_TIMEOUT, longest
                    ),
                );
            }
        }
        if let Some(t) = &self.create_topics {
            if t.partitions < 1 {
                err("create_topics.partitions", "must be at least 1".into());
            }
            if t.replication_factor < 1 {
                err(
                    "create_topics.replication_factor",
                    "must be at least 1".into(),
                );
            }
        }
        errors
    }

    /// The encoder mode of this sink's messages.
    pub fn message_encoding(&self) -> Encoding {
        match self.mode {
            KafkaMode::State => Encoding::State,
            KafkaMode::Events => self.encoding,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sasl(v: serde_json::Value) -> KafkaSaslConfig {
        serde_json::from_value(v).unwrap()
    }

    fn paths(errors: Vec<(String, String)>) -> Vec<String> {
        errors.into_iter().map(|(p, _)| p).collect()
    }

    #[test]
    fn tls_takes_the_shared_files_and_its_key_password_and_refuses_anything_else() {
        let tls: KafkaTlsConfig = serde_json::from_value(serde_json::json!({
            "ca_file": "/ca.pem", "cert_file": "/c.pem", "key_file": "/k.pem",
            "key_password": {"env": "KEY_PASSWORD"}}))
        .unwrap();
        assert_eq!(
            tls.files.client_pair().map(|(c, _)| c.as_path()),
            Some("/c.pem".as_ref())
        );
        assert!(tls.key_password.is_some());
        let err = serde_json::from_value::<KafkaTlsConfig>(
            serde_json::json!({"ca_file": "/ca.pem", "cert": "/c.pem"}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `cert`"), "{err}");
    }

    #[test]
    fn each_mechanism_takes_its_own_fields() {
        let plain = sasl(serde_json::json!({"mechanism": "PLAIN", "username": "u",
            "password": {"env": "P"}}));
        assert!(plain.validate().is_empty());
        let oauth = sasl(serde_json::json!({"mechanism": "OAUTHBEARER",
            "token_endpoint": "https://idp.example/token", "client_id": "c",
            "client_secret": {"file": "/s"}, "scope": "kafka"}));
        assert!(oauth.validate().is_empty());
        let mixed = sasl(
            serde_json::json!({"mechanism": "OAUTHBEARER", "username": "u",
            "client_id": "c", "client_secret": {"env": "S", "file": "/s"}}),
        );
        assert_eq!(
            paths(mixed.validate()),
            ["token_endpoint", "username", "client_secret"]
        );
        let scram = sasl(serde_json::json!({"mechanism": "SCRAM-SHA-512", "scope": "x"}));
        assert_eq!(paths(scram.validate()), ["username", "password", "scope"]);
    }

    #[test]
    fn the_client_secret_goes_only_over_tls_or_loopback() {
        assert!(check_token_endpoint("https://idp.example/token").is_ok());
        assert!(check_token_endpoint("http://127.0.0.1:8080/token").is_ok());
        assert!(check_token_endpoint("http://[::1]:8080/token").is_ok());
        assert!(check_token_endpoint("http://localhost/token").is_ok());
        let e = check_token_endpoint("https://id:s3cret@idp.example/token").unwrap_err();
        assert!(
            e.contains("holds credentials") && !e.contains("s3cret"),
            "{e}"
        );
        assert!(check_token_endpoint("https://idp.example/token?user=a@b").is_ok());
        let e = check_token_endpoint("http://idp.example/token").unwrap_err();
        assert!(e.contains("unencrypted"), "{e}");
        assert!(check_token_endpoint("ftp://idp.example/token").is_err());
        assert!(check_token_endpoint("/token").is_err());
    }
}
