//! The consumer tools at scale. OBJECTS ConfigMaps of ~1 KB are each added, every tenth is
//! updated and every twentieth (offset 5) deleted, written through the real sinks: a
//! JetStream stream (nats-server), a Kafka events topic and a Kafka state topic (Apache Kafka). Then
//! `state` rebuilds the objects from the stream and from the state topic, and
//! `tail --from-beginning --output json` (the real binary) prints every message of the stream
//! and of the events topic. Prints, per read, messages per second, and checks what a consumer
//! relies on: the state holds exactly the live objects at their newest resourceVersion, the
//! tail printed every message and none twice (duplicates are counted, not only presence).
//!
//! `cargo bench --bench tools [-- OBJECTS]` (default 100000; needs Apache Kafka's jars and
//! `nats-server`, which `scripts/test` provides)

#[path = "../tests/support/kafka.rs"]
#[allow(dead_code)]
mod kafka;
#[path = "../tests/support/loopback.rs"]
mod loopback;
#[path = "../tests/support/nats.rs"]
#[allow(dead_code)]
mod nats;
mod support;

use std::{
    collections::{HashMap, HashSet},
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Instant,
};

use futures::StreamExt;
use kube_event_bridge::{
    config::Config,
    consumer::{progress::Progress, state},
    informer::{Notification, NotificationKind},
    message::{Encoder, Encoding},
    sinks::{Sink, kafka::KafkaSink, nats::NatsSink},
};
use serde_json::{Value, json};
use support::{object, objects::configmaps};

const SIZE: usize = 1024;

/// The notifications, in order: adds, updates, deletes; and each live object's newest rv.
fn changes(objects: usize) -> (Vec<Notification>, HashMap<String, String>) {
    let mut notes = Vec::new();
    let mut live = HashMap::new();
    for i in 0..objects {
        let obj = object(i, 1_000_000 + i as u64, SIZE);
        live.insert(key(&obj), obj.resource_version().unwrap().to_owned());
        notes.push(Notification::new(NotificationKind::Add {
            obj,
            is_initial_list: true,
        }));
    }
    for i in (0..objects).step_by(10) {
        let new = object(i, 2_000_000 + i as u64, SIZE);
        live.insert(key(&new), new.resource_version().unwrap().to_owned());
        notes.push(Notification::new(NotificationKind::Update {
            old: object(i, 1_000_000 + i as u64, SIZE),
            new,
        }));
    }
    for i in (5..objects).step_by(20) {
        let obj = object(i, 1_000_000 + i as u64, SIZE);
        live.remove(&key(&obj));
        notes.push(Notification::new(NotificationKind::Delete {
            obj,
            final_state_unknown: false,
        }));
    }
    (notes, live)
}

fn key(obj: &kube_event_bridge::informer::CachedObject) -> String {
    kube_event_bridge::informer::meta_namespace_key(obj)
}

/// Publishes every notification through `sink`, 512 at a time; returns the seconds taken.
async fn publish(sink: &dyn Sink, encoder: &Encoder, notes: &[Notification]) -> f64 {
    let started = Instant::now();
    futures::stream::iter(notes)
        .map(|n| async move {
            let m = encoder.encode(n.key(), n).unwrap();
            loop {
                match sink.publish(&m).await {
                    Ok(()) => break,
                    Err(e) if e.is_retriable() => {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await
                    }
                    Err(e) => panic!("publish: {e}"),
                }
            }
        })
        .buffer_unordered(512)
        .collect::<Vec<()>>()
        .await;
    sink.flush().await.unwrap();
    started.elapsed().as_secs_f64()
}

/// Checks a rebuilt state against the live objects; prints the read's line.
fn check_state(
    label: &str,
    state: &state::State,
    live: &HashMap<String, String>,
    secs: f64,
    read: u64,
) {
    let mut wrong = 0;
    let mut found = HashSet::new();
    for ((_, key), object) in &state.objects {
        found.insert(key.clone());
        if live.get(key).map(String::as_str) != object["metadata"]["resourceVersion"].as_str() {
            wrong += 1;
        }
    }
    let missing = live.keys().filter(|k| !found.contains(*k)).count();
    println!(
        "  state {label:<28} {read:>7} messages in {secs:>6.2} s ({:>7.0}/s)   objects {} of {}, missing {missing}, wrong version {wrong}",
        read as f64 / secs,
        state.objects.len(),
        live.len(),
    );
    assert_eq!(
        (state.objects.len(), missing, wrong),
        (live.len(), 0, 0),
        "{label}: the state is the live objects"
    );
}

/// Runs the real `tail --from-beginning --output json --count N`; prints its line.
fn tail(label: &str, config: &std::path::Path, sink: &str, expected: usize) {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"))
        .env_clear()
        .args(["tail", "--config", config.to_str().unwrap(), "--sink", sink])
        .args([
            "--from-beginning",
            "--output",
            "json",
            "--count",
            &expected.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ids = HashSet::new();
    let mut lines = 0usize;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        ids.insert(event["id"].as_str().unwrap().to_owned());
        lines += 1;
    }
    assert!(child.wait().unwrap().success());
    let secs = started.elapsed().as_secs_f64();
    let duplicates = lines - ids.len();
    println!(
        "  tail  {label:<28} {lines:>7} messages in {secs:>6.2} s ({:>7.0}/s)   distinct {}, duplicates {duplicates}",
        lines as f64 / secs,
        ids.len()
    );
    assert_eq!(
        (lines, duplicates),
        (expected, 0),
        "{label}: every message once"
    );
}

#[tokio::main]
async fn main() {
    let objects: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let (notes, live) = changes(objects);
    println!(
        "tools bench: {objects} objects of ~{SIZE} B, {} messages ({} live objects)",
        notes.len(),
        live.len()
    );
    let nats = nats::NatsServer::start();
    let broker = kafka::Kafka::start();
    let config = json!({
        "cluster": "bench",
        "resources": [{"api_version": "v1", "kind": "ConfigMap"}],
        "sinks": [
            {"name": "nats", "type": "nats", "nats": {"servers": [nats.url()],
                "stream": {"name": "K8S", "create": true, "subjects": ["k8s.>"]}}},
            {"name": "events", "type": "kafka", "kafka": {"brokers": [broker.brokers()],
                "topic": "events.{resource}", "create_topics": {"partitions": 3}}},
            {"name": "state", "type": "kafka", "kafka": {"brokers": [broker.brokers()],
                "mode": "state", "topic": "state.{resource}", "create_topics": {"partitions": 3}}},
        ],
        "routes": [{"resource": "configmap", "sinks": ["nats", "events", "state"]}],
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, config.to_string()).unwrap();
    let config = Config::from_value(config).unwrap();
    let sink_cfg = |name: &str| {
        config
            .sinks
            .iter()
            .find(|s| s.name == name)
            .unwrap()
            .clone()
    };

    let structured = Encoder::new(
        "bench",
        &configmaps(),
        &config.message,
        Encoding::Structured,
    );
    let state_encoder = Encoder::new("bench", &configmaps(), &config.message, Encoding::State);
    let jetstream = NatsSink::connect("nats", sink_cfg("nats").nats.as_ref().unwrap())
        .await
        .unwrap();
    let events = KafkaSink::connect("events", sink_cfg("events").kafka.as_ref().unwrap())
        .await
        .unwrap();
    let state_topic = KafkaSink::connect("state", sink_cfg("state").kafka.as_ref().unwrap())
        .await
        .unwrap();
    for (sink, topic) in [
        (&events, "events.configmaps"),
        (&state_topic, "state.configmaps"),
    ] {
        sink.create_topics(&[topic.to_owned()], 3, 1).await.unwrap();
    }
    for (label, sink, encoder) in [
        ("JetStream", &jetstream as &dyn Sink, &structured),
        ("Kafka events topic", &events, &structured),
        ("Kafka state topic", &state_topic, &state_encoder),
    ] {
        let secs = publish(sink, encoder, &notes).await;
        println!(
            "  wrote {label:<28} {:>7} messages in {secs:>6.2} s",
            notes.len()
        );
    }

    for (label, sink) in [("JetStream stream", "nats"), ("Kafka state topic", "state")] {
        let mut progress = Progress::with("messages", false);
        let started = Instant::now();
        let rebuilt = state::read(&config, sink, &[], None, &mut progress)
            .await
            .unwrap();
        check_state(
            label,
            &rebuilt,
            &live,
            started.elapsed().as_secs_f64(),
            progress.count(),
        );
    }
    let path2 = path.clone();
    let total = notes.len();
    tokio::task::spawn_blocking(move || {
        tail("JetStream stream", &path2, "nats", total);
        tail("Kafka events topic", &path2, "events", total);
    })
    .await
    .unwrap();
}
