//! `kube-event-bridge state`: the objects a sink's destination holds, rebuilt as a consumer
//! would, printed like `kubectl get` or as JSON; `--check` compares them with the live API
//! server, the check an operator wants after an incident.
//!
//! Messages are folded as a consumer reads them: per object, in the order the destination
//! holds them (partition offset, stream sequence), the last one wins; resourceVersions are
//! never compared (they are opaque). Two consumer models are folded side by side: one that
//! keeps every message ("last message wins") and one that first skips a message whose id it
//! has seen ("deduplicate by id, then last message wins"); `--check` reports both.
//!
//! - A Kafka state topic (`mode: state`): read from offset 0, last value per key, tombstones
//!   drop the key. Objects are placed by topic.
//! - A JetStream stream: every event of the sink's subjects, in stream order; `deleted` drops
//!   the object. Objects are placed by resource (`configmaps`, `widgets.example.com`). Only
//!   what the stream still holds can be rebuilt: an object whose events its limits
//!   (`max_age`, `max_bytes`) removed is missing, and the command warns when the stream has
//!   dropped messages.

use std::collections::{BTreeMap, BTreeSet};

use kube::{
    Api, Client,
    api::{DynamicObject, ListParams},
};
use serde_json::Value;

use super::{
    Error, NatsSource, Result, event::Summary, find_sink, kafka_topics, progress::Progress,
};
use crate::{
    config::{Config, SinkType},
    message::{Encoder, Encoding},
    selection,
    sinks::{
        kafka::{KafkaClient, KafkaMode, KafkaSink, KafkaSinkConfig, reader::read_to_end},
        nats::{NatsMode, NatsSinkConfig},
    },
};

/// The objects a destination holds, by (place, key): place is the topic for Kafka, the
/// resource for JetStream.
#[derive(Debug, Clone, Default)]
pub struct State {
    /// What the place is: `TOPIC` or `RESOURCE`.
    pub place: &'static str,
    /// The objects, as a consumer that keeps every message ends with them.
    pub objects: BTreeMap<(String, String), Value>,
    /// Where a consumer that skips a message whose id it has seen ends elsewhere: its object
    /// there (`None`: deleted).
    pub deduplicated: BTreeMap<(String, String), Option<Value>>,
}

impl State {
    /// The objects as a consumer that deduplicates by id ends with them.
    pub fn deduplicated_objects(&self) -> BTreeMap<(String, String), Value> {
        let mut objects = self.objects.clone();
        for (place, object) in &self.deduplicated {
            match object {
                Some(o) => objects.insert(place.clone(), o.clone()),
                None => objects.remove(place),
            };
        }
        objects
    }
}

/// What `--check` found, for each consumer model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Differences {
    /// For a consumer that keeps every message.
    pub last_wins: Vec<Difference>,
    /// For a consumer that skips a message whose id it has seen.
    pub deduplicated: Vec<Difference>,
}

impl Differences {
    /// Whether both models end with the cluster's objects.
    pub fn is_empty(&self) -> bool {
        self.last_wins.is_empty() && self.deduplicated.is_empty()
    }
}

/// What `--check` found for one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// In the cluster, not at the destination.
    Missing {
        /// The topic (Kafka) or resource (JetStream) it should be in.
        topic: String,
        /// `namespace/name`.
        key: String,
        /// Its resourceVersion in the cluster.
        cluster_rv: String,
    },
    /// At the destination, gone from the cluster (a delete that never reached it).
    Gone {
        /// The topic (Kafka) or resource (JetStream).
        topic: String,
        /// `namespace/name`.
        key: String,
        /// Its resourceVersion on the topic.
        topic_rv: String,
    },
    /// On both, with other resourceVersions.
    Stale {
        /// The topic (Kafka) or resource (JetStream).
        topic: String,
        /// `namespace/name`.
        key: String,
        /// Its resourceVersion on the topic.
        topic_rv: String,
        /// Its resourceVersion in the cluster.
        cluster_rv: String,
    },
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing {
                topic,
                key,
                cluster_rv,
            } => {
                write!(
                    f,
                    "MISSING {key}: in the cluster at {cluster_rv}, not on {topic}"
                )
            }
            Self::Gone {
                topic,
                key,
                topic_rv,
            } => {
                write!(
                    f,
                    "GONE    {key}: on {topic} at {topic_rv}, deleted from the cluster"
                )
            }
            Self::Stale {
                topic,
                key,
                topic_rv,
                cluster_rv,
            } => write!(
                f,
                "STALE   {key}: on {topic} at {topic_rv}, in the cluster at {cluster_rv}"
            ),
        }
    }
}

/// The destination `state` reads.
enum Destination<'a> {
    /// A Kafka state topic.
    Kafka(&'a KafkaSinkConfig),
    /// A JetStream stream.
    JetStream(&'a NatsSinkConfig),
}

fn destination<'a>(config: &'a Config, sink: &str) -> Result<Destination<'a>> {
    let s = find_sink(config, sink)?;
    match (s.kind, s.kafka.as_ref(), s.nats.as_ref()) {
        (SinkType::Kafka, Some(k), _) if k.mode == KafkaMode::State => Ok(Destination::Kafka(k)),
        (SinkType::Kafka, _, _) => Err(Error::Usage(format!(
            "sink {sink} writes events, not state: state reads Kafka state topics \
             (kafka.mode: state) and JetStream streams"
        ))),
        (SinkType::Nats, _, Some(n)) if n.mode == NatsMode::Jetstream => {
            Ok(Destination::JetStream(n))
        }
        (SinkType::Nats, _, _) => Err(Error::Usage(format!(
            "sink {sink} publishes with core NATS, which keeps no messages to rebuild state from"
        ))),
        _ => Err(Error::Usage(format!(
            "sink {sink} is a stdout sink; state reads Kafka state topics and JetStream streams"
        ))),
    }
}

/// Reads the objects `sink`'s destination holds: for Kafka, the state topics `topics` (or
/// every topic on the brokers whose name its topic template can render with the config's
/// cluster name); for JetStream, the stream's events of `subject` (or of every subject the
/// sink publishes to).
pub async fn read(
    config: &Config,
    sink: &str,
    topics: &[String],
    subject: Option<&str>,
    progress: &mut Progress,
) -> Result<State> {
    match destination(config, sink)? {
        Destination::Kafka(cfg) => {
            if subject.is_some() {
                return Err(Error::Usage(format!(
                    "sink {sink} is a kafka sink: name topics with --topic, not --subject"
                )));
            }
            read_kafka(sink, cfg, &config.cluster, topics, progress).await
        }
        Destination::JetStream(cfg) => {
            if !topics.is_empty() {
                return Err(Error::Usage(format!(
                    "sink {sink} is a nats sink: name subjects with --subject, not --topic"
                )));
            }
            read_jetstream(sink, cfg, subject, progress).await
        }
    }
}

async fn read_kafka(
    sink: &str,
    cfg: &KafkaSinkConfig,
    cluster: &str,
    topics: &[String],
    progress: &mut Progress,
) -> Result<State> {
    let client = KafkaClient::new(sink, cfg).map_err(Error::Read)?;
    let topics = kafka_topics(sink, cfg, cluster, &client, topics).await?;
    let mut p = std::mem::replace(progress, Progress::with("records", false));
    let (state, p) = tokio::task::spawn_blocking(move || {
        let mut fold = Fold::default();
        read_to_end(&client, &topics, |r| {
            p.add(1);
            let key = String::from_utf8_lossy(&r.key).into_owned();
            let id = r
                .headers
                .iter()
                .find(|(k, _)| k == "ce_id")
                .map(|(_, v)| v.clone());
            let object = match r.value.map(|v| serde_json::from_slice::<Value>(&v)) {
                Some(Ok(object)) => Some(object),
                Some(Err(e)) => {
                    // The newest value cannot be read: no state is claimed for the key (a
                    // --check then reports it), and the reason is shown.
                    tracing::warn!(topic = %r.topic, key = %key, error = %e,
                                   "State record is not a JSON object; its key is left out");
                    None
                }
                None => None,
            };
            fold.apply((r.topic, key), id.as_deref(), object);
        })
        .map(|()| (fold.into_state("TOPIC"), p))
        .map_err(Error::Read)
    })
    .await
    .map_err(|e| Error::Read(e.to_string()))??;
    *progress = p;
    Ok(state)
}

async fn read_jetstream(
    sink: &str,
    cfg: &NatsSinkConfig,
    subject: Option<&str>,
    progress: &mut Progress,
) -> Result<State> {
    use async_nats::jetstream::consumer::DeliverPolicy;
    use futures::StreamExt;
    let source = NatsSource::connect(sink, cfg, subject).await?;
    let (mut stream, consumer) = source.jetstream(sink, cfg, DeliverPolicy::All).await?;
    let stream_name = stream.cached_info().config.name.clone();
    let read_error = |e: &dyn std::fmt::Display| Error::Read(format!("stream {stream_name}: {e}"));
    let info = stream.info().await.map_err(|e| read_error(&e))?;
    if info.state.first_sequence > 1 {
        tracing::warn!(stream = %stream_name, first_sequence = info.state.first_sequence,
            "The stream's limits removed its oldest messages: objects whose newest event was \
             among them are missing from the state");
    }
    // How many messages there are now: the read knows its end.
    let pending = consumer.cached_info().num_pending;
    let mut fold = Fold::default();
    if pending > 0 {
        let mut messages = consumer.messages().await.map_err(|e| read_error(&e))?;
        for _ in 0..pending {
            let m = messages
                .next()
                .await
                .ok_or_else(|| read_error(&"the read ended early"))?
                .map_err(|e| read_error(&e))?;
            progress.add(1);
            match source.decode(m.headers.as_ref(), &m.payload) {
                Ok(event) => fold.apply_event(event),
                Err(e) => {
                    let seq = m.info().map(|i| i.stream_sequence).unwrap_or_default();
                    tracing::warn!(stream = %stream_name, sequence = seq, error = %e,
                                   "Message cannot be read; skipped");
                }
            }
        }
    }
    Ok(fold.into_state("RESOURCE"))
}

/// Messages folded per object in the order they are read, in both consumer models.
#[derive(Debug, Default)]
struct Fold {
    /// Last message wins: the object, `None` once deleted.
    last: BTreeMap<(String, String), Option<std::sync::Arc<Value>>>,
    /// Deduplicate by id, then last message wins.
    deduplicated: BTreeMap<(String, String), Option<std::sync::Arc<Value>>>,
    /// Hashes of the ids read.
    seen: std::collections::HashSet<u64>,
}

impl Fold {
    /// Folds a message about the object at `place` with `id` (when it has one); `object`
    /// `None` is a delete.
    fn apply(&mut self, place: (String, String), id: Option<&str>, object: Option<Value>) {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let object = object.map(std::sync::Arc::new);
        let first = id.is_none_or(|id| {
            self.seen
                .insert(BuildHasherDefault::<DefaultHasher>::default().hash_one(id))
        });
        if first {
            self.deduplicated.insert(place.clone(), object.clone());
        }
        self.last.insert(place, object);
    }

    /// Folds one CloudEvent.
    fn apply_event(&mut self, event: Value) {
        let s = Summary::of(&event);
        let place = (s.resource_name(), s.key());
        let gone = s.event_type == "deleted" || event["k8sfilteredout"] == true;
        let object = event
            .get("data")
            .and_then(|d| d.get("object"))
            .filter(|_| !gone)
            .cloned();
        let id = event["id"].as_str().map(str::to_owned);
        self.apply(place, id.as_deref(), object);
    }

    fn into_state(self, place: &'static str) -> State {
        let same = |a: &Option<std::sync::Arc<Value>>,
                    b: Option<&Option<std::sync::Arc<Value>>>| {
            match (a, b) {
                (Some(a), Some(Some(b))) => std::sync::Arc::ptr_eq(a, b) || a == b,
                (None, Some(None)) | (None, None) => true,
                _ => false,
            }
        };
        let mut deduplicated = BTreeMap::new();
        for (p, o) in &self.deduplicated {
            if !same(o, self.last.get(p)) {
                deduplicated.insert(p.clone(), o.as_deref().cloned());
            }
        }
        drop(self.deduplicated);
        let objects = self
            .last
            .into_iter()
            .filter_map(|(p, o)| Some((p, std::sync::Arc::unwrap_or_clone(o?))))
            .collect();
        State {
            place,
            objects,
            deduplicated,
        }
    }
}

fn rv(object: &Value) -> String {
    object["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// `kubectl get`-like lines: `TOPIC|RESOURCE NAMESPACE NAME RESOURCEVERSION AGE`.
pub fn table(state: &State, now: jiff::Timestamp) -> String {
    let mut rows = vec![[
        state.place.to_owned(),
        "NAMESPACE".to_owned(),
        "NAME".to_owned(),
        "RESOURCEVERSION".to_owned(),
        "AGE".to_owned(),
    ]];
    for ((topic, _), object) in &state.objects {
        let meta = &object["metadata"];
        let age = meta["creationTimestamp"]
            .as_str()
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
            .map_or("<unknown>".to_owned(), |t| age(now.duration_since(t)));
        rows.push([
            topic.clone(),
            meta["namespace"].as_str().unwrap_or("").to_owned(),
            meta["name"].as_str().unwrap_or("").to_owned(),
            rv(object),
            age,
        ]);
    }
    let widths: Vec<usize> = (0..5)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            let cells: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            cells.join("   ").trim_end().to_owned() + "\n"
        })
        .collect()
}

/// kubectl's short ages: `45s`, `12m`, `5h`, `3d`.
fn age(d: jiff::SignedDuration) -> String {
    let s = d.as_secs().max(0);
    match s {
        0..120 => format!("{s}s"),
        120..7_200 => format!("{}m", s / 60),
        7_200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// Where an object of a resource is placed in a [`State`].
enum Placer {
    /// By Kafka topic.
    Topic(Box<KafkaSink>),
    /// By resource name (`configmaps`, `widgets.example.com`).
    Resource,
}

/// Compares `state` with the objects the API server holds for every resource routed to
/// `sink`, placed as the state places them.
pub async fn check(
    config: &Config,
    client: &Client,
    sink: &str,
    state: &State,
) -> Result<Differences> {
    let placer = match destination(config, sink)? {
        Destination::Kafka(cfg) => Placer::Topic(Box::new(KafkaSink::connect(sink, cfg).await?)),
        Destination::JetStream(_) => Placer::Resource,
    };
    let mut cluster: BTreeMap<(String, String), String> = BTreeMap::new();
    let mut topics = BTreeSet::new();
    for (index, r) in config.resources.iter().enumerate() {
        let name = r.effective_name();
        if !config
            .routes
            .iter()
            .any(|rt| rt.resource == name && rt.sinks.iter().any(|s| s == sink))
        {
            continue;
        }
        for resolved in selection::resolve_all(client, index, r).await?.kinds {
            let resource_name = if resolved.api_resource.group.is_empty() {
                resolved.api_resource.plural.clone()
            } else {
                format!(
                    "{}.{}",
                    resolved.api_resource.plural, resolved.api_resource.group
                )
            };
            let encoder = Encoder::new(
                &config.cluster,
                &resolved.api_resource,
                &config.message,
                Encoding::State,
            );
            let mut params = ListParams::default();
            if let Some(l) = &r.label_selector {
                params = params.labels(l);
            }
            if let Some(f) = &r.field_selector {
                params = params.fields(f);
            }
            let apis: Vec<Api<DynamicObject>> = if r.namespaces.is_empty() {
                vec![Api::all_with(client.clone(), &resolved.api_resource)]
            } else {
                r.namespaces
                    .iter()
                    .map(|ns| Api::namespaced_with(client.clone(), ns, &resolved.api_resource))
                    .collect()
            };
            for api in apis {
                let list = api.list(&params).await.map_err(|e| {
                    Error::Read(format!("cannot list {}: {e}", resolved.api_resource.plural))
                })?;
                for obj in list {
                    let mut sample = encoder.sample_message();
                    sample.namespace = obj.metadata.namespace.clone();
                    let topic = match &placer {
                        Placer::Topic(kafka) => kafka.topic_for(&sample),
                        Placer::Resource => resource_name.clone(),
                    };
                    let key = crate::informer::meta_namespace_key(&obj);
                    topics.insert(topic.clone());
                    cluster.insert(
                        (topic, key),
                        obj.metadata.resource_version.clone().unwrap_or_default(),
                    );
                }
            }
            // Places this resource writes to even where the cluster now has no object.
            match &placer {
                Placer::Topic(kafka) if !kafka.topic_uses_namespace() => {
                    topics.insert(kafka.topic_for(&encoder.sample_message()));
                }
                Placer::Topic(_) => {}
                Placer::Resource => {
                    topics.insert(resource_name.clone());
                }
            }
        }
    }
    let deduplicated = if state.deduplicated.is_empty() {
        None
    } else {
        Some(compare(&cluster, &topics, &state.deduplicated_objects()))
    };
    let last_wins = compare(&cluster, &topics, &state.objects);
    Ok(Differences {
        deduplicated: deduplicated.unwrap_or_else(|| last_wins.clone()),
        last_wins,
    })
}

/// How `objects` (as a consumer ends with them) differ from `cluster` (resourceVersions by
/// place); objects in other places than `topics` are not the sink's and left out.
fn compare(
    cluster: &BTreeMap<(String, String), String>,
    topics: &BTreeSet<String>,
    objects: &BTreeMap<(String, String), Value>,
) -> Vec<Difference> {
    let mut differences = Vec::new();
    for ((topic, key), cluster_rv) in cluster {
        match objects.get(&(topic.clone(), key.clone())) {
            None => differences.push(Difference::Missing {
                topic: topic.clone(),
                key: key.clone(),
                cluster_rv: cluster_rv.clone(),
            }),
            Some(object) if rv(object) != *cluster_rv => differences.push(Difference::Stale {
                topic: topic.clone(),
                key: key.clone(),
                topic_rv: rv(object),
                cluster_rv: cluster_rv.clone(),
            }),
            Some(_) => {}
        }
    }
    for ((topic, key), object) in objects {
        if topics.contains(topic) && !cluster.contains_key(&(topic.clone(), key.clone())) {
            differences.push(Difference::Gone {
                topic: topic.clone(),
                key: key.clone(),
                topic_rv: rv(object),
            });
        }
    }
    differences
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        let s = jiff::SignedDuration::from_secs;
        assert_eq!(age(s(45)), "45s");
        assert_eq!(age(s(600)), "10m");
        assert_eq!(age(s(5 * 3600)), "5h");
        assert_eq!(age(s(3 * 86_400)), "3d");
    }

    fn event(ty: &str, rv: &str, uid: &str) -> Value {
        serde_json::json!({
            "type": format!("{}.{ty}", crate::message::TYPE_PREFIX),
            "k8sresource": "configmaps", "k8sgroup": "", "k8snamespace": "ns", "k8sname": "a",
            "k8sresourceversion": rv,
            "data": {"object": {"metadata": {"name": "a", "namespace": "ns", "uid": uid,
                                              "resourceVersion": rv}}},
        })
    }

    #[test]
    fn a_stream_folds_by_order_in_both_consumer_models() {
        let place = ("configmaps".to_owned(), "ns/a".to_owned());
        let with_id = |ty: &str, rv: &str, uid: &str| {
            let mut e = event(ty, rv, uid);
            e["id"] = serde_json::json!(format!("{uid}:{rv}:{ty}"));
            e
        };
        let mut f = Fold::default();
        f.apply_event(with_id("added", "5", "u1"));
        f.apply_event(with_id("updated", "7", "u1"));
        // An older message stored after a newer one: the order wins, not the number.
        f.apply_event(with_id("updated", "6", "u1"));
        let state = std::mem::take(&mut f).into_state("RESOURCE");
        assert_eq!(state.objects[&place]["metadata"]["resourceVersion"], "6");
        assert!(state.deduplicated.is_empty(), "no id repeated: both agree");
        // A re-send of rv 7 (same id) after rv 6: the deduplicating consumer skips it and
        // stays at 6; the other ends at 7.
        for e in [
            with_id("added", "5", "u1"),
            with_id("updated", "7", "u1"),
            with_id("updated", "6", "u1"),
            with_id("updated", "7", "u1"),
        ] {
            f.apply_event(e);
        }
        let state = f.into_state("RESOURCE");
        assert_eq!(state.objects[&place]["metadata"]["resourceVersion"], "7");
        let dedup = state.deduplicated_objects();
        assert_eq!(dedup[&place]["metadata"]["resourceVersion"], "6");
        // Deletes, recreation and filter exits fold the same way.
        let mut f = Fold::default();
        f.apply_event(with_id("added", "5", "u1"));
        f.apply_event(with_id("deleted", "8", "u1"));
        assert_eq!(f.last[&place], None);
        f.apply_event(with_id("added", "9", "u2"));
        let mut filtered = with_id("deleted", "10", "u2");
        filtered["k8sfilteredout"] = serde_json::json!(true);
        f.apply_event(filtered);
        let state = f.into_state("RESOURCE");
        assert!(state.objects.is_empty() && state.deduplicated.is_empty());
    }
}
