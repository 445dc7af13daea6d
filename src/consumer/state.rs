//! `kube-event-bridge state`: the objects a sink's destination holds, rebuilt as a consumer
//! would, printed like `kubectl get` or as JSON; `--check` compares them with the live API
//! server, the check an operator wants after an incident.
//!
//! - A Kafka state topic (`mode: state`): read from offset 0, last value per key, tombstones
//!   drop the key. Objects are placed by topic.
//! - A JetStream stream: every event of the sink's subjects, in stream order; the newest per
//!   object wins (`deleted` drops it), and an event older than what was already folded for
//!   the object (a lower resourceVersion: a retried publish) is skipped. Objects are placed
//!   by resource (`configmaps`, `widgets.example.com`). Only what the stream still holds can
//!   be rebuilt: an object whose events its limits (`max_age`, `max_bytes`) removed is
//!   missing, and the command warns when the stream has dropped messages.

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
        kafka::{KafkaMode, KafkaSink, KafkaSinkConfig, client_config, reader::read_to_end},
        nats::{NatsMode, NatsSinkConfig},
    },
};

/// The objects a destination holds, by (place, key): place is the topic for Kafka, the
/// resource for JetStream.
#[derive(Debug, Clone, Default)]
pub struct State {
    /// What the place is: `TOPIC` or `RESOURCE`.
    pub place: &'static str,
    /// The objects.
    pub objects: BTreeMap<(String, String), Value>,
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
/// every topic on the brokers whose name its topic template can render); for JetStream, the
/// stream's events of `subject` (or of every subject the sink publishes to).
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
            read_kafka(sink, cfg, topics, progress).await
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
    topics: &[String],
    progress: &mut Progress,
) -> Result<State> {
    let client = client_config(sink, cfg).map_err(Error::Read)?;
    let topics = kafka_topics(sink, cfg, &client, topics).await?;
    let mut p = std::mem::replace(progress, Progress::with("records", false));
    let (state, p) = tokio::task::spawn_blocking(move || {
        let mut objects = BTreeMap::new();
        read_to_end(&client, &topics, |r| {
            p.add(1);
            let key = String::from_utf8_lossy(&r.key).into_owned();
            match r.value.map(|v| serde_json::from_slice::<Value>(&v)) {
                Some(Ok(object)) => {
                    objects.insert((r.topic, key), object);
                }
                Some(Err(e)) => {
                    // The newest value cannot be read: no state is claimed for the key (a
                    // --check then reports it), and the reason is shown.
                    tracing::warn!(topic = %r.topic, key = %key, error = %e,
                                   "State record is not a JSON object; its key is left out");
                    objects.remove(&(r.topic, key));
                }
                None => {
                    objects.remove(&(r.topic, key));
                }
            }
        })
        .map(|()| {
            (
                State {
                    place: "TOPIC",
                    objects,
                },
                p,
            )
        })
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
                Ok(event) => fold.apply(event),
                Err(e) => {
                    let seq = m.info().map(|i| i.stream_sequence).unwrap_or_default();
                    tracing::warn!(stream = %stream_name, sequence = seq, error = %e,
                                   "Message cannot be read; skipped");
                }
            }
        }
    }
    Ok(State {
        place: "RESOURCE",
        objects: fold.objects,
    })
}

/// Events folded into the newest state per object.
#[derive(Debug, Default)]
struct Fold {
    objects: BTreeMap<(String, String), Value>,
    /// The resourceVersion of each object's newest delete, so that a retried older event
    /// cannot bring it back.
    deleted: BTreeMap<(String, String), u64>,
}

impl Fold {
    fn apply(&mut self, event: Value) {
        let s = Summary::of(&event);
        let place = (s.resource_name(), s.key());
        let rv = s.resource_version.parse::<u64>().ok();
        let newest = self
            .objects
            .get(&place)
            .and_then(|o| {
                o["metadata"]["resourceVersion"]
                    .as_str()?
                    .parse::<u64>()
                    .ok()
            })
            .or_else(|| self.deleted.get(&place).copied());
        if let (Some(rv), Some(newest)) = (rv, newest)
            && rv < newest
        {
            return;
        }
        let gone = s.event_type == "deleted" || event["k8sfilteredout"] == true;
        match event.get("data").and_then(|d| d.get("object")) {
            Some(object) if !gone => {
                self.deleted.remove(&place);
                self.objects.insert(place, object.clone());
            }
            _ => {
                self.objects.remove(&place);
                if let Some(rv) = rv {
                    self.deleted.insert(place, rv);
                }
            }
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
    Topic(KafkaSink),
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
) -> Result<Vec<Difference>> {
    let placer = match destination(config, sink)? {
        Destination::Kafka(cfg) => Placer::Topic(KafkaSink::connect(sink, cfg).await?),
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
    let mut differences = Vec::new();
    for ((topic, key), cluster_rv) in &cluster {
        match state.objects.get(&(topic.clone(), key.clone())) {
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
    for ((topic, key), object) in &state.objects {
        if topics.contains(topic) && !cluster.contains_key(&(topic.clone(), key.clone())) {
            differences.push(Difference::Gone {
                topic: topic.clone(),
                key: key.clone(),
                topic_rv: rv(object),
            });
        }
    }
    Ok(differences)
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
    fn a_stream_folds_into_the_newest_state_and_retried_old_events_do_not_win() {
        let place = ("configmaps".to_owned(), "ns/a".to_owned());
        let mut f = Fold::default();
        f.apply(event("added", "5", "u1"));
        f.apply(event("updated", "7", "u1"));
        f.apply(event("updated", "6", "u1")); // a retried older publish
        assert_eq!(f.objects[&place]["metadata"]["resourceVersion"], "7");
        f.apply(event("deleted", "7", "u1"));
        assert!(f.objects.is_empty());
        f.apply(event("updated", "6", "u1")); // cannot bring it back
        assert!(f.objects.is_empty());
        f.apply(event("added", "9", "u2")); // recreated
        assert_eq!(f.objects[&place]["metadata"]["uid"], "u2");
        let mut filtered = event("deleted", "10", "u2");
        filtered["k8sfilteredout"] = serde_json::json!(true);
        f.apply(filtered);
        assert!(f.objects.is_empty());
    }
}
