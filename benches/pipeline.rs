//! Throughput of the delivery pipeline with a sink that acknowledges at once:
//! synthetic informer (a thread calling the listener) → ProcessorListener → RouteQueue →
//! workers → CloudEvents encoder → sink. Prints notifications/s, p50/p99 time from the
//! informer to the sink, and peak RSS.
//!
//! `cargo bench --bench pipeline [-- NOTIFICATIONS OBJECTS WORKERS]`

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{FutureExt, future::BoxFuture};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, TypeMeta};
use kube_event_bridge::{
    config::{EventType, MessageConfig},
    informer::{Notification, NotificationKind, ProcessorListener},
    message::{Encoder, Encoding, Message},
    metrics::Metrics,
    pipeline::{self, Budget, Delivery, Route, RouteQueue},
    sinks::{self, Sink},
    workqueue::rate_limiter::default_controller_rate_limiter,
};

/// Acknowledges at once; samples the time each message spent between informer and sink.
struct AckSink {
    count: AtomicU64,
    bytes: AtomicU64,
    samples: Mutex<Vec<u32>>,
}

impl Sink for AckSink {
    fn name(&self) -> &str {
        "ack"
    }
    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, sinks::Result<()>> {
        let n = self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes
            .fetch_add(m.payload.len() as u64, Ordering::Relaxed);
        if n.is_multiple_of(32) {
            let micros = m.received.elapsed().as_micros().min(u32::MAX as u128) as u32;
            self.samples.lock().unwrap().push(micros);
        }
        async { Ok(()) }.boxed()
    }
    fn flush(&self) -> BoxFuture<'_, sinks::Result<()>> {
        async { Ok(()) }.boxed()
    }
}

fn object(i: usize, rv: u64) -> Arc<DynamicObject> {
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
            labels: Some([("app".to_string(), "bench".to_string())].into()),
            ..Default::default()
        },
        data: serde_json::json!({"data": {"setting": "x".repeat(200), "mode": "fast"}}),
    })
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p) as usize] as f64 / 1000.0
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let total = args.first().copied().unwrap_or(2_000_000);
    let objects = args.get(1).copied().unwrap_or(10_000);
    let workers = args.get(2).copied().unwrap_or(8);
    // The sink-wide cap (the default `max_pending`). The producer pauses while more than
    // `backlog` notifications are held, so the figures measure sustained delivery with nothing
    // coalesced; a real informer does not pause, and beyond the cap it would coalesce.
    let cap = 100_000;
    let backlog = 20_000;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let metrics = Arc::new(Metrics::new());
    let budget = Arc::new(Budget::new(cap));
    let queue = Arc::new(RouteQueue::new(
        "configmap/ack".into(),
        Box::new(default_controller_rate_limiter()),
        metrics.workqueue.for_queue("configmap/ack"),
        budget.clone(),
        metrics
            .listener_buffered
            .with_label_values(&["configmap", "ack"]),
        metrics
            .listener_coalesced
            .with_label_values(&["configmap", "ack"]),
    ));
    let sink = Arc::new(AckSink {
        count: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        samples: Mutex::new(Vec::new()),
    });
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
        &metrics,
    ));
    let listener = ProcessorListener::new(
        "configmap/ack",
        &[
            EventType::Added,
            EventType::Updated,
            EventType::Deleted,
            EventType::Synced,
        ],
        None,
        queue.clone(),
    );
    // Two versions of every object, so that each notification is a real update.
    let versions: Vec<[Arc<DynamicObject>; 2]> = (0..objects)
        .map(|i| [object(i, 2 * i as u64 + 1), object(i, 2 * i as u64 + 2)])
        .collect();

    let running = pipeline::start(&[(route, workers)]);
    let start = Instant::now();
    let producer_budget = budget.clone();
    let producer = std::thread::spawn(move || {
        for n in 0..total {
            while producer_budget.held() > backlog {
                std::thread::sleep(Duration::from_micros(50));
            }
            let i = n % objects;
            let flip = (n / objects) % 2;
            let (old, new) = (versions[i][flip].clone(), versions[i][1 - flip].clone());
            listener.add(Notification {
                kind: NotificationKind::Update { old, new },
                received: std::time::Instant::now(),
                observed: jiff::Timestamp::now(),
            });
        }
        start.elapsed()
    });
    let produced_in = producer.join().unwrap();
    runtime.block_on(async {
        while budget.held() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    let elapsed = start.elapsed();
    runtime.block_on(running.drain(tokio::time::Instant::now() + Duration::from_secs(5)));

    let delivered = sink.count.load(Ordering::Relaxed);
    let coalesced = metrics
        .listener_coalesced
        .with_label_values(&["configmap", "ack"])
        .get();
    let mut samples = std::mem::take(&mut *sink.samples.lock().unwrap());
    samples.sort_unstable();
    println!(
        "pipeline bench: {total} notifications, {objects} objects, {workers} workers, backlog {backlog}, cap {cap}, 2 runtime threads"
    );
    println!("  produced in        {:>10.3} s", produced_in.as_secs_f64());
    println!(
        "  delivered          {delivered:>10}   (coalesced {coalesced}; delivered + coalesced = {})",
        delivered + coalesced
    );
    println!(
        "  throughput         {:>10.0} notifications/s delivered",
        delivered as f64 / elapsed.as_secs_f64()
    );
    println!(
        "  payload            {:>10.1} MB/s",
        sink.bytes.load(Ordering::Relaxed) as f64 / 1e6 / elapsed.as_secs_f64()
    );
    println!(
        "  informer → sink    p50 {:.3} ms, p99 {:.3} ms ({} samples)",
        percentile(&samples, 0.5),
        percentile(&samples, 0.99),
        samples.len()
    );
    println!("  peak RSS           {:>10.1} MiB", peak_rss_mib());
}
