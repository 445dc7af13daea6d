//! The whole pipeline into NATS JetStream (file storage, one replica) against raw async-nats
//! JetStream publishes of the same bytes, in one run, on a nats-server started here.
//! Prints events/s, MB/s, p50/p99 from watch event to PubAck, RSS, and bridge/raw.
//!
//! `cargo bench --bench nats [-- EVENTS_1KB EVENTS_10KB]` (needs `nats-server`, which
//! `scripts/test` installs)

#[path = "../tests/support/nats.rs"]
#[allow(dead_code)]
mod nats;

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
    sinks::{self, Sink, nats::NatsSink},
    workqueue::rate_limiter::default_controller_rate_limiter,
};

const WINDOW: usize = 1024;

/// Wraps a sink to sample the time from watch event to acknowledgement.
struct Timed {
    inner: NatsSink,
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
        // The object is about `size` bytes of JSON.
        data: serde_json::json!({"data": {"payload": "x".repeat(size.saturating_sub(220))}}),
    })
}

fn rss_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// Resets VmHWM (peak RSS) to the current RSS, so each phase reports its own peak.
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

fn notifications(events: usize, objects: usize, size: usize) -> Vec<Notification> {
    let versions: Vec<[Arc<DynamicObject>; 2]> = (0..objects)
        .map(|i| {
            [
                object(i, 2 * i as u64 + 1, size),
                object(i, 2 * i as u64 + 2, size),
            ]
        })
        .collect();
    (0..events)
        .map(|n| {
            let i = n % objects;
            let flip = (n / objects) % 2;
            // A new resourceVersion per event and per run, so that every message id is distinct
            // (JetStream would drop a repeated id as a duplicate).
            let new = object(i, (size as u64) * 10_000_000 + n as u64, size);
            Notification {
                kind: NotificationKind::Update {
                    old: versions[i][flip].clone(),
                    new,
                },
                received: std::time::Instant::now(),
                observed: jiff::Timestamp::now(),
            }
        })
        .collect()
}

struct Figures {
    peak_rss: f64,
    events: usize,
    bytes: u64,
    elapsed: Duration,
    p50: f64,
    p99: f64,
}

impl Figures {
    fn print(&self, label: &str) {
        let s = self.elapsed.as_secs_f64();
        println!(
            "  {label:<7} {:>9.0} events/s {:>8.1} MB/s   p50 {:>7.2} ms  p99 {:>7.2} ms   peak RSS {:.0} MiB",
            self.events as f64 / s,
            self.bytes as f64 / 1e6 / s,
            self.p50,
            self.p99,
            self.peak_rss,
        );
    }
}

async fn bridge(url: &str, events: usize, size: usize, metrics: &Metrics) -> Figures {
    let sink_cfg: SinkConfig = serde_json::from_value(serde_json::json!({
        "name": "nats", "type": "nats",
        "nats": {"servers": [url], "max_in_flight": WINDOW, "stream": {"name": "BENCH"}},
    }))
    .unwrap();
    let sink = Arc::new(Timed {
        inner: NatsSink::connect("nats", sink_cfg.nats.as_ref().unwrap())
            .await
            .unwrap(),
        samples: Mutex::new(Vec::new()),
    });
    let budget = Arc::new(Budget::new(100_000));
    let name = format!("configmap/nats-{size}");
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
        .with_label_values(&["nats", "configmap"])
        .get();
    reset_peak_rss();
    let running = pipeline::start(&[(route, WINDOW)]);
    let start = Instant::now();
    for mut n in notes {
        // Like an informer: stamp on receipt. Keep about two windows' worth held (as raw keeps
        // one window in flight), so that nothing is coalesced and latency is not a backlog.
        while budget.held() > 2 * WINDOW {
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
        .with_label_values(&["nats", "configmap"])
        .get()
        - bytes_before;
    let (p50, p99) = percentiles(std::mem::take(&mut *sink.samples.lock().unwrap()));
    Figures {
        peak_rss: rss_mib("VmHWM:"),
        events,
        bytes,
        elapsed,
        p50,
        p99,
    }
}

async fn raw(url: &str, events: usize, size: usize) -> Figures {
    // The same bytes the bridge publishes, encoded before the clock starts.
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
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::ContextBuilder::new()
        .max_ack_inflight(WINDOW)
        .backpressure_on_inflight(true)
        .build(client);
    let mut acks = FuturesUnordered::new();
    let mut samples = Vec::with_capacity(events);
    let mut bytes = 0;
    reset_peak_rss();
    let start = Instant::now();
    for m in messages {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("raw-{}", m.id).as_str());
        headers.insert("content-type", m.content_type);
        let subject = format!(
            "k8s.bench.core.ConfigMap.{}.{}",
            m.namespace.as_deref().unwrap(),
            m.name
        );
        bytes += m.payload.len() as u64;
        let sent = Instant::now();
        let ack = js
            .publish_with_headers(subject, headers, m.payload)
            .await
            .unwrap();
        acks.push(async move {
            ack.await.unwrap();
            sent.elapsed().as_micros() as u32
        });
        while acks.len() >= WINDOW {
            samples.push(acks.next().await.unwrap());
        }
    }
    while let Some(s) = acks.next().await {
        samples.push(s);
    }
    let elapsed = start.elapsed();
    let (p50, p99) = percentiles(samples);
    Figures {
        peak_rss: rss_mib("VmHWM:"),
        events,
        bytes,
        elapsed,
        p50,
        p99,
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let events_1k = args.first().copied().unwrap_or(200_000);
    let events_10k = args.get(1).copied().unwrap_or(30_000);
    let server = nats::NatsServer::start();
    let url = server.url();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = async_nats::connect(&url).await.unwrap();
        async_nats::jetstream::new(client)
            .create_stream(async_nats::jetstream::stream::Config {
                name: "BENCH".into(),
                subjects: vec!["k8s.>".into()],
                storage: async_nats::jetstream::stream::StorageType::File,
                num_replicas: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        let metrics = Metrics::new();
        println!("nats bench: nats-server {} JetStream, file storage, 1 replica; {WINDOW} in flight; 2 runtime threads", url);
        for (events, size) in [(events_1k, 1_000), (events_10k, 10_000)] {
            let b = bridge(&url, events, size, &metrics).await;
            let r = raw(&url, events, size).await;
            println!(
                "{events} events, objects of ~{} KB (messages with oldObject: ~{:.1} KB); peak RSS includes the pre-built inputs:",
                size / 1000,
                b.bytes as f64 / b.events as f64 / 1000.0
            );
            b.print("bridge");
            r.print("raw");
            println!(
                "  ratio bridge/raw: {:.2}",
                (b.events as f64 / b.elapsed.as_secs_f64()) / (r.events as f64 / r.elapsed.as_secs_f64())
            );
        }
    });
}
