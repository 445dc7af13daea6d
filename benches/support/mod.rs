//! What every benchmark shares: a synthetic informer feeding one route (listener → route
//! queue → workers → sink), synthetic ConfigMaps (built with the tests' object builders),
//! latency percentiles and peak RSS.
#![allow(dead_code)] // each bench uses a different part

#[path = "../../tests/support/objects.rs"]
pub mod objects;
#[path = "../../tests/support/procfs.rs"]
pub mod procfs;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{FutureExt, future::BoxFuture};
use kube_event_bridge::{
    config::MessageConfig,
    informer::{EventType, Notification, NotificationKind, ObjectRef, ProcessorListener},
    message::{Encoder, Encoding, Message},
    metrics::Metrics,
    pipeline::{
        self, Delivery, RouteBuilder,
        filter::Rules,
        route::{DEFAULT_MAX_BYTES_IN_FLIGHT, DEFAULT_MAX_OBJECTS_IN_FLIGHT},
    },
    sinks::{self, CheckpointStore, Sink},
};

use objects::{Meta, cached, configmap_with_data, configmaps};

/// The service's allocator (`kube_event_bridge::allocator`), so that a bench running the
/// pipeline in its own process measures what runs (until 2026-12 these benches ran on glibc's
/// malloc while the service ran on mimalloc). [`reset_peak_rss`] sets the service's purge
/// delay.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    let payload = "x".repeat(size.saturating_sub(250));
    cached(
        configmap_with_data(
            &format!("team-{}", i % 50),
            &format!("config-{i:06}"),
            [("payload", payload)],
        )
        .uid(format!("8d0c1f7e-0000-4000-8000-{i:012}"))
        .resource_version(rv)
        .label("app", "bench"),
    )
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
    (0..events).map(move |n| {
        Notification::new(NotificationKind::Update {
            old: old[n % objects].clone(),
            new: object(n % objects, (size as u64) * 10_000_000 + n as u64, size),
        })
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
        Notification::new(NotificationKind::Update {
            old: versions[i][flip].clone(),
            new: versions[i][1 - flip].clone(),
        })
    })
}

/// Wraps a sink to sample the time from watch event (notification receipt) to acknowledgement.
pub struct Timed<S> {
    pub inner: S,
    pub samples: Arc<Mutex<Vec<u32>>>,
}

impl<S> Timed<S> {
    /// Wraps `inner`, with no samples yet.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            samples: Arc::new(Mutex::new(Vec::new())),
        }
    }
}

impl<S> Timed<S> {
    /// `ack`, recording the time from `m`'s receipt to its acknowledgement.
    fn timed(&self, ack: sinks::Ack, m: &Message) -> sinks::Ack {
        let (samples, received) = (self.samples.clone(), m.received);
        Box::pin(async move {
            ack.await?;
            samples
                .lock()
                .unwrap()
                .push(received.elapsed().as_micros() as u32);
            Ok(())
        })
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
        async move { Ok(self.timed(self.inner.submit(m).await?, m)) }.boxed()
    }
    fn in_transactions(&self) -> bool {
        self.inner.in_transactions()
    }
    fn submit_settling<'a>(
        &'a self,
        m: &'a Message,
        route: &'a str,
        change: Option<sinks::checkpoint::Change>,
    ) -> BoxFuture<'a, sinks::Result<sinks::Ack>> {
        async move {
            let ack = self.inner.submit_settling(m, route, change).await?;
            Ok(self.timed(ack, m))
        }
        .boxed()
    }
    fn settle_silently(&self, route: &str, change: sinks::checkpoint::Change) {
        self.inner.settle_silently(route, change)
    }
    fn begin_term(
        &self,
        shard: kube_event_bridge::shard::Shard,
        fence: Option<kube_event_bridge::leader::Fence>,
    ) -> BoxFuture<'_, sinks::Result<()>> {
        self.inner.begin_term(shard, fence)
    }
    fn end_term(&self, shard: kube_event_bridge::shard::Shard) {
        self.inner.end_term(shard)
    }
    fn end_terms(&self) {
        self.inner.end_terms()
    }
    fn commit_term(
        &self,
        shard: kube_event_bridge::shard::Shard,
    ) -> BoxFuture<'_, sinks::Result<()>> {
        self.inner.commit_term(shard)
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

/// This process's CPU seconds (every thread's; not its children's, such as a broker it
/// started).
pub fn own_cpu_seconds() -> f64 {
    procfs::cpu_seconds(std::process::id())
}

/// Resets the peak RSS to the current RSS, so that each phase reports its own peak.
pub fn reset_peak_rss() {
    // As the service sets it at start (setting it again changes nothing).
    kube_event_bridge::allocator::configure();
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// What one bridge run measured.
pub struct Run {
    pub elapsed: Duration,
    /// This process's CPU seconds over `elapsed`.
    pub cpu: f64,
    pub delivered_bytes: u64,
    pub coalesced: u64,
    pub peak_rss: f64,
}

/// How a bench wires its one route: through the service's own [`RouteBuilder`], so that
/// what is measured is what runs.
pub struct RouteSpec<'a> {
    /// Where the route's metrics go.
    pub metrics: &'a Metrics,
    /// The route's sink label; the route is `configmap/{name}`.
    pub name: &'a str,
    /// Delivery workers.
    pub workers: usize,
    /// Held notifications at which the synthetic informer pauses (so that nothing is
    /// coalesced).
    pub backlog: usize,
    /// The encoder ([`encoder`] by default).
    pub encoder: Encoder,
    /// A filter stage in front of the queue, as for a resource with a `filter`.
    pub rules: Option<Arc<Rules>>,
    /// Records acknowledgements into this store, written every second in the background as
    /// the service does with resume on (the final write is part of the measured time).
    pub store: Option<Arc<dyn CheckpointStore>>,
    /// The sink's room in flight: objects and bytes (`sinks[].max_objects_in_flight`,
    /// `sinks[].max_bytes_in_flight`).
    pub in_flight: (usize, usize),
}

/// `default` room in flight (objects, bytes), unless BENCH_IN_FLIGHT (objects) or
/// BENCH_IN_FLIGHT_BYTES say otherwise.
pub fn bench_in_flight((objects, bytes): (usize, usize)) -> (usize, usize) {
    let var = |name: &str, default| {
        std::env::var(name)
            .ok()
            .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} is a number")))
            .unwrap_or(default)
    };
    (
        var("BENCH_IN_FLIGHT", objects),
        var("BENCH_IN_FLIGHT_BYTES", bytes),
    )
}

impl<'a> RouteSpec<'a> {
    /// A route `configmap/{name}` with `workers` workers, pausing at `backlog`, the default
    /// encoder, no filter and no checkpoint.
    pub fn new(metrics: &'a Metrics, name: &'a str, workers: usize, backlog: usize) -> Self {
        Self {
            metrics,
            name,
            workers,
            backlog,
            encoder: encoder(),
            rules: None,
            store: None,
            in_flight: bench_in_flight((
                DEFAULT_MAX_OBJECTS_IN_FLIGHT,
                DEFAULT_MAX_BYTES_IN_FLIGHT,
            )),
        }
    }
}

/// Pushes `notes` through listener → [filter →] route queue → workers → `sink`, like an
/// informer (stamping each on receipt), pausing while more than `spec.backlog` are held, and
/// waits until all are delivered.
pub async fn run_bridge(
    sink: Arc<dyn Sink>,
    notes: impl IntoIterator<Item = Notification>,
    spec: RouteSpec<'_>,
) -> Run {
    let RouteSpec {
        metrics,
        name,
        workers,
        backlog,
        encoder,
        rules,
        store,
        in_flight,
    } = spec;
    let sink_name = sink.name().to_owned();
    let delivery = Arc::new(Delivery {
        sink,
        dead_letter: None,
        publish_limit: None,
        max_retries: None,
        in_flight: Delivery::in_flight(in_flight.0, in_flight.1),
    });
    let built = RouteBuilder::new("configmap", name, encoder, delivery, metrics)
        .filter(rules)
        .checkpoint(store)
        .build();
    let budget = built.route.queue().budget().clone();
    let checkpointer = built.checkpointer.clone();
    let cancel = tokio_util::sync::CancellationToken::new();
    let writer = checkpointer
        .clone()
        .map(|c| tokio::spawn(c.run(Duration::from_secs(1), cancel.clone())));
    let listener = ProcessorListener::new(name, &EventType::ALL, None, built.handler.clone());
    let handler = built.handler;
    let bytes = || {
        metrics
            .sink_bytes
            .with_label_values(&[&sink_name, "configmap"])
            .get()
    };
    let bytes_before = bytes();
    let coalesced = || {
        metrics
            .listener_coalesced
            .with_label_values(&["configmap", name])
            .get()
    };
    let coalesced_before = coalesced();
    reset_peak_rss();
    let running = pipeline::start(&[(built.route, workers)]);
    let cpu0 = own_cpu_seconds();
    let start = Instant::now();
    for mut n in notes {
        while budget.held() > backlog {
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
        n.received = std::time::Instant::now();
        listener.add(n);
    }
    // A filter's lanes hand on what they hold (not counted in the budget) first.
    handler.flush();
    while budget.held() > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    cancel.cancel();
    if let (Some(w), Some(c)) = (writer, &checkpointer) {
        let _ = w.await;
        c.flush().await.expect("final checkpoint write");
    }
    let elapsed = start.elapsed();
    let cpu = own_cpu_seconds() - cpu0;
    running
        .drain(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
    Run {
        elapsed,
        cpu,
        delivered_bytes: bytes() - bytes_before,
        coalesced: coalesced() - coalesced_before,
        peak_rss: peak_rss_mib(),
    }
}

/// What one side (bridge or raw) of a broker bench measured.
pub struct Figures {
    pub events: usize,
    pub bytes: u64,
    pub secs: f64,
    /// This process's CPU seconds over `secs` (not a broker's it started).
    pub cpu: f64,
    pub p50: f64,
    pub p99: f64,
    pub peak_rss: f64,
}

impl Figures {
    /// Events per second.
    pub fn rate(&self) -> f64 {
        self.events as f64 / self.secs
    }

    /// This process's CPU microseconds per event.
    pub fn cpu_us(&self) -> f64 {
        self.cpu * 1e6 / self.events.max(1) as f64
    }

    /// One line: events/s, MB/s, CPU per event, latency percentiles, peak RSS.
    pub fn print(&self, label: &str) {
        println!(
            "    {label:<7} {:>9.0} events/s {:>8.1} MB/s {:>6.1} µs CPU/event   p50 {:>7.2} ms  p99 {:>7.2} ms   peak RSS {:.0} MiB",
            self.rate(),
            self.bytes as f64 / 1e6 / self.secs,
            self.cpu_us(),
            self.p50,
            self.p99,
            self.peak_rss
        );
    }
}

/// Notifications held (pending or in flight) at which a broker bench's synthetic informer
/// pauses.
pub const BROKER_BACKLOG: usize = 50_000;

/// Runs `notes` through the pipeline into `sink` (`in_flight`: its config's
/// `objects_in_flight()` and `bytes_in_flight()`, unless BENCH_IN_FLIGHT or
/// BENCH_IN_FLIGHT_BYTES say otherwise) and returns the bridge side's figures.
pub async fn bridge_figures<S: Sink + 'static>(
    sink: Arc<Timed<S>>,
    notes: Vec<Notification>,
    workers: usize,
    in_flight: (usize, usize),
    metrics: &Metrics,
    name: &str,
    store: Option<Arc<dyn CheckpointStore>>,
) -> Figures {
    let events = notes.len();
    // The synthetic informer pauses at BROKER_BACKLOG held notifications: far more than the
    // workers (acknowledgements are awaited off the workers, so a route holds what is in
    // flight), and below the sink's max_pending (100,000), so that nothing is coalesced.
    let run = run_bridge(
        sink.clone(),
        notes,
        RouteSpec {
            store,
            in_flight: bench_in_flight(in_flight),
            ..RouteSpec::new(metrics, name, workers, BROKER_BACKLOG)
        },
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
        cpu: run.cpu,
        p50,
        p99,
        peak_rss: run.peak_rss,
    }
}

/// The runs of one side of a broker bench: printed one line each (a stall shows as one slow
/// run), then summarized by the median rate and the spread (slowest and fastest).
#[derive(Default)]
pub struct Runs(pub Vec<Figures>);

impl Runs {
    /// The median of the runs' rates (the mean of the middle two for an even count).
    pub fn median_rate(&self) -> f64 {
        median(self.0.iter().map(Figures::rate).collect())
    }

    /// The median of the runs' CPU microseconds per event.
    pub fn median_cpu_us(&self) -> f64 {
        median(self.0.iter().map(Figures::cpu_us).collect())
    }

    /// One line: median events/s, the spread, median MB/s, median CPU per event, p50 and p99,
    /// the highest peak RSS.
    pub fn print(&self, label: &str) {
        let rates: Vec<f64> = self.0.iter().map(Figures::rate).collect();
        let (lo, hi) = rates
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        println!(
            "    {label:<7} {:>9.0} events/s median of {} (spread {:.0}–{:.0}, ±{:.0}%) {:>7.1} MB/s {:>6.1} µs CPU/event   p50 {:>7.2} ms  p99 {:>7.2} ms   peak RSS {:.0} MiB",
            self.median_rate(),
            rates.len(),
            lo,
            hi,
            (hi - lo) / 2.0 / self.median_rate() * 100.0,
            median(
                self.0
                    .iter()
                    .map(|f| f.bytes as f64 / 1e6 / f.secs)
                    .collect()
            ),
            self.median_cpu_us(),
            median(self.0.iter().map(|f| f.p50).collect()),
            median(self.0.iter().map(|f| f.p99).collect()),
            self.0.iter().map(|f| f.peak_rss).fold(0.0, f64::max),
        );
    }
}

/// The median of `v` (0 when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Delivery workers of a broker bench's route: `BENCH_WORKERS`, else the sink's default
/// (`workers: 8`), as a deployment runs it. Acknowledgements are awaited off the workers, so
/// what is in flight is bounded by the sink's own window (`nats.max_in_flight`, librdkafka's
/// queue), not by the workers.
pub fn workers() -> usize {
    positive_from_env("BENCH_WORKERS", 8)
}

/// The positive number in the environment variable `name`, else `default`.
fn positive_from_env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|w| w.parse().ok())
        .filter(|&w| w > 0)
        .unwrap_or(default)
}

/// How many distinct objects a broker bench's events update: `BENCH_OBJECTS` (default
/// 10,000). The bridge has one message of an object in flight at a time (the delivery
/// contract), the raw producer has no such rule: with few objects per event the bridge waits
/// for acknowledgements the raw side does not.
pub fn objects() -> usize {
    positive_from_env("BENCH_OBJECTS", 10_000)
}

/// How many runs of each side a broker bench makes: `BENCH_RUNS` (at least 3, the default).
pub fn runs() -> usize {
    positive_from_env("BENCH_RUNS", 3).max(3)
}
