//! The checkpoint store of a `kafka` sink: a compacted topic (`checkpoint_topic`) with one
//! record per route and object. Key: the JSON array `["route", "namespace/name"]`; value:
//! `{"uid", "resourceVersion"}`; a tombstone (no value) once the object's delete was
//! acknowledged, so compaction forgets it.
//!
//! Writes go through the sink's own idempotent acks=all producer and complete when every
//! record's delivery report arrived. A load reads the topic from its first offset up to the
//! high watermark of each partition, last record per key winning.
//!
//! # Recovery
//! The end of a read is the high watermark, and also quiet: a partition that delivers nothing
//! for [`QUIET`] once at its watermark is done (some Kafka-protocol brokers report the
//! watermark of a multi-record batch late or early; nothing is taken as the end while records
//! still come).

use std::{collections::HashMap, time::Duration};

use futures::{FutureExt, future::BoxFuture};
use rdkafka::{
    ClientConfig, Message as _, Offset, TopicPartitionList,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{BaseConsumer, Consumer},
    error::RDKafkaErrorCode,
    producer::{FutureProducer, FutureRecord},
    util::Timeout,
};
use tracing::{info, warn};

use super::{KafkaSink, KafkaSinkConfig, sink::client_config};
use crate::{
    pipeline::checkpoint::{Change, Checkpoint, CheckpointStore, Entry, Error, Result},
    sinks,
};

/// How long the brokers get to answer metadata and admin requests.
const TIMEOUT: Duration = Duration::from_secs(10);
/// A partition at its high watermark that delivers nothing for this long is read to its end.
const QUIET: Duration = Duration::from_millis(500);
/// A read that delivers nothing at all for this long ends, whatever the watermark says.
const STALL: Duration = Duration::from_secs(10);

/// See the module docs.
pub struct KafkaCheckpointStore {
    topic: String,
    producer: FutureProducer,
    consumer: ClientConfig,
}

impl KafkaCheckpointStore {
    /// The store of sink `name`, writing through `sink`'s producer. Creates the topic when it
    /// does not exist; a topic that cannot be created or described fails the start, naming it.
    pub async fn open(name: &str, cfg: &KafkaSinkConfig, sink: &KafkaSink) -> sinks::Result<Self> {
        let topic = cfg.checkpoint_topic.clone();
        let setup = |what: String| {
            sinks::Error::Setup(format!("sink {name}: checkpoint topic {topic}: {what}"))
        };
        let mut consumer = client_config(name, cfg).map_err(&setup)?;
        for producer_only in [
            "enable.idempotence",
            "acks",
            "compression.type",
            "linger.ms",
            "message.timeout.ms",
        ] {
            consumer.remove(producer_only);
        }
        consumer
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .set("group.id", format!("kube-event-bridge-{name}-checkpoints"));
        let producer = sink.producer().clone();
        let exists = {
            let (producer, topic) = (producer.clone(), topic.clone());
            tokio::task::spawn_blocking(move || {
                use rdkafka::producer::Producer;
                producer
                    .client()
                    .fetch_metadata(Some(&topic), TIMEOUT)
                    .is_ok_and(|m| {
                        m.topics()
                            .iter()
                            .any(|t| t.error().is_none() && !t.partitions().is_empty())
                    })
            })
            .await
            .unwrap_or(false)
        };
        if exists {
            return Ok(Self {
                topic,
                producer,
                consumer,
            });
        }
        let admin: AdminClient<DefaultClientContext> = client_config(name, cfg)
            .map_err(&setup)?
            .create()
            .map_err(|e| setup(format!("admin client: {e}")))?;
        let replication = cfg
            .create_topics
            .as_ref()
            .map_or(1, |t| t.replication_factor);
        let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(replication))
            .set("cleanup.policy", "compact");
        let options = AdminOptions::new().operation_timeout(Some(TIMEOUT));
        match admin.create_topics([&new], &options).await {
            Ok(results) => match results.into_iter().next() {
                Some(Ok(_)) => info!(sink = %name, topic = %topic, "Created the checkpoint topic"),
                Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => {}
                Some(Err((_, code))) => {
                    return Err(setup(format!(
                        "cannot create it ({code}); create it (cleanup.policy=compact) or grant \
                         this client CREATE on it, and READ, WRITE and DESCRIBE"
                    )));
                }
            },
            Err(e) => return Err(setup(format!("cannot create it: {e}"))),
        }
        Ok(Self {
            topic,
            producer,
            consumer,
        })
    }

    fn error(&self, reason: impl std::fmt::Display) -> Error {
        Error::Store {
            store: self.describe(),
            reason: reason.to_string(),
        }
    }

    /// Reads the whole topic (blocking; run it off the async threads): for each route, its
    /// entries, and whether any record ever named it.
    fn read_all(&self) -> Result<HashMap<String, Checkpoint>> {
        let consumer: BaseConsumer = self
            .consumer
            .create()
            .map_err(|e| self.error(format!("consumer: {e}")))?;
        let metadata = consumer
            .fetch_metadata(Some(&self.topic), TIMEOUT)
            .map_err(|e| {
                self.error(format!(
                    "metadata: {e} (does this client have DESCRIBE and READ on it?)"
                ))
            })?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        let mut assignment = TopicPartitionList::new();
        let mut high = HashMap::new();
        for p in &partitions {
            let (_, hi) = consumer
                .fetch_watermarks(&self.topic, *p, TIMEOUT)
                .map_err(|e| self.error(format!("watermarks of partition {p}: {e}")))?;
            high.insert(*p, hi);
            assignment
                .add_partition_offset(&self.topic, *p, Offset::Beginning)
                .map_err(|e| self.error(e))?;
        }
        consumer
            .assign(&assignment)
            .map_err(|e| self.error(format!("assign: {e}")))?;
        let mut next: HashMap<i32, i64> = partitions.iter().map(|p| (*p, 0)).collect();
        let mut routes: HashMap<String, Checkpoint> = HashMap::new();
        let mut last_record = std::time::Instant::now();
        loop {
            let done = next.iter().all(|(p, n)| *n >= high[p]);
            if done && last_record.elapsed() >= QUIET {
                break;
            }
            if last_record.elapsed() >= STALL {
                warn!(store = %self.describe(), "Checkpoint read stalled before the high watermark; using what was read");
                break;
            }
            let Some(result) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = result.map_err(|e| self.error(format!("read: {e}")))?;
            last_record = std::time::Instant::now();
            next.insert(m.partition(), m.offset() + 1);
            let Some(key) = m.key() else { continue };
            let Ok((route, key)) = serde_json::from_slice::<(String, String)>(key) else {
                warn!(store = %self.describe(), key = %String::from_utf8_lossy(key), "Checkpoint record with an unreadable key; skipped");
                continue;
            };
            let entries = routes.entry(route.clone()).or_default();
            match m.payload() {
                None => {
                    entries.remove(&key);
                }
                Some(value) => match serde_json::from_slice::<Entry>(value) {
                    Ok(entry) => {
                        entries.insert(key, entry);
                    }
                    Err(e) => {
                        warn!(store = %self.describe(), route = %route, key = %key, error = %e,
                              "Corrupt checkpoint record; that object is treated as unknown");
                        entries.remove(&key);
                    }
                },
            }
        }
        Ok(routes)
    }
}

impl CheckpointStore for KafkaCheckpointStore {
    fn describe(&self) -> String {
        format!("topic {}", self.topic)
    }

    fn load<'a>(&'a self, route: &'a str) -> BoxFuture<'a, Result<Option<Checkpoint>>> {
        async move {
            let this = Self {
                topic: self.topic.clone(),
                producer: self.producer.clone(),
                consumer: self.consumer.clone(),
            };
            let mut all = tokio::task::spawn_blocking(move || this.read_all())
                .await
                .map_err(|e| self.error(e))??;
            Ok(all.remove(route))
        }
        .boxed()
    }

    fn write<'a>(&'a self, route: &'a str, changes: Vec<Change>) -> BoxFuture<'a, Result<()>> {
        async move {
            let records: Vec<(String, Option<String>)> = changes
                .into_iter()
                .map(|(key, entry)| {
                    let k = serde_json::to_string(&(route, &key)).expect("strings serialize");
                    let v = entry.map(|e| serde_json::to_string(&e).expect("strings serialize"));
                    (k, v)
                })
                .collect();
            let sends = records.iter().map(|(k, v)| {
                let mut record = FutureRecord::<String, String>::to(&self.topic).key(k);
                if let Some(v) = v {
                    record = record.payload(v);
                }
                self.producer.send(record, Timeout::After(TIMEOUT))
            });
            for result in futures::future::join_all(sends).await {
                result.map_err(|(e, _)| self.error(e))?;
            }
            Ok(())
        }
        .boxed()
    }
}
