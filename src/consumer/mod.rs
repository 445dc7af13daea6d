//! Tools for the consumers of what the bridge writes, reading a sink's destination with the
//! service's own config file: `tail` prints the messages as they come, `state` rebuilds the
//! objects a Kafka state topic or a JetStream stream holds and compares them with the cluster.

pub mod event;
pub mod progress;
pub mod state;
pub mod tail;

use async_nats::jetstream::{self, consumer::DeliverPolicy};
use serde_json::Value;

use crate::{
    config::{Config, SinkConfig},
    message::Encoding,
    sinks::{
        kafka::{KafkaMode, KafkaSinkConfig},
        nats::{NatsSinkConfig, connect_client},
        template::{Field, Segment, Template, nats_wildcard},
    },
};
use event::{DecodeError, Layout};

/// Errors of the consumer tools.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line or config does not fit the command.
    #[error("{0}")]
    Usage(String),
    /// Reading the destination failed.
    #[error("{0}")]
    Read(String),
    /// The cluster could not be asked.
    #[error(transparent)]
    Cluster(#[from] crate::cluster::Error),
    /// A sink could not be opened.
    #[error(transparent)]
    Sink(#[from] crate::sinks::Error),
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The sink named `name`.
pub fn find_sink<'a>(config: &'a Config, name: &str) -> Result<&'a SinkConfig> {
    config.sinks.iter().find(|s| s.name == name).ok_or_else(|| {
        let names: Vec<&str> = config.sinks.iter().map(|s| s.name.as_str()).collect();
        Error::Usage(format!(
            "no sink named {name:?} in the config (its sinks: {names:?})"
        ))
    })
}

/// Whether `topic` is a name `template` can render.
fn template_matches(segments: &[Segment], topic: &str) -> bool {
    match segments.split_first() {
        None => topic.is_empty(),
        Some((Segment::Literal(l), rest)) => topic
            .strip_prefix(l.as_str())
            .is_some_and(|t| template_matches(rest, t)),
        Some((Segment::Placeholder(_), rest)) => (1..=topic.len())
            .any(|n| topic.is_char_boundary(n) && template_matches(rest, &topic[n..])),
    }
}

/// `topics` when given, else every topic on the brokers whose name the sink's topic template
/// can render with `cluster` as the cluster name (an error when there is none): another
/// cluster's bridge writing into the same brokers with the same template is not this sink.
async fn kafka_topics(
    sink: &str,
    cfg: &KafkaSinkConfig,
    cluster: &str,
    client: &crate::sinks::kafka::KafkaClient,
    topics: &[String],
) -> Result<Vec<String>> {
    if !topics.is_empty() {
        return Ok(topics.to_vec());
    }
    let template = Template::parse(&cfg.topic)
        .map_err(|e| Error::Usage(e.to_string()))?
        .with_value(Field::Cluster, cluster);
    let client = client.clone();
    let found = tokio::task::spawn_blocking(move || -> Result<Vec<String>> {
        use rdkafka::consumer::Consumer;
        let consumer = crate::sinks::kafka::reader::consumer(&client).map_err(Error::Read)?;
        let metadata = consumer
            .fetch_metadata(None, crate::sinks::kafka::reader::TIMEOUT)
            .map_err(|e| Error::Read(format!("cannot list the brokers' topics: {e}")))?;
        let mut names: Vec<String> = metadata
            .topics()
            .iter()
            .map(|t| t.name().to_owned())
            .filter(|t| template_matches(template.segments(), t))
            .collect();
        names.sort();
        Ok(names)
    })
    .await
    .map_err(|e| Error::Read(e.to_string()))??;
    if found.is_empty() {
        return Err(Error::Read(format!(
            "no topic on the brokers matches sink {sink}'s topic {:?} (name them with --topic)",
            cfg.topic
        )));
    }
    Ok(found)
}

/// How a Kafka sink's records carry their events.
fn kafka_layout(cfg: &KafkaSinkConfig) -> Layout {
    match (cfg.mode, cfg.message_encoding()) {
        (KafkaMode::State, _) => Layout::State,
        (_, Encoding::Binary) => Layout::Binary("ce_"),
        _ => Layout::Structured,
    }
}

/// What reading a NATS sink's subjects takes.
struct NatsSource {
    client: async_nats::Client,
    /// The subject filter: `subject`, or every subject the sink publishes to.
    subject: String,
    layout: Layout,
}

impl NatsSource {
    /// Connects with the sink's servers, credentials and TLS settings.
    async fn connect(name: &str, cfg: &NatsSinkConfig, subject: Option<&str>) -> Result<Self> {
        let subject = match subject {
            Some(s) => s.to_owned(),
            None => nats_wildcard(
                &Template::parse(&cfg.subject)
                    .map_err(|e| Error::Usage(format!("sink {name}: subject: {e}")))?,
            ),
        };
        let layout = match cfg.encoding {
            Encoding::Binary => Layout::Binary("ce-"),
            _ => Layout::Structured,
        };
        let client = connect_client(name, cfg, |_| {}).await?;
        Ok(Self {
            client,
            subject,
            layout,
        })
    }

    /// The event a message carries.
    fn decode(
        &self,
        headers: Option<&async_nats::HeaderMap>,
        body: &[u8],
    ) -> Result<Value, DecodeError> {
        decode_nats(self.layout, headers, body)
    }

    /// An ephemeral consumer of the sink's stream, filtered to the subject, acknowledging
    /// nothing; and the stream's name.
    async fn jetstream(
        &self,
        name: &str,
        cfg: &NatsSinkConfig,
        deliver_policy: DeliverPolicy,
    ) -> Result<(jetstream::stream::Stream, jetstream::consumer::PullConsumer)> {
        use jetstream::consumer::{AckPolicy, pull};
        let stream_name = &cfg
            .stream
            .as_ref()
            .ok_or_else(|| Error::Usage(format!("sink {name} names no stream")))?
            .name;
        let js = jetstream::new(self.client.clone());
        let stream = js
            .get_stream(stream_name)
            .await
            .map_err(|e| Error::Read(format!("stream {stream_name}: {e}")))?;
        let consumer = stream
            .create_consumer(pull::Config {
                filter_subject: self.subject.clone(),
                deliver_policy,
                ack_policy: AckPolicy::None,
                inactive_threshold: std::time::Duration::from_secs(60),
                ..Default::default()
            })
            .await
            .map_err(|e| {
                Error::Read(format!(
                    "cannot read stream {stream_name} ({}): {e}",
                    self.subject
                ))
            })?;
        Ok((stream, consumer))
    }
}

fn decode_nats(
    layout: Layout,
    headers: Option<&async_nats::HeaderMap>,
    body: &[u8],
) -> Result<Value, DecodeError> {
    let headers: Vec<(String, String)> = headers
        .map(|h| {
            h.iter()
                .flat_map(|(k, vs)| vs.iter().map(move |v| (k.to_string(), v.to_string())))
                .collect()
        })
        .unwrap_or_default();
    layout.decode(
        headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        Some(body),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_match_what_the_template_renders() {
        let t = Template::parse("k8s.{cluster}.{group}.{resource}").unwrap();
        assert!(template_matches(t.segments(), "k8s.prod.core.configmaps"));
        assert!(template_matches(
            t.segments(),
            "k8s.prod.example.com.widgets"
        ));
        assert!(!template_matches(t.segments(), "k8s.prod.configmaps"));
        assert!(!template_matches(
            t.segments(),
            "other.prod.core.configmaps"
        ));
        let prod = t.with_value(Field::Cluster, "prod");
        assert!(template_matches(
            prod.segments(),
            "k8s.prod.core.configmaps"
        ));
        assert!(
            !template_matches(prod.segments(), "k8s.staging.core.configmaps"),
            "another cluster's topic"
        );
        let fixed = Template::parse("state.configmaps").unwrap();
        assert!(template_matches(fixed.segments(), "state.configmaps"));
        assert!(!template_matches(fixed.segments(), "state.configmaps2"));
    }
}
