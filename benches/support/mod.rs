//! What every benchmark shares: a synthetic informer feeding one route (listener → route
//! queue → workers → sink), synthetic ConfigMaps, latency percentiles and peak RSS.
#![allow(dead_code)] // each bench uses a different part

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{FutureExt, future::BoxFuture};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, TypeMeta};
use kube_event_bridge::{
    config::{EventType, MessageConfig},
    informer::{
        CachedObject, Notification, NotificationHandler, NotificationKind, ObjectRef,
        ProcessorListener,
    },
    message::{Encoder, Encoding, Message},
    metrics::Metrics,
    pipeline::{
        self, Budget, Checkpointer, Delivery, Route, RouteQueue,
        filter::{self, FilterMetrics, RouteFilter, Rules},
    },
    sinks::{self, Sink},
    workqueue::rate_limiter::default_controller_rate_limiter,
};

/// The ConfigMap resource every bench uses.
pub fn configmaps() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "ConfigMap"), "configmaps")
}

/// The encoder every bench uses (structured CloudEvents, with `oldObject`).
pub fn encoder() -> Encoder {
    Encoder::new(
        "bench",
        &configmaps(),
        &MessageConfig::default(),
        Encoding::Structured,
    )
}

/// A ConfigMap `config-{i}` of about `size` bytes of JSON (at least its metadata).
pub fn object(i: usize, rv: u64, size: usize) -> ObjectRef {
    Arc::new(CachedObject::new(&DynamicObject {
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
        data: serde_json::json!({"data": {"payload": "x".repeat(size.saturating_sub(250))}}),
    }))
}

/// `events` updates over `objects` objects of ~`size` bytes, each with a new object (as an
/// informer decodes one per watch event), generated lazily; every message id is distinct
/// within and across runs of different sizes (JetStream would drop a repeated id).
pub fn notifications(
    events: usize,
    objects: usize,
    size: usize,
) -> impl Iterator<Item = Notification> {
    let old: Vec<ObjectRef> = (0..objects).map(|i| object(i, 1, size)).collect();
    (0..events).map(move |n| Notification {
        kind: NotificationKind::Update {
            old: old[n % objects].clone(),
            new: object(n % objects, (size as u64) * 10_000_000 + n as u64, size),
        },
        received: std::time::Instant::now(),
        observed: jiff::Timestamp::now(),
        resumed: false,
        filtered_out: false,
    })
}

/// `events` updates over `objects` objects that alternate between two pre-built versions:
/// the cost of the pipeline alone, without building objects.
pub fn alternating(
    events: usize,
    objects: usize,
    size: usize,
) -> impl Iterator<Item = Notification> {
    let versions: Vec<[ObjectRef; 2]> = (0..objects)
        .map(|i| {
            [
                object(i, 2 * i as u64 + 1, size),
                object(i, 2 * i as u64 + 2, size),
            ]
        })
        .collect();
    (0..events).map(move |n| {
        let (i, flip) = (n % objects, (n / objects) % 2);
        Notification {
            kind: NotificationKind::Update {
                old: versions[i][flip].clone(),
                new: versions[i][1 - flip].clone(),
            },
            received: std::time::Instant::now(),
            observed: jiff::Timestamp::now(),
            resumed: false,
            filtered_out: false,
        }
    })
}

/// Wraps a sink to sample the time from watch event (notification receipt) to acknowledgement.
pub struct Timed<S> {
    pub inner: S,
    pub samples: Arc<Mutex<Vec<u32>>>,
}

impl<S> Timed<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            samples: Arc::new(Mutex::new(Vec::new())),
        }
    }
}

impl<S: Sink> Sink for Timed<S> {
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
    fn submit<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, sinks::Result<sinks::Ack>> {
        async move {
            let ack = self.inner.submit(m).await?;
            let (samples, received) = (self.samples.clone(), m.received);
            Ok(Box::pin(async move {
                ack.await?;
                samples
                    .lock()
                    .unwrap()
                    .push(received.elapsed().as_micros() as u32);
                Ok(())
            }) as sinks::Ack)
        }
        .boxed()
    }
    fn flush(&self) -> BoxFuture<'_, sinks::Result<()>> {
        self.inner.flush()
    }
}

/// (p50, p99) in milliseconds of microsecond samples.
pub fn percentiles(mut v: Vec<u32>) -> (f64, f64) {
    v.sort_unstable();
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    (p(0.5), p(0.99))
}

/// Peak RSS of this process (VmHWM), in MiB.
pub fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// Resets the peak RSS to the current RSS, so that each phase reports its own peak.
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// What one bridge run measured.
pub struct Run {
    pub elapsed: Duration,
    pub delivered_bytes: u64,
    pub coalesced: u64,
    pub peak_rss: f64,
}

/// Pushes `notes` through listener → route queue → `workers` workers → `sink`, like an
/// informer (stamping each on receipt), pausing while more than `backlog` are held so that
/// nothing is coalesced, and waits until all are delivered.
pub async fn run_bridge(
    sink: Arc<dyn Sink>,
    notes: impl IntoIterator<Item = Notification>,
    workers: usize,
    backlog: usize,
    metrics: &Metrics,
    name: &str,
) -> Run {
    run_bridge_with(sink, notes, workers, backlog, metrics, name, None).await
}

/// [`run_bridge`], with the route recording acknowledgements into `checkpointer` (written
/// every second in the background, as the service does with resume on; the final write is
/// part of the measured time).
pub async fn run_bridge_with(
    sink: Arc<dyn Sink>,
    notes: impl IntoIterator<Item = Notification>,
    workers: usize,
    backlog: usize,
    metrics: &Metrics,
    name: &str,
    checkpointer: Option<Arc<Checkpointer>>,
) -> Run {
    run_bridge_opts(
        sink,
        notes,
        workers,
        backlog,
        metrics,
        name,
        checkpointer,
        encoder(),
        None,
    )
    .await
}

/// [`run_bridge_with`] with `encoder` and, when given, a filter stage with `rules` between
/// the listener and the route queue (as the service wires a resource with a `filter`).
#[allow(clippy::too_many_arguments)]
pub async fn run_bridge_opts(
    sink: Arc<dyn Sink>,
    notes: impl IntoIterator<Item = Notification>,
    workers: usize,
    backlog: usize,
    metrics: &Metrics,
    name: &str,
    checkpointer: Option<Arc<Checkpointer>>,
    encoder: Encoder,
    rules: Option<Arc<Rules>>,
) -> Run {
    let budget = Arc::new(Budget::new(100_000));
    let queue = Arc::new(RouteQueue::new(
        name.to_owned(),
        Box::new(default_controller_rate_limiter()),
        metrics.workqueue.for_queue(name),
        budget.clone(),
        metrics
            .listener_buffered
            .with_label_values(&["configmap", name]),
        metrics
            .listener_coalesced
            .with_label_values(&["configmap", name]),
    ));
    let sink_name = sink.name().to_owned();
    let mut route = Route::new(
        "configmap".into(),
        queue.clone(),
        encoder,
        Arc::new(Delivery {
            sink,
            dead_letter: None,
            publish_limit: None,
            max_retries: None,
        }),
        metrics,
    );
    if let Some(c) = &checkpointer {
        route = route.with_checkpointer(c.clone());
    }
    let route = Arc::new(route);
    let cancel = tokio_util::sync::CancellationToken::new();
    let writer = checkpointer
        .clone()
        .map(|c| tokio::spawn(c.run(Duration::from_secs(1), cancel.clone())));
    let all = [
        EventType::Added,
        EventType::Updated,
        EventType::Deleted,
        EventType::Synced,
    ];
    let front: Arc<dyn NotificationHandler> = match rules {
        Some(rules) => Arc::new(RouteFilter::new(
            name.to_owned(),
            rules,
            queue.clone(),
            true,
            FilterMetrics {
                filtered: filter::REASONS
                    .map(|r| metrics.filtered.with_label_values(&["configmap", name, r])),
                errors: metrics
                    .filter_errors
                    .with_label_values(&["configmap", name]),
            },
        )),
        None => queue.clone(),
    };
    let listener = ProcessorListener::new(name, &all, None, front);
    let bytes = || {
        metrics
            .sink_bytes
            .with_label_values(&[&sink_name, "configmap"])
            .get()
    };
    let bytes_before = bytes();
    reset_peak_rss();
    let running = pipeline::start(&[(route, workers)]);
    let start = Instant::now();
    for mut n in notes {
        while budget.held() > backlog {
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
        n.received = std::time::Instant::now();
        listener.add(n);
    }
    while budget.held() > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    cancel.cancel();
    if let (Some(w), Some(c)) = (writer, &checkpointer) {
        let _ = w.await;
        c.flush().await.expect("final checkpoint write");
    }
    let elapsed = start.elapsed();
    running
        .drain(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
    Run {
        elapsed,
        delivered_bytes: bytes() - bytes_before,
        coalesced: metrics
            .listener_coalesced
            .with_label_values(&["configmap", name])
            .get(),
        peak_rss: peak_rss_mib(),
    }
}

/// What one side (bridge or raw) of a broker bench measured.
pub struct Figures {
    pub events: usize,
    pub bytes: u64,
    pub secs: f64,
    pub p50: f64,
    pub p99: f64,
    pub peak_rss: f64,
}

impl Figures {
    /// Events per second.
    pub fn rate(&self) -> f64 {
        self.events as f64 / self.secs
    }

    /// One line: events/s, MB/s, latency percentiles, peak RSS.
    pub fn print(&self, label: &str) {
        println!(
            "    {label:<7} {:>9.0} events/s {:>8.1} MB/s   p50 {:>7.2} ms  p99 {:>7.2} ms   peak RSS {:.0} MiB",
            self.rate(),
            self.bytes as f64 / 1e6 / self.secs,
            self.p50,
            self.p99,
            self.peak_rss
        );
    }
}

/// Runs `notes` through the pipeline into `sink` (about two worker-fulls held, as a raw
/// publisher keeps one window in flight) and returns the bridge side's figures.
/// Notifications held (pending or in flight) at which a broker bench's synthetic informer
/// pauses.
pub const BROKER_BACKLOG: usize = 50_000;

pub async fn bridge_figures<S: Sink + 'static>(
    sink: Arc<Timed<S>>,
    notes: Vec<Notification>,
    workers: usize,
    metrics: &Metrics,
    name: &str,
    checkpointer: Option<Arc<Checkpointer>>,
) -> Figures {
    let events = notes.len();
    // The synthetic informer pauses at BROKER_BACKLOG held notifications: far more than the
    // workers (acknowledgements are awaited off the workers, so a route holds what is in
    // flight), and below the sink's max_pending (100,000), so that nothing is coalesced.
    let run = run_bridge_with(
        sink.clone(),
        notes,
        workers,
        BROKER_BACKLOG,
        metrics,
        name,
        checkpointer,
    )
    .await;
    assert_eq!(
        run.coalesced, 0,
        "the bench measures delivery, not coalescing"
    );
    let (p50, p99) = percentiles(std::mem::take(&mut *sink.samples.lock().unwrap()));
    Figures {
        events,
        bytes: run.delivered_bytes,
        secs: run.elapsed.as_secs_f64(),
        p50,
        p99,
        peak_rss: run.peak_rss,
    }
}
