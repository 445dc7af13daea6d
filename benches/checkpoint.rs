//! Checkpoint stores at scale: write KEYS keys (in batches of 10,000, as the background
//! writer would after a burst), then time a load, which a restart or a new leader waits for
//! before its first list is compared. File beside an output, Kafka topic (Apache Kafka), JetStream
//! key-value bucket (nats-server).
//!
//! The load's figures include this process's RSS: how much it grew at its peak during the
//! load, and how much of that the loaded checkpoint still holds.
//!
//! `cargo bench --bench checkpoint [-- KEYS]` (default 100000)

#[path = "../tests/support/kafka.rs"]
#[allow(dead_code)]
mod kafka;
#[path = "../tests/support/loopback.rs"]
mod loopback;
#[path = "../tests/support/nats.rs"]
#[allow(dead_code)]
mod nats;

use std::{sync::Arc, time::Instant};

use kube_event_bridge::{
    config::SinkConfig,
    sinks::checkpoint::{CheckpointStore, Entry},
    sinks::stdout::FileCheckpointStore,
    sinks::{
        kafka::{KafkaCheckpointStore, KafkaSink},
        nats::{NatsCheckpointStore, NatsSink},
    },
};

/// The service's allocator, so that the RSS figures are what the service would hold.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROUTE: &str = "configmap/bench";

async fn measure(label: &str, store: Arc<dyn CheckpointStore>, keys: usize) {
    let started = Instant::now();
    for batch in (0..keys).collect::<Vec<_>>().chunks(10_000) {
        let changes = batch
            .iter()
            .map(|i| {
                (
                    format!("team-{}/config-{i:06}", i % 50),
                    Some(Entry {
                        uid: format!("8d0c1f7e-0000-4000-8000-{i:012}"),
                        resource_version: (1_000_000 + i).to_string(),
                        pending: false,
                        kind: None,
                    }),
                )
            })
            .collect();
        store.write(ROUTE, changes).await.expect("write");
    }
    let wrote = started.elapsed().as_secs_f64();
    // The peak from here on is the load's (VmHWM reset to the current RSS).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = status_mib("VmRSS:");
    let started = Instant::now();
    let loaded = store
        .load(ROUTE)
        .await
        .expect("load")
        .expect("a checkpoint");
    let load = started.elapsed().as_secs_f64();
    assert_eq!(loaded.len(), keys, "{label}: every key loads");
    let (peak, held) = (status_mib("VmHWM:"), status_mib("VmRSS:"));
    drop(loaded);
    println!(
        "  {label:<32} write {keys} keys {wrote:>6.2} s ({:>7.0} keys/s)   load {load:>6.2} s ({:>7.0} keys/s), RSS +{:.0} MiB at its peak, +{:.0} MiB once loaded",
        keys as f64 / wrote,
        keys as f64 / load,
        peak - before,
        held - before,
    );
}

/// A field of /proc/self/status (VmRSS, VmHWM), in MiB.
fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

fn main() {
    let keys: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    kube_event_bridge::allocator::configure();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("checkpoint bench: {keys} keys of one route, 2 runtime threads");
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        measure(
            "file",
            Arc::new(FileCheckpointStore::beside(&dir.path().join("out.jsonl"))),
            keys,
        )
        .await;

        let broker = kafka::Kafka::start();
        let cfg: SinkConfig = serde_json::from_value(serde_json::json!({
            "name": "kafka", "type": "kafka",
            "kafka": {"brokers": [broker.brokers()], "topic": "bench"},
        }))
        .unwrap();
        let k = cfg.kafka.as_ref().unwrap();
        let sink = KafkaSink::connect("kafka", k).await.unwrap();
        let store = KafkaCheckpointStore::open("kafka", k, &sink).await.unwrap();
        measure("kafka topic (Apache Kafka 4.3)", Arc::new(store), keys).await;

        let server = nats::NatsServer::start();
        let cfg: SinkConfig = serde_json::from_value(serde_json::json!({
            "name": "nats", "type": "nats",
            "nats": {"servers": [server.url()], "stream": {"name": "K8S", "create": true, "subjects": ["k8s.>"]}},
        }))
        .unwrap();
        let n = cfg.nats.as_ref().unwrap();
        let sink = NatsSink::connect("nats", n).await.unwrap();
        let store = NatsCheckpointStore::open("nats", n, &sink).await.unwrap();
        measure("jetstream kv (nats-server 2.9)", Arc::new(store), keys).await;
    });
}
