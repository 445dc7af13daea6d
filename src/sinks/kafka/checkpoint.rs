//! The checkpoint store of a `kafka` sink: a compacted topic (`checkpoint_topic`) with one
//! record per route and object. Key: the JSON array `["route", "namespace/name"]`; value:
//! `{"uid", "resourceVersion"}`; a tombstone (no value) once the object's delete was
//! acknowledged, so compaction forgets it.
//!
//! Writes go through the sink's own idempotent acks=all producer and complete when every
//! record's delivery report arrived. With `exactly_once`, every record goes in the sink's
//! transactions instead (see [`super::transactions`]); reads are `read_committed` always. A load reads the topic from its first offset to its end
//! ([`super::reader`]), last record per key winning.

use std::collections::HashMap;

use futures::{FutureExt, future::BoxFuture};
use rdkafka::{
    admin::{AdminOptions, NewTopic, TopicReplication},
    error::RDKafkaErrorCode,
    producer::FutureRecord,
};
use tracing::info;

use std::sync::Arc;

use super::{
    client::{KafkaClient, SinkProducer},
    config::KafkaSinkConfig,
    reader::{Record, TIMEOUT, read_to_end_closing_later},
    record::{CheckpointRecord, record_of},
    sink::KafkaSink,
    transactions::TransactionSet,
};
use crate::{
    sinks,
    sinks::checkpoint::{Change, Checkpoint, CheckpointStore, Entry, Error, Result},
};

/// See the module docs.
pub struct KafkaCheckpointStore {
    topic: String,
    producer: SinkProducer,
    consumer: KafkaClient,
    // With `exactly_once`: writes go in the sink's open transaction of the route's shard.
    transactions: Option<Arc<TransactionSet>>,
}

impl KafkaCheckpointStore {
    /// The store of sink `name`, writing through `sink`'s producer. Creates the topic when it
    /// does not exist; a topic that cannot be created or described fails the start, naming it.
    pub async fn open(name: &str, cfg: &KafkaSinkConfig, sink: &KafkaSink) -> sinks::Result<Self> {
        let topic = cfg.checkpoint_topic.clone();
        let setup = |what: String| {
            sinks::Error::Setup(format!("sink {name}: checkpoint topic {topic}: {what}"))
        };
        let consumer = sink.client().clone();
        let producer = sink.producer().clone();
        let transactions = sink.transactions().cloned();
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
                transactions,
            });
        }
        let admin = tokio::task::spawn_blocking({
            let client = sink.client().clone();
            move || client.admin()
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|made| made)
        .map_err(&setup)?;
        let replication = cfg
            .create_topics
            .as_ref()
            .map_or(1, |t| t.replication_factor);
        let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(replication))
            .set("cleanup.policy", "compact");
        let options = AdminOptions::new().operation_timeout(Some(TIMEOUT));
        let created = admin.create_topics([&new], &options).await;
        super::client::close_later(admin);
        match created {
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
            transactions,
        })
    }

    fn error(&self, reason: impl std::fmt::Display) -> Error {
        Error::Store {
            store: self.describe(),
            reason: reason.to_string(),
        }
    }

    /// Reads the whole topic: the entries of the routes `wanted` names (a record of another
    /// route is only looked at for its key). The consumer reads and parses keys on a blocking
    /// thread and hands the records over in batches, so that only the wanted routes' entries
    /// are ever held (a read for another route's sake, as the search for kinds no longer
    /// served, holds none of them).
    async fn read_all(&self, wanted: impl Fn(&str) -> bool) -> Result<Read> {
        const BATCH: usize = 1024;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<Parsed>>(4);
        let (consumer, topic) = (self.consumer.clone(), self.topic.clone());
        let reading = tokio::task::spawn_blocking(move || {
            let mut batch = Vec::with_capacity(BATCH);
            read_to_end_closing_later(&consumer, std::slice::from_ref(&topic), |r| {
                batch.push(Parsed::from(r));
                if batch.len() == BATCH {
                    // The receiver stays until the read ends (below), unless the load was
                    // dropped: the read then goes to its end unheard.
                    let _ =
                        tx.blocking_send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)));
                }
            })?;
            let _ = tx.blocking_send(batch);
            Ok::<_, String>(())
        });
        let mut read = Read::default();
        while let Some(batch) = rx.recv().await {
            batch.into_iter().for_each(|p| read.add(p, &wanted));
        }
        reading
            .await
            .map_err(|e| self.error(e))?
            .map_err(|e| self.error(e))?;
        Ok(read)
    }
}

/// One record of the checkpoint topic, parsed.
enum Parsed {
    /// A tombstone of a key that is not ours: it removes nothing of ours.
    Ignored,
    /// A record whose key is not `[route, key]`.
    Unreadable(String),
    /// A record of `key` in `route`: its value (parsed only if the route is wanted), none for
    /// a tombstone.
    Keyed {
        route: String,
        key: String,
        value: Option<Vec<u8>>,
    },
}

impl From<Record> for Parsed {
    fn from(r: Record) -> Self {
        let Ok((route, key)) = serde_json::from_slice::<(String, String)>(&r.key) else {
            return match r.value {
                None => Self::Ignored,
                Some(_) => Self::Unreadable(String::from_utf8_lossy(&r.key).into_owned()),
            };
        };
        Self::Keyed {
            route,
            key,
            value: r.value,
        }
    }
}

/// What one pass over the checkpoint topic found.
#[derive(Default)]
struct Read {
    routes: HashMap<String, Checkpoint>,
    /// Per route, keys whose newest record is corrupt, and why.
    corrupt: HashMap<String, HashMap<String, String>>,
    /// A record whose key is not `[route, key]`.
    unreadable_key: Option<String>,
    /// Whether the read keeps a route's entries, once asked (asked once per route, not per
    /// record: the callers' filters compare names with every route they serve).
    wanted: HashMap<String, bool>,
}

impl Read {
    /// Takes in the next record read (in offset order per key), if `wanted` names its route.
    fn add(&mut self, record: Parsed, wanted: impl Fn(&str) -> bool) {
        let (route, key, entry) = match record {
            Parsed::Ignored => return,
            Parsed::Unreadable(key) => {
                self.unreadable_key.get_or_insert(key);
                return;
            }
            Parsed::Keyed { route, key, value } => (route, key, value),
        };
        let keep = match self.wanted.get(&route) {
            Some(&keep) => keep,
            None => *self
                .wanted
                .entry(route.clone())
                .or_insert_with(|| wanted(&route)),
        };
        if !keep {
            return;
        }
        let entries = self.routes.entry(route.clone()).or_default();
        let corrupt = self.corrupt.entry(route).or_default();
        // The newest record of a key decides: a later one mends a corrupt one.
        corrupt.remove(&key);
        match entry.map(|v| serde_json::from_slice::<Entry>(&v)) {
            None => {
                entries.remove(&key);
            }
            Some(Ok(entry)) => {
                entries.insert(key, entry);
            }
            Some(Err(e)) => {
                entries.remove(&key);
                corrupt.insert(key, e.to_string());
            }
        }
    }
}

impl CheckpointStore for KafkaCheckpointStore {
    fn describe(&self) -> String {
        format!("topic {}", self.topic)
    }

    fn load_family<'a>(
        &'a self,
        routes: &'a [String],
        also: &'a (dyn Fn(&str) -> bool + Send + Sync),
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>> {
        async move {
            let wanted = |route: &str| routes.iter().any(|r| r == route) || also(route);
            for t in self.transactions.iter().flat_map(|set| set.all()) {
                // What the open transactions hold first (a route re-wired mid-term loads its
                // checkpoint while others publish): a read_committed read would miss it, and
                // the resume would send those objects again.
                let _ = t.commit().await;
            }
            let read = self.read_all(wanted).await?;
            // A checkpoint with a record that cannot be read is incomplete: never guess.
            if let Some(key) = read.unreadable_key {
                return Err(self.error(format!(
                    "a record's key ({key:?}) is not a checkpoint key, so the checkpoint of \
                     any route may be incomplete; write a tombstone for that key (or keep the \
                     topic for checkpoints only) to go on"
                )));
            }
            for (route, corrupt) in &read.corrupt {
                if let Some((key, e)) = corrupt.iter().next() {
                    return Err(self.error(format!(
                        "route {route}: the newest record of {key} is corrupt ({e}), so the \
                         checkpoint is incomplete; write a tombstone for that key to go on \
                         (its object is then published as added)"
                    )));
                }
            }
            Ok(read.routes)
        }
        .boxed()
    }

    fn write<'a>(&'a self, route: &'a str, changes: Vec<Change>) -> BoxFuture<'a, Result<()>> {
        let records = changes.into_iter().map(|c| record_of(route, c)).collect();
        self.send(route, records).boxed()
    }

    fn write_routes<'a>(
        &'a self,
        owner: &'a str,
        writes: Vec<(String, Vec<Change>)>,
    ) -> BoxFuture<'a, Result<()>> {
        async move {
            if self.transactions.is_none() {
                // Route after route, each acknowledged before the next is sent: a removal
                // never lands without what it moved.
                for (route, changes) in writes {
                    self.write(&route, changes).await?;
                }
                return Ok(());
            }
            let records = writes
                .into_iter()
                .flat_map(|(route, changes)| {
                    changes
                        .into_iter()
                        .map(move |c| record_of(&route, c))
                        .collect::<Vec<_>>()
                })
                .collect();
            self.send(owner, records).await
        }
        .boxed()
    }
}

impl KafkaCheckpointStore {
    /// Writes `records` on behalf of route `owner`: with `exactly_once` in the open
    /// transaction of its shard, otherwise straight, each acknowledged.
    async fn send(&self, owner: &str, records: Vec<CheckpointRecord>) -> Result<()> {
        if let Some(set) = &self.transactions {
            // With the shard's next commit (only the cluster's identity and records taken
            // over from other shard counts are written so: the messages' records travel with
            // them); without its term, by the next term.
            if let Some(t) = set.get(set.key_of_route(owner)) {
                records.into_iter().for_each(|r| t.settle(r));
            }
            return Ok(());
        }
        let sends = records.iter().map(|(k, v)| {
            let mut record = FutureRecord::<String, String>::to(&self.topic).key(k);
            if let Some(v) = v {
                record = record.payload(v);
            }
            self.producer.send_copied(record, TIMEOUT)
        });
        for result in futures::future::join_all(sends).await {
            result.map_err(|e| self.error(e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, value: Option<&str>) -> Record {
        Record {
            topic: "checkpoints".into(),
            partition: 0,
            offset: 0,
            key: key.as_bytes().to_vec(),
            value: value.map(|v| v.as_bytes().to_vec()),
            headers: Vec::new(),
        }
    }

    /// A read keeps the entries of the routes asked for only, with the newest record of each
    /// key deciding; a record of another route is still looked at for its key.
    #[test]
    fn a_read_keeps_only_the_routes_asked_for() {
        let entry = |rv: &str| format!(r#"{{"uid":"u","resourceVersion":"{rv}"}}"#);
        let wanted = |route: &str| route == "configmap/a";
        let mut read = Read::default();
        for r in [
            record(r#"["configmap/a","ns/one"]"#, Some(&entry("1"))),
            record(r#"["configmap/b","ns/one"]"#, Some(&entry("1"))),
            record(r#"["configmap/a","ns/two"]"#, Some("not json")),
            record(r#"["configmap/b","ns/two"]"#, Some("not json")),
            record(r#"["configmap/a","ns/one"]"#, Some(&entry("2"))),
            record(r#"["configmap/a","ns/three"]"#, Some(&entry("1"))),
            record(r#"["configmap/a","ns/three"]"#, None),
        ] {
            read.add(r.into(), wanted);
        }
        assert_eq!(read.routes.keys().collect::<Vec<_>>(), ["configmap/a"]);
        let a = &read.routes["configmap/a"];
        assert_eq!(a.len(), 1, "ns/two is corrupt, ns/three deleted: {a:?}");
        assert_eq!(a["ns/one"].resource_version, "2");
        assert_eq!(read.corrupt.keys().collect::<Vec<_>>(), ["configmap/a"]);
        assert!(read.corrupt["configmap/a"].contains_key("ns/two"));
        assert!(read.unreadable_key.is_none());
        // A key that is not [route, key] makes every route's checkpoint suspect.
        read.add(record("plain", Some("x")).into(), wanted);
        assert_eq!(read.unreadable_key.as_deref(), Some("plain"));
    }
}
