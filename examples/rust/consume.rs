//! A consumer of kube-event-bridge's Kafka topics with rdkafka: it reads a topic from the
//! beginning, folds the stream into the current state of every object by message order, and
//! prints that state. Start from here: replace `apply` with what your service does.
//!
//! ```text
//! cargo run --example consume -- --brokers localhost:9092 --topic k8s.prod.core.configmaps
//! ```
//!
//! Events topics are read as CloudEvents, in binary mode (`ce_*` headers, the data as the value)
//! or in structured mode (the whole event as the value), as each message's headers say; a state
//! topic (the object as the value, a tombstone for a delete) with `--state`. Every
//! read is `read_committed`: with `exactly_once`, what an aborted transaction wrote is never
//! seen (on other topics it changes nothing).

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use clap::Parser;
use rdkafka::{
    ClientConfig, Message, Offset, TopicPartitionList,
    consumer::{BaseConsumer, Consumer},
    message::{BorrowedMessage, Headers},
};
use serde_json::Value;

#[derive(Parser)]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "localhost:9092")]
    brokers: String,
    /// The topic to read.
    #[arg(long)]
    topic: String,
    /// Exit once no message came for this many seconds and print the state (0: run until
    /// interrupted).
    #[arg(long, default_value_t = 0.0)]
    idle_exit: f64,
    /// The topic is a state topic (`mode: state`): the object as the value, a tombstone for a
    /// delete.
    #[arg(long)]
    state: bool,
}

/// What one message says about its key.
enum Change {
    /// The object's new state (`added`, `updated`, `synced`; a state topic's value).
    Put(Value),
    /// Deleted (`deleted`, seen on a watch or inferred by a list: `k8sfinalstateunknown`; a
    /// state topic's tombstone).
    Delete,
}

/// Reads a message: a CloudEvent's type and data, or (`state`) a state topic's object or
/// tombstone (the attributes are headers beside a state topic's object, but the value is no
/// event's data).
fn read(m: &BorrowedMessage<'_>, state: bool) -> Result<Change, String> {
    let header = |name: &str| {
        m.headers().and_then(|h| {
            h.iter()
                .find(|h| h.key.eq_ignore_ascii_case(name))
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
    };
    let Some(payload) = m.payload() else {
        return if state {
            Ok(Change::Delete)
        } else {
            Err("an event without a value".into())
        };
    };
    let value: Value = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
    if state {
        return Ok(Change::Put(value));
    }
    let structured =
        header("content-type").is_some_and(|t| t.starts_with("application/cloudevents"));
    let (event_type, data) = if structured {
        (
            value["type"].as_str().map(str::to_owned),
            value["data"].clone(),
        )
    } else {
        (header("ce_type"), value)
    };
    let event_type = event_type.ok_or("a CloudEvent without a type")?;
    match event_type.rsplit('.').next() {
        Some("added" | "updated" | "synced") => Ok(Change::Put(data["object"].clone())),
        Some("deleted") => Ok(Change::Delete),
        _ => Err(format!("unknown type {event_type}")),
    }
}

/// Folds one message into the state. Messages of one key arrive in order, so the last one
/// wins.
fn apply(state: &mut BTreeMap<String, Value>, key: String, change: Change) {
    match change {
        Change::Put(object) => {
            state.insert(key, object);
        }
        Change::Delete => {
            state.remove(&key);
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        // Partitions are assigned, not subscribed, and nothing is committed: librdkafka
        // wants a group id all the same.
        .set("group.id", format!("example-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()?;
    // Every partition from its beginning: the state is the whole topic's (each key's messages
    // are in one partition, in order).
    let metadata = consumer.fetch_metadata(Some(&args.topic), Duration::from_secs(30))?;
    let mut partitions = TopicPartitionList::new();
    for topic in metadata.topics() {
        if let Some(err) = topic.error() {
            return Err(format!("topic {}: {err:?}", args.topic).into());
        }
        for p in topic.partitions() {
            partitions.add_partition_offset(&args.topic, p.id(), Offset::Beginning)?;
        }
    }
    consumer.assign(&partitions)?;
    let mut state = BTreeMap::new();
    let mut messages = 0u64;
    let mut idle_since = Instant::now();
    while args.idle_exit == 0.0 || idle_since.elapsed().as_secs_f64() < args.idle_exit {
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m?;
        idle_since = Instant::now();
        messages += 1;
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        let change = read(&m, args.state)
            .map_err(|e| format!("partition {} offset {}: {e}", m.partition(), m.offset()))?;
        apply(&mut state, key, change);
    }
    let versions: BTreeMap<_, _> = state
        .iter()
        .map(|(k, o)| (k, o["metadata"]["resourceVersion"].clone()))
        .collect();
    println!(
        "{}",
        serde_json::json!({"messages": messages, "state": versions})
    );
    Ok(())
}
