//! The whole pipeline into Kafka (delivered = delivery report) against a plain rdkafka
//! producer with the sink's own settings sending the same pre-encoded bytes, for ~1 KB and
//! ~10 KB objects: `BENCH_RUNS` rounds (3 by default), each running every side once in a
//! rotating order; each run's rate, then medians and spread, are printed. On Apache Kafka a
//! fourth side runs the bridge with `exactly_once` (and resume): its cost as a ratio.
//! Brokers: Apache Kafka (a single KRaft node, started here from the jars `scripts/test`
//! copies) and librdkafka's in-process mock cluster.
//!
//! `cargo bench --bench kafka [-- EVENTS_1KB EVENTS_10KB]` (needs Apache Kafka's jars,
//! which `scripts/test` copies). `BENCH_OBJECTS` sets how many objects the events update (10,000);
//! `BENCH_ONLY=Apache` or `BENCH_ONLY=mock` runs one broker, `BENCH_SIDES=off,raw` some of the
//! sides (`off`, `on`, `raw`, `eos`; e.g. under a profiler); `BENCH_IN_FLIGHT` the bridge's
//! `max_objects_in_flight` (its default: 4,096, 32,768 with exactly once), and
//! `BENCH_IN_FLIGHT_BYTES` its `max_bytes_in_flight` (16 MiB, 128 MiB with exactly once).

#[path = "../tests/support/kafka.rs"]
#[allow(dead_code)]
mod kafka;
#[path = "../tests/support/loopback.rs"]
mod loopback;
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
    Figures, Runs, Timed, bridge_figures, encoder, notifications, own_cpu_seconds, peak_rss_mib,
    percentiles, reset_peak_rss,
};

const TOPIC: &str = "bench";

/// Events of each size sent before that size's runs, not counted.
const WARM_UP: usize = 100_000;

/// The sides' names, as the runs line and `BENCH_SIDES` spell them.
const SIDES: [&str; 4] = ["off", "on", "raw", "eos"];

/// Whether `BENCH_SIDES` (a comma-separated list; all sides when unset) names `side`.
fn wanted(side: &str) -> bool {
    std::env::var("BENCH_SIDES")
        .map(|sides| sides.split(',').any(|s| s.trim() == side))
        .unwrap_or(true)
}

/// The sink config both sides use.
fn sink_config(brokers: &str) -> SinkConfig {
    serde_json::from_value(serde_json::json!({
        "name": "kafka", "type": "kafka", "kafka": {"brokers": [brokers], "topic": TOPIC},
    }))
    .unwrap()
}

/// The bridge side's mode: resume off or on, or exactly once (resume on, transactions).
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    Resume,
    ExactlyOnce,
}

/// The librdkafka settings of the bridge's producer, which the raw producer uses as well.
fn producer_settings(brokers: &str) -> ClientConfig {
    kube_event_bridge::sinks::kafka::client_config(
        "bench",
        sink_config(brokers).kafka.as_ref().unwrap(),
    )
    .unwrap()
}

async fn bridge(
    brokers: &str,
    events: usize,
    size: usize,
    metrics: &Metrics,
    run: usize,
    mode: Mode,
) -> Figures {
    let mut cfg = sink_config(brokers);
    if mode == Mode::ExactlyOnce {
        cfg.kafka.as_mut().unwrap().exactly_once = true;
    }
    // Built before the clock starts, as raw's messages are encoded before it starts.
    let notes: Vec<_> = notifications(events, support::objects(), size).collect();
    let kafka = KafkaSink::connect("kafka", cfg.kafka.as_ref().unwrap())
        .await
        .unwrap()
        .with_transactions("bench", cfg.kafka.as_ref().unwrap(), metrics);
    // The term's transactional producer, made before the clock starts.
    kube_event_bridge::sinks::Sink::begin_term(
        &kafka,
        kube_event_bridge::shard::Shard::WHOLE,
        None,
    )
    .await
    .unwrap();
    let name = format!("kafka-{run}");
    let store: Option<Arc<dyn CheckpointStore>> = if mode != Mode::Plain {
        let store = KafkaCheckpointStore::open("kafka", cfg.kafka.as_ref().unwrap(), &kafka)
            .await
            .unwrap();
        Some(Arc::new(store))
    } else {
        None
    };
    let sink = Arc::new(Timed::new(kafka));
    let in_flight = (cfg.objects_in_flight(), cfg.bytes_in_flight());
    bridge_figures(
        sink,
        notes,
        support::workers(),
        in_flight,
        metrics,
        &name,
        store,
    )
    .await
}

async fn raw(brokers: &str, events: usize, size: usize) -> Figures {
    let enc = encoder();
    let messages: Vec<Message> = notifications(events, support::objects(), size)
        .map(|n| enc.encode(n.key(), &n).unwrap())
        .collect();
    // Exactly the sink's producer settings (the function the sink builds its producer with).
    let producer: FutureProducer = producer_settings(brokers).create().unwrap();
    // Connected before the clock starts, as the bridge's sink is.
    producer
        .client()
        .fetch_metadata(Some(TOPIC), std::time::Duration::from_secs(10))
        .unwrap();
    let mut pending = FuturesUnordered::new();
    let (mut samples, mut bytes) = (Vec::with_capacity(events), 0);
    reset_peak_rss();
    let cpu0 = own_cpu_seconds();
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
    let cpu = own_cpu_seconds() - cpu0;
    let (p50, p99) = percentiles(samples);
    Figures {
        events,
        bytes,
        secs,
        cpu,
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
    let rounds = support::runs();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let metrics = Metrics::new();
    let mut settings: Vec<(String, String)> = producer_settings("BROKERS")
        .config_map()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    settings.sort();
    println!(
        "kafka bench: {} pipeline workers (BENCH_WORKERS); events over {} objects (BENCH_OBJECTS); 2 runtime threads; {rounds} rounds, each running bridge (resume off), bridge (resume on), raw and (Apache Kafka only) bridge (exactly once) once, in an order that rotates each round; medians and spread printed",
        support::workers(),
        support::objects()
    );
    println!(
        "  producer settings of both sides (kube_event_bridge::sinks::kafka::client_config): {}",
        settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let broker = kafka::Kafka::start();
    broker.create_topic(TOPIC, 3);
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    mock.create_topic(TOPIC, 3, 1).unwrap();
    let mut run = 0;
    let only = std::env::var("BENCH_ONLY").ok();
    for (broker, brokers) in [
        ("Apache Kafka 4.3 (one KRaft node)", broker.brokers()),
        ("librdkafka mock cluster", mock.bootstrap_servers()),
    ]
    .into_iter()
    .filter(|(broker, _)| only.as_deref().is_none_or(|o| broker.contains(o)))
    {
        let mock_broker = broker.contains("mock");
        println!("{broker}:");
        // Not counted: a fresh broker's first produce requests run interpreted (Apache Kafka's
        // JIT compiles its produce path meanwhile, on the same two cores), which made the
        // first runs up to half as fast as the later ones. This shortens that, it does not
        // end it: the rotating order and the medians do the rest.
        for (events, size) in [(events_1k, 1_000), (events_10k, 10_000)] {
            // Each size warmed up apart, with WARM_UP events whatever the runs' count: the
            // broker's JIT compiles another path for larger batches, which it did through the
            // first 10 KB rounds when only 1 KB was warmed (and through the first two or
            // three after 20,000 events of 10 KB).
            let warm_up = runtime.block_on(raw(&brokers, WARM_UP, size));
            println!(
                "  warm-up (not counted): raw, {} events of ~{} KB, {:.0} events/s",
                warm_up.events,
                size / 1000,
                warm_up.rate()
            );
            // Interleaved: every round runs each side once, the order rotating, so that no
            // side gains from going later (warm caches, a broker's growing log).
            let (mut off, mut on, mut raw_runs, mut eos) = (
                Runs::default(),
                Runs::default(),
                Runs::default(),
                Runs::default(),
            );
            // Exactly once on Apache Kafka only: the mock cluster neither fences nor hides
            // aborted records.
            let sides = if mock_broker { 3 } else { 4 };
            let mut lines = Vec::new();
            for round in 0..rounds {
                for side in (0..sides)
                    .map(|k| (k + round) % sides)
                    .filter(|&side| wanted(SIDES[side]))
                {
                    run += 1;
                    let bridge = |mode| bridge(&brokers, events, size, &metrics, run, mode);
                    let f = match side {
                        0 => runtime.block_on(bridge(Mode::Plain)),
                        1 => runtime.block_on(bridge(Mode::Resume)),
                        2 => runtime.block_on(raw(&brokers, events, size)),
                        _ => runtime.block_on(bridge(Mode::ExactlyOnce)),
                    };
                    lines.push(format!("{}:{:.0}", SIDES[side], f.rate()));
                    [&mut off, &mut on, &mut raw_runs, &mut eos][side].0.push(f);
                }
            }
            let first = [&off, &on, &raw_runs, &eos]
                .into_iter()
                .find_map(|r| r.0.first())
                .expect("BENCH_SIDES names no side");
            println!(
                "  {events} events, objects of ~{} KB (messages with oldObject: ~{:.1} KB); runs in order (events/s): {}",
                size / 1000,
                first.bytes as f64 / first.events as f64 / 1000.0,
                lines.join(" ")
            );
            for (runs, label) in [
                (&off, "bridge"),
                (&on, "resume"),
                (&raw_runs, "raw"),
                (&eos, "exactly once"),
            ] {
                if !runs.0.is_empty() {
                    runs.print(label);
                }
            }
            // A ratio of the sides that ran.
            let ratio = |a: &Runs, b: &Runs| {
                if a.0.is_empty() || b.0.is_empty() {
                    "-".to_owned()
                } else {
                    format!("{:.2}", a.median_rate() / b.median_rate())
                }
            };
            println!("    ratio bridge/raw: {} (medians)", ratio(&off, &raw_runs));
            if !off.0.is_empty() && !raw_runs.0.is_empty() {
                println!(
                    "    the bridge's own work: {:.1} µs CPU/event more than raw (medians; this process's CPU, the broker's not counted)",
                    off.median_cpu_us() - raw_runs.median_cpu_us()
                );
            }
            println!(
                "    ratio resume on/off: {} (medians; checkpoint of 10,000 keys written every second, final write included)",
                ratio(&on, &off)
            );
            if sides == 4 {
                println!(
                    "    ratio exactly once/resume on: {}, exactly once/raw: {} (medians; a transaction committed every 100 ms, each message's checkpoint record in it)",
                    ratio(&eos, &on),
                    ratio(&eos, &raw_runs)
                );
            }
        }
    }
}
