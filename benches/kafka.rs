//! The whole pipeline into Kafka (delivered = delivery report) against a plain rdkafka
//! producer sending the same pre-encoded bytes, in one run, for ~1 KB and ~10 KB objects.
//! Brokers: tansu (a real Kafka-protocol broker, started here) and librdkafka's in-process
//! mock cluster.
//!
//! `cargo bench --bench kafka [-- EVENTS_1KB EVENTS_10KB]` (needs `tansu`, which
//! `scripts/test` installs)

#[path = "../tests/support/kafka.rs"]
#[allow(dead_code)]
mod kafka;
mod support;

use std::{sync::Arc, time::Instant};

use futures::{StreamExt, stream::FuturesUnordered};
use kube_event_bridge::{
    config::SinkConfig,
    message::Message,
    metrics::Metrics,
    sinks::CheckpointStore,
    sinks::kafka::{KafkaCheckpointStore, KafkaSink},
};
use rdkafka::{
    ClientConfig,
    producer::Producer,
    producer::{FutureProducer, FutureRecord},
};
use support::{
    Figures, Timed, bridge_figures, encoder, notifications, peak_rss_mib, percentiles,
    reset_peak_rss,
};

const WORKERS: usize = 1024;
const TOPIC: &str = "bench";

async fn bridge(
    brokers: &str,
    events: usize,
    size: usize,
    metrics: &Metrics,
    run: usize,
    resume: bool,
) -> Figures {
    let cfg: SinkConfig = serde_json::from_value(serde_json::json!({
        "name": "kafka", "type": "kafka", "kafka": {"brokers": [brokers], "topic": TOPIC},
    }))
    .unwrap();
    // Built before the clock starts, as raw's messages are encoded before it starts.
    let notes: Vec<_> = notifications(events, 10_000, size).collect();
    let kafka = KafkaSink::connect("kafka", cfg.kafka.as_ref().unwrap())
        .await
        .unwrap();
    let name = format!("kafka-{run}");
    let store: Option<Arc<dyn CheckpointStore>> = if resume {
        let store = KafkaCheckpointStore::open("kafka", cfg.kafka.as_ref().unwrap(), &kafka)
            .await
            .unwrap();
        Some(Arc::new(store))
    } else {
        None
    };
    let sink = Arc::new(Timed::new(kafka));
    bridge_figures(sink, notes, WORKERS, metrics, &name, store).await
}

async fn raw(brokers: &str, events: usize, size: usize) -> Figures {
    let enc = encoder();
    let messages: Vec<Message> = notifications(events, 10_000, size)
        .map(|n| enc.encode(&n.key(), &n).unwrap())
        .collect();
    // The sink's producer settings.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("compression.type", "lz4")
        .set("linger.ms", "5")
        .create()
        .unwrap();
    // Connected before the clock starts, as the bridge's sink is.
    producer
        .client()
        .fetch_metadata(Some(TOPIC), std::time::Duration::from_secs(10))
        .unwrap();
    let mut pending = FuturesUnordered::new();
    let (mut samples, mut bytes) = (Vec::with_capacity(events), 0);
    reset_peak_rss();
    let start = Instant::now();
    for m in &messages {
        bytes += m.payload.len() as u64;
        let sent = Instant::now();
        let mut record = FutureRecord::to(TOPIC).key(&m.key).payload(&m.payload[..]);
        let delivery = loop {
            match producer.send_result(record) {
                Ok(d) => break d,
                Err((_, r)) => {
                    // Local queue full: wait for some deliveries, as any producer must.
                    record = r;
                    if let Some(s) = pending.next().await {
                        samples.push(s);
                    }
                }
            }
        };
        pending.push(async move {
            delivery.await.unwrap().unwrap();
            sent.elapsed().as_micros() as u32
        });
    }
    while let Some(s) = pending.next().await {
        samples.push(s);
    }
    let secs = start.elapsed().as_secs_f64();
    let (p50, p99) = percentiles(samples);
    Figures {
        events,
        bytes,
        secs,
        p50,
        p99,
        peak_rss: peak_rss_mib(),
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let events_1k = args.first().copied().unwrap_or(100_000);
    let events_10k = args.get(1).copied().unwrap_or(20_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let metrics = Metrics::new();
    println!(
        "kafka bench: {WORKERS} pipeline workers, idempotent producer, acks=all, lz4, linger 5 ms; 2 runtime threads"
    );
    let tansu = kafka::Tansu::start();
    tansu.create_topic(TOPIC, 3);
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    mock.create_topic(TOPIC, 3, 1).unwrap();
    let mut run = 0;
    for (broker, brokers) in [
        ("tansu 0.6 (debug build)", tansu.brokers()),
        ("librdkafka mock cluster", mock.bootstrap_servers()),
    ] {
        println!("{broker}:");
        for (events, size) in [(events_1k, 1_000), (events_10k, 10_000)] {
            run += 1;
            // Resume off and on alternate (off, on, off, on) so that neither gains from going
            // later (warm caches, a broker's growing log); the faster run of each counts: a
            // single run is at the mercy of the bridge's occasional 0.5 s stalls.
            let (mut b, mut on): (Option<Figures>, Option<Figures>) = (None, None);
            for _ in 0..2 {
                for (resume, best) in [(false, &mut b), (true, &mut on)] {
                    run += 1;
                    let f = runtime.block_on(bridge(&brokers, events, size, &metrics, run, resume));
                    if best.as_ref().is_none_or(|x| f.rate() > x.rate()) {
                        *best = Some(f);
                    }
                }
            }
            let (b, on) = (b.expect("two runs"), on.expect("two runs"));
            let r = runtime.block_on(raw(&brokers, events, size));
            println!(
                "  {events} events, objects of ~{} KB (messages with oldObject: ~{:.1} KB):",
                size / 1000,
                b.bytes as f64 / b.events as f64 / 1000.0
            );
            b.print("bridge");
            on.print("resume");
            r.print("raw");
            println!("    ratio bridge/raw: {:.2}", b.rate() / r.rate());
            println!(
                "    ratio resume on/off: {:.2} (best of two runs each; checkpoint of 10,000 keys written every second, final write included)",
                on.rate() / b.rate()
            );
        }
    }
}
