//! Settings of a `kafka` sink.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    message::Encoding,
    sinks::{
        SecretRef,
        template::{Field, Template},
    },
};

/// Settings of a `kafka` sink.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    pub linger: Duration,
    /// How long the producer retries a message before reporting it failed
    /// (`message.timeout.ms`); the pipeline then retries it again with backoff. With leader
    /// election, a new leader waits this long less `lease_duration - renew_deadline`.
    #[serde(default = "default_delivery_timeout", with = "humantime_serde")]
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
}

/// What a `kafka` sink writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KafkaMode {
    /// Every notification, as a CloudEvent.
    #[default]
    Events,
    /// The newest state of each object, deletes as tombstones.
    State,
}

/// Producer compression codecs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaTlsConfig {
    /// PEM file of the CA that signed the brokers' certificates; unset means the system roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for mutual TLS (with `key_file`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Password of an encrypted `key_file`.
    #[serde(default)]
    pub key_password: Option<SecretRef>,
}

/// SASL authentication.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSaslConfig {
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`.
    pub mechanism: SaslMechanism,
    /// User name.
    pub username: String,
    /// Password.
    pub password: SecretRef,
}

/// SASL mechanisms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
}

impl SaslMechanism {
    /// librdkafka's name for the mechanism.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// Topic creation at start.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
];

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
            if RESERVED_PROPERTIES.contains(&name.as_str()) {
                err(
                    &format!("properties.{name}"),
                    "set by the sink itself (use brokers, sasl, tls)".into(),
                );
            }
        }
        if let Some(tls) = &self.tls {
            if tls.cert_file.is_some() != tls.key_file.is_some() {
                err("tls", "cert_file and key_file go together".into());
            }
            if let Some(reason) = tls.key_password.as_ref().and_then(SecretRef::problem) {
                err("tls.key_password", reason);
            }
        }
        if let Some(sasl) = &self.sasl
            && let Some(reason) = sasl.password.problem()
        {
            err("sasl.password", reason);
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
