//! Throughput of the delivery pipeline with a sink that acknowledges at once: synthetic
//! informer → ProcessorListener → RouteQueue → workers → CloudEvents encoder → sink. Prints
//! notifications/s, p50/p99 time from the informer to the sink, and peak RSS; once with the
//! default config and once with a typical CEL filter and `message.diff: patch`.
//!
//! `cargo bench --bench pipeline [-- NOTIFICATIONS OBJECTS WORKERS OBJECT_BYTES]`; `BENCH_ONLY=off`
//! (any part of a configuration's label) runs only the matching configuration.

mod support;

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use futures::{FutureExt, future::BoxFuture};
use kube_event_bridge::{
    config::{DiffMode, MessageConfig, ResourceConfig},
    message::{Encoder, Encoding, Message},
    metrics::Metrics,
    pipeline::filter::Rules,
    sinks::{self, Sink},
};
use support::{RouteSpec, Timed, alternating, percentiles, run_bridge};

/// Accepts every message at once.
struct AckSink {
    count: AtomicU64,
}

impl Sink for AckSink {
    fn name(&self) -> &str {
        "ack"
    }
    fn publish<'a>(&'a self, _: &'a Message) -> BoxFuture<'a, sinks::Result<()>> {
        self.count.fetch_add(1, Ordering::Relaxed);
        async { Ok(()) }.boxed()
    }
    fn flush(&self) -> BoxFuture<'_, sinks::Result<()>> {
        async { Ok(()) }.boxed()
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let total = args.first().copied().unwrap_or(1_000_000);
    let objects = args.get(1).copied().unwrap_or(10_000);
    let workers = args.get(2).copied().unwrap_or(8);
    // The producer pauses while more than this many notifications are held, so the figures
    // measure sustained delivery with nothing coalesced (a real informer does not pause, and
    // beyond the sink's max_pending it would coalesce).
    let backlog = 20_000;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let size = args.get(3).copied().unwrap_or(600);
    println!(
        "pipeline bench: {total} notifications, {objects} objects, {workers} workers, backlog {backlog}, 2 runtime threads"
    );
    // Off: the default config. On: a typical label filter (every notification passes it, so
    // both runs deliver the same) and JSON Patch diffs.
    let filtered: ResourceConfig = serde_json::from_value(serde_json::json!({
        "api_version": "v1", "kind": "ConfigMap",
        "filter": "object.metadata.labels[\"app\"] == \"bench\"",
        "publish_if": "type != \"synced\"",
    }))
    .unwrap();
    let patching = MessageConfig {
        diff: DiffMode::Patch,
        ..Default::default()
    };
    let metrics = Metrics::new();
    let patch_encoder = || {
        Encoder::new(
            "bench",
            &support::objects::configmaps(),
            &patching,
            Encoding::Structured,
        )
    };
    let rules = || {
        Rules::new(&filtered.filter_settings())
            .unwrap()
            .map(Arc::new)
    };
    for (label, name, encoder, rules) in [
        ("filter and diff off", "ack", support::encoder(), None),
        ("filter on", "ack-filter", support::encoder(), rules()),
        ("diff: patch on", "ack-patch", patch_encoder(), None),
        (
            "filter and diff: patch on",
            "ack-both",
            patch_encoder(),
            rules(),
        ),
    ] {
        // `BENCH_ONLY=off` (a part of the label) runs one configuration, e.g. under a profiler.
        if std::env::var("BENCH_ONLY").is_ok_and(|only| !label.contains(only.as_str())) {
            continue;
        }
        let notes = alternating(total, objects, size);
        let sink = Arc::new(Timed::new(AckSink {
            count: AtomicU64::new(0),
        }));
        let run = runtime.block_on(run_bridge(
            sink.clone(),
            notes,
            RouteSpec {
                encoder,
                rules,
                ..RouteSpec::new(&metrics, name, workers, backlog)
            },
        ));
        let delivered = sink.inner.count.load(Ordering::Relaxed);
        let (p50, p99) = percentiles(std::mem::take(&mut *sink.samples.lock().unwrap()));
        let secs = run.elapsed.as_secs_f64();
        println!("  {label}");
        println!(
            "    delivered          {delivered:>10}   (coalesced {})",
            run.coalesced
        );
        println!(
            "    throughput         {:>10.0} notifications/s",
            delivered as f64 / secs
        );
        println!(
            "    payload            {:>10.1} MB/s ({:.2} KB per message)",
            run.delivered_bytes as f64 / 1e6 / secs,
            run.delivered_bytes as f64 / delivered as f64 / 1e3
        );
        println!("    informer → sink    p50 {p50:.3} ms, p99 {p99:.3} ms");
        println!("    peak RSS           {:>10.1} MiB ", run.peak_rss);
    }
}
