//! The work queue metrics of client-go (component-base `metrics/prometheus/workqueue`), with
//! the same names, types, buckets and `name` label, so existing dashboards and alerts work.

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

/// Metric families of every queue; one instance per registry.
#[derive(Clone)]
pub struct WorkqueueMetricFamilies {
    depth: IntGaugeVec,
    adds: IntCounterVec,
    queue_duration: HistogramVec,
    work_duration: HistogramVec,
    unfinished_work: GaugeVec,
    longest_running: GaugeVec,
    retries: IntCounterVec,
}

impl WorkqueueMetricFamilies {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        // client-go: ExponentialBuckets(10e-9, 10, 10), 10 ns .. 10 s.
        let buckets = prometheus::exponential_buckets(10e-9, 10.0, 10)?;
        let l = &["name"];
        let f = Self {
            depth: IntGaugeVec::new(
                Opts::new("workqueue_depth", "Current depth of workqueue"),
                l,
            )?,
            adds: IntCounterVec::new(
                Opts::new(
                    "workqueue_adds_total",
                    "Total number of adds handled by workqueue",
                ),
                l,
            )?,
            queue_duration: HistogramVec::new(
                HistogramOpts::new(
                    "workqueue_queue_duration_seconds",
                    "How long in seconds an item stays in workqueue before being requested.",
                )
                .buckets(buckets.clone()),
                l,
            )?,
            work_duration: HistogramVec::new(
                HistogramOpts::new(
                    "workqueue_work_duration_seconds",
                    "How long in seconds processing an item from workqueue takes.",
                )
                .buckets(buckets),
                l,
            )?,
            unfinished_work: GaugeVec::new(
                Opts::new(
                    "workqueue_unfinished_work_seconds",
                    "How many seconds of work has done that is in progress and hasn't been observed by work_duration. \
                     Large values indicate stuck threads.",
                ),
                l,
            )?,
            longest_running: GaugeVec::new(
                Opts::new(
                    "workqueue_longest_running_processor_seconds",
                    "How many seconds has the longest running processor for workqueue been running.",
                ),
                l,
            )?,
            retries: IntCounterVec::new(
                Opts::new(
                    "workqueue_retries_total",
                    "Total number of retries handled by workqueue",
                ),
                l,
            )?,
        };
        registry.register(Box::new(f.depth.clone()))?;
        registry.register(Box::new(f.adds.clone()))?;
        registry.register(Box::new(f.queue_duration.clone()))?;
        registry.register(Box::new(f.work_duration.clone()))?;
        registry.register(Box::new(f.unfinished_work.clone()))?;
        registry.register(Box::new(f.longest_running.clone()))?;
        registry.register(Box::new(f.retries.clone()))?;
        Ok(f)
    }

    /// The metrics of the queue called `name`.
    pub fn for_queue(&self, name: &str) -> QueueMetrics {
        let l = &[name];
        QueueMetrics {
            depth: self.depth.with_label_values(l),
            adds: self.adds.with_label_values(l),
            queue_duration: self.queue_duration.with_label_values(l),
            work_duration: self.work_duration.with_label_values(l),
            unfinished_work: self.unfinished_work.with_label_values(l),
            longest_running: self.longest_running.with_label_values(l),
            retries: self.retries.with_label_values(l),
        }
    }
}

/// The metrics of one queue.
#[derive(Clone)]
pub struct QueueMetrics {
    /// `workqueue_depth`: +1 when an item becomes dirty, −1 on get.
    pub depth: IntGauge,
    /// `workqueue_adds_total`: the same +1 events.
    pub adds: IntCounter,
    /// `workqueue_queue_duration_seconds`: first add to get.
    pub queue_duration: Histogram,
    /// `workqueue_work_duration_seconds`: get to done.
    pub work_duration: Histogram,
    /// `workqueue_unfinished_work_seconds`: total age of items in processing.
    pub unfinished_work: Gauge,
    /// `workqueue_longest_running_processor_seconds`: age of the oldest item in processing.
    pub longest_running: Gauge,
    /// `workqueue_retries_total`: calls to `add_after`/`add_rate_limited`.
    pub retries: IntCounter,
}

impl QueueMetrics {
    /// Metrics registered nowhere, for queues nobody scrapes (tests, benchmarks).
    pub fn unregistered() -> Self {
        WorkqueueMetricFamilies::register(&Registry::new())
            .expect("valid metrics")
            .for_queue("")
    }
}
