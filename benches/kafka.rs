//! The whole pipeline into Kafka (informer side → queue → encoder → producer, delivered =
//! delivery report) against a plain rdkafka producer sending the same pre-encoded bytes, in
//! one run, for ~1 KB and ~10 KB objects. Brokers: tansu (a real Kafka-protocol broker,
//! started here) and librdkafka's in-process mock cluster.
//!
//! `cargo bench --bench kafka [-- EVENTS_1KB EVENTS_10KB]` (needs `tansu`, which
//! `scripts/test` installs)

#[path = "../tests/support/kafka.rs"]
#[allow(dead_code)]
mod kafka;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{FutureExt, StreamExt, future::BoxFuture, stream::FuturesUnordered};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, TypeMeta};
use kube_event_bridge::{
    config::{EventType, MessageConfig, SinkConfig},
    informer::{Notification, NotificationKind, ProcessorListener},
    message::{Encoder, Encoding, Message},
    metrics::Metrics,
    pipeline::{self, Budget, Delivery, Route, RouteQueue},
    sinks::{self, Sink, kafka::KafkaSink},
    workqueue::rate_limiter::default_controller_rate_limiter,
};
use rdkafka::{
    ClientConfig,
    producer::{FutureProducer, FutureRecord},
};

const WORKERS: usize = 1024;
const TOPIC: &str = "bench";

struct Timed {
    inner: KafkaSink,
    samples: Mutex<Vec<u32>>,
}

impl Sink for Timed {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, sinks::Result<()>> {
        async move {
            self.inner.publish(m).await?;
            self.samples
                .lock()
                .unwrap()
                .push(m.received.elapsed().as_micros() as u32);
            Ok(())
        }
        .boxed()
    }
    fn flush(&self) -> BoxFuture<'_, sinks::Result<()>> {
        self.inner.flush()
    }
}

fn object(i: usize, rv: u64, size: usize) -> Arc<DynamicObject> {
    Arc::new(DynamicObject {
        types: Some(TypeMeta {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
        }),
        metadata: ObjectMeta {
            name: Some(format!("config-{i:06}")),
            namespace: Some(format!("team-{}", i % 50)),
            uid: Some(format!("8d0c1f7e-0000-4000-8000-{i:012}")),
            resource_version: Some(rv.to_string()),
            ..Default::default()
        },
        data: serde_json::json!({"data": {"payload": "x".repeat(size.saturating_sub(220))}}),
    })
}

fn notifications(events: usize, objects: usize, size: usize) -> Vec<Notification> {
    let old: Vec<Arc<DynamicObject>> = (0..objects).map(|i| object(i, 1, size)).collect();
    (0..events)
        .map(|n| Notification {
            kind: NotificationKind::Update {
                old: old[n % objects].clone(),
                new: object(n % objects, 2 + n as u64, size),
            },
            received: std::time::Instant::now(),
            observed: jiff::Timestamp::now(),
        })
        .collect()
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn percentiles(mut v: Vec<u32>) -> (f64, f64) {
    v.sort_unstable();
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    (p(0.5), p(0.99))
}

struct Figures {
    events: usize,
    bytes: u64,
    elapsed: Duration,
    p50: f64,
    p99: f64,
    peak_rss: f64,
}

impl Figures {
    fn rate(&self) -> f64 {
        self.events as f64 / self.elapsed.as_secs_f64()
    }
    fn print(&self, label: &str) {
        println!(
            "    {label:<7} {:>9.0} events/s {:>8.1} MB/s   p50 {:>7.2} ms  p99 {:>7.2} ms   peak RSS {:.0} MiB",
            self.rate(),
            self.bytes as f64 / 1e6 / self.elapsed.as_secs_f64(),
            self.p50,
            self.p99,
            self.peak_rss,
        );
    }
}

async fn bridge(
    brokers: &str,
    events: usize,
    size: usize,
    metrics: &Metrics,
    run: usize,
) -> Figures {
    let cfg: SinkConfig = serde_json::from_value(serde_json::json!({
        "name": "kafka", "type": "kafka",
        "kafka": {"brokers": [brokers], "topic": TOPIC},
    }))
    .unwrap();
    let sink = Arc::new(Timed {
        inner: KafkaSink::connect("kafka", cfg.kafka.as_ref().unwrap())
            .await
            .unwrap(),
        samples: Mutex::new(Vec::new()),
    });
    let budget = Arc::new(Budget::new(100_000));
    let name = format!("configmap/kafka-{run}");
    let queue = Arc::new(RouteQueue::new(
        name.clone(),
        Box::new(default_controller_rate_limiter()),
        metrics.workqueue.for_queue(&name),
        budget.clone(),
        metrics
            .listener_buffered
            .with_label_values(&["configmap", &name]),
        metrics
            .listener_coalesced
            .with_label_values(&["configmap", &name]),
    ));
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("", "v1", "ConfigMap"),
        "configmaps",
    );
    let route = Arc::new(Route::new(
        "configmap".into(),
        queue.clone(),
        Encoder::new(
            "bench",
            &resource,
            &MessageConfig::default(),
            Encoding::Structured,
        ),
        Arc::new(Delivery {
            sink: sink.clone(),
            dead_letter: None,
            publish_limit: None,
            max_retries: None,
        }),
        metrics,
    ));
    let listener = ProcessorListener::new("bench", &[EventType::Updated], None, queue.clone());
    let notes = notifications(events, 10_000, size);
    let bytes_before = metrics
        .sink_bytes
        .with_label_values(&["kafka", "configmap"])
        .get();
    reset_peak_rss();
    let running = pipeline::start(&[(route, WORKERS)]);
    let start = Instant::now();
    for mut n in notes {
        // Stamp on receipt, like an informer; keep two worker-fulls held so nothing coalesces.
        while budget.held() > 2 * WORKERS {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        n.received = std::time::Instant::now();
        listener.add(n);
    }
    while budget.held() > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = start.elapsed();
    running
        .drain(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
    let bytes = metrics
        .sink_bytes
        .with_label_values(&["kafka", "configmap"])
        .get()
        - bytes_before;
    let (p50, p99) = percentiles(std::mem::take(&mut *sink.samples.lock().unwrap()));
    Figures {
        events,
        bytes,
        elapsed,
        p50,
        p99,
        peak_rss: peak_rss_mib(),
    }
}

async fn raw(brokers: &str, events: usize, size: usize) -> Figures {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("", "v1", "ConfigMap"),
        "configmaps",
    );
    let encoder = Encoder::new(
        "bench",
        &resource,
        &MessageConfig::default(),
        Encoding::Structured,
    );
    let messages: Vec<Message> = notifications(events, 10_000, size)
        .iter()
        .map(|n| encoder.encode(&n.key(), n).unwrap())
        .collect();
    // The same producer settings as the sink's.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("compression.type", "lz4")
        .set("linger.ms", "5")
        .create()
        .unwrap();
    let mut pending = FuturesUnordered::new();
    let mut samples = Vec::with_capacity(events);
    let mut bytes = 0;
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
    let elapsed = start.elapsed();
    let (p50, p99) = percentiles(samples);
    Figures {
        events,
        bytes,
        elapsed,
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
            let b = runtime.block_on(bridge(&brokers, events, size, &metrics, run));
            let r = runtime.block_on(raw(&brokers, events, size));
            println!(
                "  {events} events, objects of ~{} KB (messages with oldObject: ~{:.1} KB):",
                size / 1000,
                b.bytes as f64 / b.events as f64 / 1000.0
            );
            b.print("bridge");
            r.print("raw");
            println!("    ratio bridge/raw: {:.2}", b.rate() / r.rate());
        }
    }
}
