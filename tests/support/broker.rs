//! The brokers a scenario runs on, behind one type: JetStream on a nats-server of the
//! scenario's own, or Kafka (the binary's shared node with a topic of the scenario's own, or
//! a node of its own). Each gives the replicas' sink config and reads back every message it
//! holds, so a scenario is written once and run on both.

use serde_json::{Value, json};

use super::{
    config::{NATS_STREAM, kafka_sink, nats_sink},
    kafka::{Kafka, consume_all},
    nats::{NatsServer, read_stream},
    wait::{self, PATIENCE, Patience},
};

/// One message as a consumer reads it, whichever the broker.
#[derive(Debug, Clone)]
pub struct Delivered {
    /// Kafka's record key; NATS's subject.
    pub key: String,
    /// Kafka's partition (NATS: 0, one stream).
    pub partition: i32,
    pub headers: Vec<(String, String)>,
    /// The value (Kafka) or payload (NATS), parsed.
    pub body: Value,
}

impl Delivered {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Partitions of a scenario's events topic.
const PARTITIONS: u32 = 3;
/// The events topic of cluster `test` with the default template.
pub const KAFKA_TOPIC: &str = "k8s.test.core.configmaps";

/// A Kafka node: the test binary's shared one ([`Kafka::shared`]) or a scenario's own.
pub enum KafkaNode {
    Shared(&'static Kafka),
    Own(Kafka),
}

impl std::ops::Deref for KafkaNode {
    type Target = Kafka;

    fn deref(&self) -> &Kafka {
        match self {
            Self::Shared(kafka) => kafka,
            Self::Own(kafka) => kafka,
        }
    }
}

/// Where a scenario's replicas publish, and how a consumer reads it back.
pub enum Broker {
    /// A nats-server of the scenario's own; the stream [`NATS_STREAM`].
    JetStream(NatsServer),
    /// A Kafka node and the events topic ([`PARTITIONS`] partitions); the sink's extra
    /// settings.
    Kafka(KafkaNode, String, Value),
}

impl Broker {
    /// A nats-server of the scenario's own.
    pub fn jetstream() -> Self {
        Self::JetStream(NatsServer::start())
    }

    /// The binary's shared Kafka node with a topic of this scenario's own: cluster `cluster`'s
    /// ConfigMaps, `k8s.{cluster}.core.configmaps`; checkpoints in `{topic}.checkpoints`.
    pub fn shared_kafka(cluster: &str) -> Self {
        let kafka = Kafka::shared();
        let topic = format!("k8s.{cluster}.core.configmaps");
        kafka.create_topic(&topic, PARTITIONS);
        let extra = json!({"topic": topic, "checkpoint_topic": format!("{topic}.checkpoints")});
        Self::Kafka(KafkaNode::Shared(kafka), topic, extra)
    }

    /// A Kafka node of the scenario's own, the default topic and checkpoint topic of cluster
    /// `test` ([`KAFKA_TOPIC`]).
    pub fn own_kafka() -> Self {
        let kafka = Kafka::start();
        // Before any replica: the reads look up the topic's partitions.
        kafka.create_topic(KAFKA_TOPIC, PARTITIONS);
        Self::Kafka(KafkaNode::Own(kafka), KAFKA_TOPIC.into(), json!({}))
    }

    /// `JetStream` or `Kafka`, for what a scenario prints.
    pub fn name(&self) -> &'static str {
        match self {
            Self::JetStream(_) => "JetStream",
            Self::Kafka(..) => "Kafka",
        }
    }

    /// The sink type: `nats` or `kafka` (what a scenario with one sink names it).
    pub fn sink_type(&self) -> &'static str {
        match self {
            Self::JetStream(_) => "nats",
            Self::Kafka(..) => "kafka",
        }
    }

    /// The replicas' sink `name`, with the tests' settings ([`nats_sink`], [`kafka_sink`]).
    pub fn sink(&self, name: &str) -> Value {
        match self {
            Self::JetStream(nats) => nats_sink(name, &nats.url(), json!({})),
            Self::Kafka(kafka, _, extra) => kafka_sink(name, &kafka.brokers(), extra.clone()),
        }
    }

    /// Sink `name` with `extra` settings in its broker's section besides the tests' ones.
    pub fn sink_with(&self, name: &str, extra: Value) -> Value {
        let mut sink = self.sink(name);
        let section = self.sink_type();
        for (k, v) in extra.as_object().expect("settings are an object") {
            sink[section][k] = v.clone();
        }
        sink
    }

    /// The prefix of CloudEvents attributes in binary mode's headers: `ce_` on Kafka, `ce-`
    /// on NATS (each protocol binding's own).
    pub fn ce_prefix(&self) -> &'static str {
        match self {
            Self::JetStream(_) => "ce-",
            Self::Kafka(..) => "ce_",
        }
    }

    /// Every message the broker holds with its key (or subject) and headers, in its order
    /// (per key: the order a consumer reads).
    pub async fn delivered(&self) -> Vec<Delivered> {
        match self {
            Self::JetStream(nats) => read_stream(&nats.url(), NATS_STREAM)
                .await
                .iter()
                .map(|m| Delivered {
                    key: m.subject.to_string(),
                    partition: 0,
                    headers: m
                        .headers
                        .iter()
                        .flat_map(|(k, vs)| {
                            vs.iter()
                                .map(move |v| (k.to_string(), v.as_str().to_owned()))
                        })
                        .collect(),
                    body: serde_json::from_slice(&m.payload).unwrap(),
                })
                .collect(),
            Self::Kafka(kafka, topic, _) => {
                let (brokers, topic) = (kafka.brokers(), topic.clone());
                tokio::task::spawn_blocking(move || {
                    consume_all(&brokers, &topic, PARTITIONS as i32)
                        .into_iter()
                        .map(|r| Delivered {
                            body: r.json(),
                            key: r.key,
                            partition: r.partition,
                            headers: r.headers,
                        })
                        .collect()
                })
                .await
                .unwrap()
            }
        }
    }

    /// [`Self::delivered`] once the broker holds at least `n` messages (waiting up to
    /// [`PATIENCE`]).
    pub async fn delivered_at_least(&self, n: usize) -> Vec<Delivered> {
        let what = format!("{n} messages on {}", self.name());
        let patience = Patience::of(PATIENCE).polling(std::time::Duration::from_millis(200));
        wait::until(&what, patience, async || self.delivered().await.len() >= n).await;
        self.delivered().await
    }

    /// Every message the broker holds, decoded, in its order (per key: the order a consumer
    /// reads; Kafka's partitions one after another).
    pub async fn read(&self) -> Vec<Value> {
        self.delivered().await.into_iter().map(|m| m.body).collect()
    }
}
