//! `kube-event-bridge state`: the objects a Kafka sink's state topic holds (`mode: state`),
//! rebuilt as a consumer would: read from offset 0, last value per key, tombstones drop the
//! key. Printed like `kubectl get` or as JSON; `--check` compares them with the live API
//! server, the check an operator wants after an incident.

use std::collections::{BTreeMap, BTreeSet};

use kube::{
    Api, Client,
    api::{DynamicObject, ListParams},
};
use serde_json::Value;

use super::{Error, Result};
use crate::{
    cluster,
    config::{Config, SinkType},
    message::{Encoder, Encoding},
    sinks::{
        kafka::{KafkaMode, KafkaSink, client_config, reader::read_to_end},
        template::{Segment, Template},
    },
};

/// The objects on the state topic(s), by (topic, key).
pub type State = BTreeMap<(String, String), Value>;

/// What `--check` found for one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// In the cluster, not on the topic.
    Missing {
        /// The topic it should be on.
        topic: String,
        /// `namespace/name`.
        key: String,
        /// Its resourceVersion in the cluster.
        cluster_rv: String,
    },
    /// On the topic, gone from the cluster (a delete that never reached the topic).
    Gone {
        /// The topic.
        topic: String,
        /// `namespace/name`.
        key: String,
        /// Its resourceVersion on the topic.
        topic_rv: String,
    },
    /// On both, with other resourceVersions.
    Stale {
        /// The topic.
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

fn kafka_sink<'a>(
    config: &'a Config,
    sink: &str,
) -> Result<&'a crate::sinks::kafka::KafkaSinkConfig> {
    let s = config
        .sinks
        .iter()
        .find(|s| s.name == sink)
        .ok_or_else(|| Error::Usage(format!("no sink named {sink:?} in the config")))?;
    match (s.kind, s.kafka.as_ref()) {
        (SinkType::Kafka, Some(k)) if k.mode == KafkaMode::State => Ok(k),
        (SinkType::Kafka, _) => Err(Error::Usage(format!(
            "sink {sink} writes events, not state (kafka.mode: state)"
        ))),
        _ => Err(Error::Usage(format!(
            "sink {sink} is not a kafka sink; state reads Kafka state topics"
        ))),
    }
}

/// Whether `topic` is a name `template` can render.
fn matches(segments: &[Segment], topic: &str) -> bool {
    match segments.split_first() {
        None => topic.is_empty(),
        Some((Segment::Literal(l), rest)) => topic
            .strip_prefix(l.as_str())
            .is_some_and(|t| matches(rest, t)),
        Some((Segment::Placeholder(_), rest)) => {
            (1..=topic.len()).any(|n| topic.is_char_boundary(n) && matches(rest, &topic[n..]))
        }
    }
}

/// Reads the state topics of `sink`: `topics`, or every topic on the brokers whose name its
/// topic template can render.
pub async fn read(config: &Config, sink: &str, topics: &[String]) -> Result<State> {
    let cfg = kafka_sink(config, sink)?;
    let client = client_config(sink, cfg).map_err(Error::Read)?;
    let topics = if topics.is_empty() {
        let template = Template::parse(&cfg.topic).map_err(|e| Error::Usage(e.to_string()))?;
        let client = client.clone();
        tokio::task::spawn_blocking(move || -> Result<Vec<String>> {
            use rdkafka::consumer::{BaseConsumer, Consumer};
            let consumer: BaseConsumer = client
                .create()
                .map_err(|e| Error::Read(format!("consumer: {e}")))?;
            let metadata = consumer
                .fetch_metadata(None, crate::sinks::kafka::reader::TIMEOUT)
                .map_err(|e| Error::Read(format!("cannot list the brokers' topics: {e}")))?;
            Ok(metadata
                .topics()
                .iter()
                .map(|t| t.name().to_owned())
                .filter(|t| matches(template.segments(), t))
                .collect())
        })
        .await
        .map_err(|e| Error::Read(e.to_string()))??
    } else {
        topics.to_vec()
    };
    if topics.is_empty() {
        return Err(Error::Read(format!(
            "no topic on the brokers matches sink {sink}'s topic {:?}",
            cfg.topic
        )));
    }
    tokio::task::spawn_blocking(move || {
        let mut state = State::new();
        read_to_end(&client, &topics, |r| {
            let key = String::from_utf8_lossy(&r.key).into_owned();
            match r.value.map(|v| serde_json::from_slice::<Value>(&v)) {
                Some(Ok(object)) => {
                    state.insert((r.topic, key), object);
                }
                Some(Err(e)) => {
                    // The newest value cannot be read: no state is claimed for the key (a
                    // --check then reports it), and the reason is shown.
                    tracing::warn!(topic = %r.topic, key = %key, error = %e,
                                   "State record is not a JSON object; its key is left out");
                    state.remove(&(r.topic, key));
                }
                None => {
                    state.remove(&(r.topic, key));
                }
            }
        })
        .map(|()| state)
        .map_err(Error::Read)
    })
    .await
    .map_err(|e| Error::Read(e.to_string()))?
}

fn rv(object: &Value) -> String {
    object["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// `kubectl get`-like lines: `TOPIC NAMESPACE NAME RESOURCEVERSION AGE`.
pub fn table(state: &State, now: jiff::Timestamp) -> String {
    let mut rows = vec![[
        "TOPIC".to_owned(),
        "NAMESPACE".to_owned(),
        "NAME".to_owned(),
        "RESOURCEVERSION".to_owned(),
        "AGE".to_owned(),
    ]];
    for ((topic, _), object) in state {
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

/// Compares `state` with the objects the API server holds for every resource routed to
/// `sink`, on the topics they go to.
pub async fn check(
    config: &Config,
    client: &Client,
    sink: &str,
    state: &State,
) -> Result<Vec<Difference>> {
    let cfg = kafka_sink(config, sink)?;
    let kafka = KafkaSink::connect(sink, cfg).await?;
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
        let resolved = cluster::resolve(client, index, r).await?;
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
                let topic = kafka.topic_for(&sample);
                let key = crate::informer::meta_namespace_key(&obj);
                topics.insert(topic.clone());
                cluster.insert(
                    (topic, key),
                    obj.metadata.resource_version.clone().unwrap_or_default(),
                );
            }
        }
        // Topics this resource writes to even where the cluster now has no object.
        if !kafka.topic_uses_namespace() {
            topics.insert(kafka.topic_for(&encoder.sample_message()));
        }
    }
    let mut differences = Vec::new();
    for ((topic, key), cluster_rv) in &cluster {
        match state.get(&(topic.clone(), key.clone())) {
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
    for ((topic, key), object) in state {
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
    fn topics_match_what_the_template_renders() {
        let t = Template::parse("k8s.{cluster}.{group}.{resource}").unwrap();
        assert!(matches(t.segments(), "k8s.prod.core.configmaps"));
        assert!(matches(t.segments(), "k8s.prod.example.com.widgets"));
        assert!(!matches(t.segments(), "k8s.prod.configmaps"));
        assert!(!matches(t.segments(), "other.prod.core.configmaps"));
        let fixed = Template::parse("state.configmaps").unwrap();
        assert!(matches(fixed.segments(), "state.configmaps"));
        assert!(!matches(fixed.segments(), "state.configmaps2"));
    }

    #[test]
    fn ages_read_like_kubectl() {
        let s = jiff::SignedDuration::from_secs;
        assert_eq!(age(s(45)), "45s");
        assert_eq!(age(s(600)), "10m");
        assert_eq!(age(s(5 * 3600)), "5h");
        assert_eq!(age(s(3 * 86_400)), "3d");
    }
}
