//! One `sinks[]` entry: a destination and how its routes deliver to it (queue bound,
//! workers, retries, rate limit, dead letters, resume). The destination's own settings are
//! the sink's (`sinks::kafka`, `sinks::nats`, `sinks::stdout`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{
    message::Encoding,
    pipeline::route::{
        DEFAULT_MAX_BYTES_IN_FLIGHT, DEFAULT_MAX_OBJECTS_IN_FLIGHT, DEFAULT_MAX_PENDING,
        DEFAULT_MAX_TRANSACTIONAL_BYTES_IN_FLIGHT, DEFAULT_MAX_TRANSACTIONAL_OBJECTS_IN_FLIGHT,
    },
    problems::Section,
    sinks::{kafka::KafkaSinkConfig, nats::NatsSinkConfig, stdout::StdoutSinkConfig},
    workqueue::rate_limiter::RetrySettings,
};

/// One sink: where notifications are published.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// Name that routes and metric labels use.
    pub name: String,
    /// Sink type; the section of the same name holds its settings.
    #[serde(rename = "type")]
    pub kind: SinkType,
    /// Most notifications waiting for this sink (all its routes together, being published
    /// included); beyond it, what arrives for an object with something pending is merged into
    /// it (one entry per object until a delete). Deletes and the newest state of each object
    /// are never dropped.
    #[serde(default = "default_max_pending")]
    pub max_pending: usize,
    /// Delivery workers per route (resource to this sink); each hands over one object's next
    /// message at a time and goes on to other objects, awaiting the acknowledgements of all
    /// it handed over at once (`max_objects_in_flight` bounds what is in flight), so more
    /// workers do not raise the throughput: 1024 instead of 8 made JetStream slower in the
    /// NATS bench.
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// Most objects with a message handed to this sink and not yet acknowledged (all its
    /// routes together); a worker takes the next object once one is acknowledged. Each
    /// holds its message at the broker client and a future awaiting the acknowledgement, so
    /// this bounds that memory during a first sync or a burst (objects
    /// waiting for their checkpoint intent hold no place: nothing of them is sent yet). Unset:
    /// 4096, or 32768 for a `kafka` sink with `exactly_once` (its objects stay in flight
    /// until their transaction commits).
    #[serde(default)]
    pub max_objects_in_flight: Option<usize>,
    /// Most bytes of messages handed to this sink and not yet acknowledged (all its routes
    /// together; a message counts its payload, key and attributes, and one larger than this
    /// goes alone). A notification waits for room before it is encoded, until
    /// acknowledgements make some. Large objects would reach `max_objects_in_flight` only at
    /// hundreds of MiB, and what waits at the broker client beyond what its batches need
    /// costs memory and CPU; a partition that does not answer holds its messages' room until
    /// `kafka.delivery_timeout`, the other partitions waiting once it is full. With 20 KB messages
    /// the Kafka bench spent 28-31 µs of CPU per message unbounded, 21-22 at 8 MiB and 16-18
    /// at 4 MiB, at the same throughput; 2 MiB starved librdkafka's batches (a quarter of the
    /// throughput). The default leaves room for a slower network than loopback. Unset: 8 MiB,
    /// or 128 MiB for a `kafka` sink with `exactly_once` (32 MiB halved its throughput at
    /// 20 KB: a transaction holds its messages until it commits).
    #[serde(default)]
    pub max_bytes_in_flight: Option<usize>,
    /// How failed publishes are retried.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Optional limit on publishes per second, to protect the destination.
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
    /// Name of another sink that receives a small reference record (id, key, reason, size)
    /// for every message that fails for good.
    #[serde(default)]
    pub dead_letter: Option<String>,
    /// Keep a checkpoint of what this sink acknowledged and resume from it at start and on
    /// becoming leader: changes made while down are published (deletes included), unchanged
    /// objects are not. For sinks that can store one: `kafka` (`kafka.checkpoint_topic`),
    /// `nats` in `jetstream` mode (`nats.checkpoint_bucket`) and `stdout` with a `path` (a
    /// file beside it); elsewhere it is ignored, with a log line.
    #[serde(default = "default_resume")]
    pub resume: bool,
    /// How often acknowledged changes are written to the checkpoint.
    #[serde(default = "default_checkpoint_interval", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub checkpoint_interval: Duration,
    /// Settings of a `stdout` sink.
    #[serde(default)]
    pub stdout: Option<StdoutSinkConfig>,
    /// Settings of a `nats` sink.
    #[serde(default)]
    pub nats: Option<NatsSinkConfig>,
    /// Settings of a `kafka` sink.
    #[serde(default)]
    pub kafka: Option<KafkaSinkConfig>,
}

impl SinkConfig {
    /// The CloudEvents content mode of this sink's messages.
    pub fn encoding(&self) -> Encoding {
        match (self.kind, &self.nats, &self.kafka) {
            (SinkType::Nats, Some(n), _) => n.encoding,
            (SinkType::Kafka, _, Some(k)) => k.message_encoding(),
            _ => Encoding::Structured,
        }
    }

    /// Its `max_objects_in_flight`, or the default for its kind: a transaction holds each
    /// object's acknowledgement until it commits (every `transaction_interval`, and the
    /// commit itself takes a while), so at 4,096 an `exactly_once` sink stalled at about
    /// 30,000 objects a second in the Kafka bench where 16,384 and up kept pace with no bound.
    pub fn objects_in_flight(&self) -> usize {
        self.max_objects_in_flight
            .unwrap_or(if self.is_transactional() {
                DEFAULT_MAX_TRANSACTIONAL_OBJECTS_IN_FLIGHT
            } else {
                DEFAULT_MAX_OBJECTS_IN_FLIGHT
            })
    }

    /// Its `max_bytes_in_flight`, or the default for its kind (see
    /// [`SinkConfig::objects_in_flight`]).
    pub fn bytes_in_flight(&self) -> usize {
        self.max_bytes_in_flight
            .unwrap_or(if self.is_transactional() {
                DEFAULT_MAX_TRANSACTIONAL_BYTES_IN_FLIGHT
            } else {
                DEFAULT_MAX_BYTES_IN_FLIGHT
            })
    }

    fn is_transactional(&self) -> bool {
        self.kind == SinkType::Kafka && self.kafka.as_ref().is_some_and(|k| k.exactly_once)
    }

    /// Checks this entry on its own (names and dead letters are checked across entries by
    /// [`Config::validate`](super::Config::validate)); paths relative to `sinks[i]`.
    pub fn validate(&self, p: &mut Section) {
        let sections = [
            (SinkType::Stdout, "stdout", self.stdout.is_some()),
            (SinkType::Nats, "nats", self.nats.is_some()),
            (SinkType::Kafka, "kafka", self.kafka.is_some()),
        ];
        for (kind, section, present) in sections {
            if present && self.kind != kind {
                p.add(
                    section,
                    format!("only a sink of type {section} takes this section"),
                );
            }
        }
        match (self.kind, &self.nats, &self.kafka) {
            (SinkType::Nats, None, _) => p.add(
                "nats",
                "a nats sink needs this section (at least `servers`)",
            ),
            (SinkType::Nats, Some(n), _) => {
                let mut at = p.at("nats");
                for (path, reason) in n.validate() {
                    at.add(&path, reason);
                }
            }
            (SinkType::Kafka, _, None) => p.add(
                "kafka",
                "a kafka sink needs this section (at least `brokers`)",
            ),
            (SinkType::Kafka, _, Some(k)) => {
                let mut at = p.at("kafka");
                for (path, reason) in k.validate() {
                    at.add(&path, reason);
                }
            }
            _ => {}
        }
        if self.max_pending == 0 {
            p.add("max_pending", "must be at least 1");
        }
        if self.workers == 0 {
            p.add("workers", "must be at least 1");
        }
        if self.max_objects_in_flight == Some(0) {
            p.add("max_objects_in_flight", "must be at least 1");
        }
        if self.max_bytes_in_flight == Some(0) {
            p.add("max_bytes_in_flight", "must be at least 1");
        }
        if self.checkpoint_interval < Duration::from_millis(10) {
            p.add(
                "checkpoint_interval",
                "must be at least 10ms (each interval writes a batch to the store)",
            );
        }
        if self.retry.base_delay.is_zero() || self.retry.base_delay > self.retry.max_delay {
            p.add(
                "retry.base_delay",
                "must be above 0 and at most retry.max_delay",
            );
        }
        if !(self.retry.qps > 0.0 && self.retry.qps.is_finite()) {
            p.add("retry.qps", "must be a positive number");
        }
        if self.retry.burst == 0 {
            p.add("retry.burst", "must be at least 1");
        }
        if let Some(limit) = &self.rate_limit {
            if !(limit.qps > 0.0 && limit.qps.is_finite()) {
                p.add("rate_limit.qps", "must be a positive number");
            }
            if limit.burst == 0 {
                p.add("rate_limit.burst", "must be at least 1");
            }
        }
    }
}

/// Retries of failed publishes: client-go's default controller rate limiter, max of a per-object
/// exponential backoff and an overall token bucket.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// First delay of an object's retries; it doubles with each failure.
    #[serde(default = "default_retry_base", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub base_delay: Duration,
    /// Longest delay of an object's retries.
    #[serde(default = "default_retry_max", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub max_delay: Duration,
    /// Retries per second over all objects of a route, after `burst`.
    #[serde(default = "default_retry_qps")]
    pub qps: f64,
    /// Retries allowed at once over all objects of a route.
    #[serde(default = "default_retry_burst")]
    pub burst: u32,
    /// Retries of one notification before it fails for good (and goes to the dead-letter
    /// sink); unset means retry forever.
    #[serde(default)]
    pub max_retries: Option<u32>,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            base_delay: default_retry_base(),
            max_delay: default_retry_max(),
            qps: default_retry_qps(),
            burst: default_retry_burst(),
            max_retries: None,
        }
    }
}

/// A publish rate limit.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Publishes per second, sustained.
    pub qps: f64,
    /// Publishes allowed at once after a quiet period.
    #[serde(default = "default_rate_limit_burst")]
    pub burst: u32,
}

/// Sink types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SinkType {
    /// JSON lines on standard output or in a file; needs no broker.
    Stdout,
    /// NATS subjects, JetStream (default) or core NATS.
    Nats,
    /// Kafka topics.
    Kafka,
}

// About 100 MB of 1 KB objects: a sink may lag by that much before updates are coalesced.
fn default_max_pending() -> usize {
    DEFAULT_MAX_PENDING
}
/// Resume is what makes restarts lose no delete, so it is on wherever a sink can store a
/// checkpoint.
fn default_resume() -> bool {
    true
}
/// One second bounds what a crash re-sends to a second's worth of acknowledgements.
fn default_checkpoint_interval() -> Duration {
    Duration::from_secs(1)
}
fn default_workers() -> usize {
    8
}
// client-go's DefaultControllerRateLimiter: 5 ms .. 1000 s per item, 10 qps burst 100 overall.
fn default_retry_base() -> Duration {
    RetrySettings::default().base
}
fn default_retry_max() -> Duration {
    RetrySettings::default().max
}
fn default_retry_qps() -> f64 {
    RetrySettings::default().qps
}
fn default_retry_burst() -> u32 {
    RetrySettings::default().burst
}
fn default_rate_limit_burst() -> u32 {
    1
}
