//! `kube-event-bridge tail`: prints what a sink's destination receives, one line per message,
//! from now or from the beginning, for people (`time type kind namespace/name rv`, colored on
//! a terminal) or as JSON lines (each a structured CloudEvent, binary-mode and state-topic
//! records mapped back) for scripts.
//!
//! Sources: a Kafka sink's topics (every partition, manually assigned: no consumer group, no
//! committed offsets), a JetStream sink's stream (an ephemeral consumer filtered to the sink's
//! subjects, nothing acknowledged) or a core NATS sink's subjects (from now only: core NATS
//! keeps nothing). A message that cannot be read is reported on stderr with where it came
//! from, and the tail goes on.

use std::{
    io::{IsTerminal, Write},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::StreamExt;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::{
    Error, NatsSource, Result, decode_nats,
    event::{DecodeError, Filter, Summary, human_line},
    find_sink, kafka_layout, kafka_topics,
    progress::Progress,
};
use crate::{
    config::{Config, SinkType},
    sinks::{
        kafka::{KafkaClient, KafkaSinkConfig, reader},
        nats::{NatsMode, NatsSinkConfig},
    },
};

/// What to read and what to print.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The sink whose destination is read.
    pub sink: String,
    /// Kafka: the topics; by default every topic the sink's template can render with the
    /// config's cluster name.
    pub topics: Vec<String>,
    /// NATS: the subject filter; by default the sink's subject template with each placeholder
    /// token as `*`.
    pub subject: Option<String>,
    /// Read what the destination holds before printing what comes.
    pub from_beginning: bool,
    /// Which messages are printed.
    pub filter: Filter,
    /// Stop after printing this many.
    pub count: Option<u64>,
    /// JSON lines instead of lines for people.
    pub json: bool,
}

/// A message as read: where it came from and its event (or why it could not be read).
struct Received {
    origin: String,
    event: std::result::Result<Value, DecodeError>,
}

/// A running reader of a destination.
struct Source {
    /// What is read, for the first line on stderr.
    description: String,
    rx: mpsc::Receiver<Received>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Source {
    async fn close(self) {
        // A blocking reader sees the flag; an async one is aborted where it waits.
        self.stop.store(true, Ordering::Relaxed);
        drop(self.rx);
        self.task.abort();
        let _ = self.task.await;
    }
}

/// Reads until `stop` resolves, `count` messages were printed, or stdout is closed; returns
/// how many were printed.
pub async fn run(
    config: &Config,
    options: &Options,
    stop: impl std::future::Future<Output = ()>,
) -> Result<u64> {
    let mut source = open(config, options).await?;
    let from = if options.from_beginning {
        "from the beginning"
    } else {
        "from now"
    };
    eprintln!("Reading {} {from}; Ctrl-C stops.", source.description);
    let stdout = std::io::stdout();
    let color = !options.json && stdout.is_terminal() && std::env::var_os("NO_COLOR").is_none();
    // A progress line only where it cannot mix with the printed lines.
    let mut progress = Progress::with(
        "messages",
        std::io::stderr().is_terminal() && !stdout.is_terminal(),
    );
    let mut printed = 0u64;
    tokio::pin!(stop);
    let outcome = loop {
        if options.count.is_some_and(|c| printed >= c) {
            break Ok(());
        }
        let received = tokio::select! {
            () = &mut stop => break Ok(()),
            r = source.rx.recv() => r,
        };
        let Some(Received { origin, event }) = received else {
            break Err(Error::Read(format!(
                "reading {} ended unexpectedly",
                source.description
            )));
        };
        progress.add(1);
        let event = match event {
            Ok(e) => e,
            Err(e) => {
                eprintln!("{origin}: cannot read the message: {e}");
                continue;
            }
        };
        let summary = Summary::of(&event);
        if !options.filter.matches(&event, &summary) {
            continue;
        }
        let line = if options.json {
            event.to_string()
        } else {
            human_line(&summary, color)
        };
        let mut out = stdout.lock();
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            // The reader went away (`tail | head`): nothing more to do.
            break Ok(());
        }
        printed += 1;
    };
    progress.finish();
    source.close().await;
    outcome.map(|()| printed)
}

async fn open(config: &Config, options: &Options) -> Result<Source> {
    let sink = find_sink(config, &options.sink)?;
    match (sink.kind, sink.kafka.as_ref(), sink.nats.as_ref()) {
        (SinkType::Kafka, Some(k), _) => {
            if options.subject.is_some() {
                return Err(Error::Usage(format!(
                    "sink {} is a kafka sink: name topics with --topic, not --subject",
                    sink.name
                )));
            }
            kafka(&sink.name, k, &config.cluster, options).await
        }
        (SinkType::Nats, _, Some(n)) => {
            if !options.topics.is_empty() {
                return Err(Error::Usage(format!(
                    "sink {} is a nats sink: name subjects with --subject, not --topic",
                    sink.name
                )));
            }
            nats(&sink.name, n, options).await
        }
        _ => Err(Error::Usage(format!(
            "sink {} writes JSON lines to standard output or a file; read it with your shell \
             (`tail -f FILE | jq`), not with this command",
            sink.name
        ))),
    }
}

async fn kafka(
    name: &str,
    cfg: &KafkaSinkConfig,
    cluster: &str,
    options: &Options,
) -> Result<Source> {
    let client = KafkaClient::new(name, cfg).map_err(Error::Read)?;
    let topics = kafka_topics(name, cfg, cluster, &client, &options.topics).await?;
    let layout = kafka_layout(cfg);
    let (tx, rx) = mpsc::channel(1024);
    let (ready_tx, ready_rx) = oneshot::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let from_beginning = options.from_beginning;
    let task = tokio::task::spawn_blocking({
        let stop = stop.clone();
        move || {
            use rdkafka::consumer::Consumer;
            let consumer = match assign(&client, &topics, from_beginning) {
                Ok((consumer, partitions)) => {
                    let _ = ready_tx.send(Ok(format!(
                        "{} partition(s) of {}",
                        partitions,
                        topics.join(", ")
                    )));
                    consumer
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            // Some Kafka-protocol brokers (tansu) hand a consumer that starts inside a
            // multi-record batch the batch again; a record below the next offset is a repeat.
            let mut next: std::collections::HashMap<(String, i32), i64> = Default::default();
            while !stop.load(Ordering::Relaxed) {
                match consumer.poll(Duration::from_millis(100)) {
                    // A partition read to its end: more may come.
                    None | Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) => {}
                    Some(Err(e)) => tracing::warn!(error = %e, "Kafka read error; retrying"),
                    Some(Ok(m)) => {
                        let r = reader::Record::from(&m);
                        let expected = next.entry((r.topic.clone(), r.partition)).or_default();
                        if r.offset < *expected {
                            continue;
                        }
                        *expected = r.offset + 1;
                        let event = layout.decode(
                            r.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                            r.value.as_deref(),
                        );
                        let origin = format!("{}/{}@{}", r.topic, r.partition, r.offset);
                        if tx.blocking_send(Received { origin, event }).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = consumer.unassign();
        }
    });
    let description = ready_rx
        .await
        .map_err(|_| Error::Read("the Kafka reader stopped".into()))?
        .map_err(Error::Read)?;
    Ok(Source {
        description,
        rx,
        stop,
        task,
    })
}

/// A consumer assigned every partition of `topics`, at its first offset or at its current end
/// (read now, so that what is published once the tail said it is reading is printed).
fn assign(
    client: &KafkaClient,
    topics: &[String],
    from_beginning: bool,
) -> std::result::Result<(reader::ReaderConsumer, usize), String> {
    use rdkafka::{Offset, TopicPartitionList, consumer::Consumer};
    let consumer = reader::consumer(client)?;
    let mut assignment = TopicPartitionList::new();
    for topic in topics {
        let metadata = consumer
            .fetch_metadata(Some(topic), reader::TIMEOUT)
            .map_err(|e| format!("metadata of {topic}: {e}"))?;
        for t in metadata.topics() {
            if let Some(e) = t.error() {
                return Err(format!("topic {topic}: {e:?}"));
            }
            for p in t.partitions() {
                let offset = if from_beginning {
                    Offset::Beginning
                } else {
                    let (_, high) = consumer
                        .fetch_watermarks(topic, p.id(), reader::TIMEOUT)
                        .map_err(|e| format!("watermarks of {topic}/{}: {e}", p.id()))?;
                    Offset::Offset(high)
                };
                assignment
                    .add_partition_offset(topic, p.id(), offset)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    if assignment.count() == 0 {
        return Err(format!("topics {topics:?} have no partitions"));
    }
    consumer
        .assign(&assignment)
        .map_err(|e| format!("assign: {e}"))?;
    let n = assignment.count();
    Ok((consumer, n))
}

async fn nats(name: &str, cfg: &NatsSinkConfig, options: &Options) -> Result<Source> {
    let source = NatsSource::connect(name, cfg, options.subject.as_deref()).await?;
    let subject = source.subject.clone();
    let layout = source.layout;
    let (tx, rx) = mpsc::channel(1024);
    let stop = Arc::new(AtomicBool::new(false));
    let (description, task) = match cfg.mode {
        NatsMode::Core => {
            if options.from_beginning {
                return Err(Error::Usage(format!(
                    "sink {name} publishes with core NATS, which keeps no messages: there is \
                     no beginning to read from (tail it from now)"
                )));
            }
            let mut sub = source
                .client
                .subscribe(subject.clone())
                .await
                .map_err(|e| Error::Read(format!("cannot subscribe to {subject}: {e}")))?;
            // The subscription is registered at the server once the flush returns.
            source
                .client
                .flush()
                .await
                .map_err(|e| Error::Read(format!("cannot subscribe to {subject}: {e}")))?;
            let task = tokio::spawn(async move {
                while let Some(m) = sub.next().await {
                    let event = decode_nats(layout, m.headers.as_ref(), &m.payload);
                    let origin = m.subject.to_string();
                    if tx.send(Received { origin, event }).await.is_err() {
                        break;
                    }
                }
            });
            (format!("subjects {subject} (core NATS)"), task)
        }
        NatsMode::Jetstream => {
            use async_nats::jetstream::consumer::DeliverPolicy;
            let deliver = if options.from_beginning {
                DeliverPolicy::All
            } else {
                DeliverPolicy::New
            };
            let (stream, consumer) = source.jetstream(name, cfg, deliver).await?;
            let stream_name = stream.cached_info().config.name.clone();
            let mut messages = consumer
                .messages()
                .await
                .map_err(|e| Error::Read(format!("cannot read stream {stream_name}: {e}")))?;
            let task = tokio::spawn(async move {
                while let Some(m) = messages.next().await {
                    let m = match m {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!(error = %e, "JetStream read error; retrying");
                            continue;
                        }
                    };
                    let event = decode_nats(layout, m.headers.as_ref(), &m.payload);
                    let origin = match m.info() {
                        Ok(i) => format!("{}#{}", i.stream, i.stream_sequence),
                        Err(_) => m.subject.to_string(),
                    };
                    if tx.send(Received { origin, event }).await.is_err() {
                        break;
                    }
                }
            });
            (format!("stream {stream_name} ({subject})"), task)
        }
    };
    Ok(Source {
        description,
        rx,
        stop,
        task,
    })
}
