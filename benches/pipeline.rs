//! Throughput of the delivery pipeline with a sink that acknowledges at once: synthetic
//! informer → ProcessorListener → RouteQueue → workers → CloudEvents encoder → sink. Prints
//! notifications/s, p50/p99 time from the informer to the sink, and peak RSS, for four
//! configurations: the default, a typical CEL filter, `message.diff: patch`, and both.
//! `BENCH_RUNS` rounds (at least 3, the default) run every configuration once each, in an order
//! rotating from round to round; each configuration's figures are those of its median run, with
//! the spread and every run's rate.
//!
//! `cargo bench --bench pipeline [-- NOTIFICATIONS OBJECTS WORKERS OBJECT_BYTES]`; `BENCH_ONLY=off`
//! (any part of a configuration's label) runs only the matching configuration.

#[path = "../tests/support/fake_sink.rs"]
mod fake_sink;
mod support;

use std::sync::{Arc, atomic::Ordering};

use fake_sink::FakeSink;
use kube_event_bridge::{
    config::{DiffMode, MessageConfig, ResourceConfig},
    message::{Encoder, Encoding},
    metrics::Metrics,
    pipeline::filter::Rules,
};
use support::{Figures, RouteSpec, Timed, alternating, percentiles, run_bridge};

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
    let configs = [
        ("filter and diff off", "ack", false, false),
        ("filter on", "ack-filter", true, false),
        ("diff: patch on", "ack-patch", false, true),
        ("filter and diff: patch on", "ack-both", true, true),
    ];
    // `BENCH_ONLY=off` (a part of the label) runs one configuration, e.g. under a profiler.
    let only = std::env::var("BENCH_ONLY").ok();
    let chosen: Vec<_> = configs
        .iter()
        .filter(|c| only.as_deref().is_none_or(|o| c.0.contains(o)))
        .collect();
    let rounds = support::runs();
    println!(
        "  {rounds} rounds (BENCH_RUNS), each running every configuration once, the order rotating from round to round"
    );
    // Per configuration, each run's figures and what it coalesced.
    let mut runs: Vec<Vec<(Figures, u64)>> = (0..chosen.len()).map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for i in 0..chosen.len() {
            let at = (i + round) % chosen.len();
            let (_, name, filter, patch) = *chosen[at];
            let encoder = if patch {
                patch_encoder()
            } else {
                support::encoder()
            };
            let rules = if filter { rules() } else { None };
            let notes = alternating(total, objects, size);
            // Accepts every message at once, keeping nothing.
            let sink = Arc::new(Timed::new(FakeSink {
                discard: true,
                ..FakeSink::named("ack")
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
            let delivered = sink.inner.attempts.load(Ordering::Relaxed);
            let (p50, p99) = percentiles(std::mem::take(&mut *sink.samples.lock().unwrap()));
            let figures = Figures {
                events: delivered as usize,
                bytes: run.delivered_bytes,
                secs: run.elapsed.as_secs_f64(),
                cpu: run.cpu,
                p50,
                p99,
                peak_rss: run.peak_rss,
            };
            runs[at].push((figures, run.coalesced));
        }
    }
    for (config, runs) in chosen.iter().zip(&runs) {
        let rates: Vec<f64> = runs.iter().map(|(f, _)| f.rate()).collect();
        let (middle, coalesced) = &runs[median_index(&rates)];
        let (lo, hi) = rates
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        let secs = middle.secs;
        println!("  {}", config.0);
        println!(
            "    delivered          {:>10}   (coalesced {coalesced})",
            middle.events
        );
        println!(
            "    throughput         {:>10.0} notifications/s, median of {} (spread {lo:.0}–{hi:.0}, ±{:.0}%; runs in order: {})",
            middle.rate(),
            rates.len(),
            (hi - lo) / 2.0 / middle.rate() * 100.0,
            rates
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        println!(
            "    payload            {:>10.1} MB/s ({:.2} KB per message)",
            middle.bytes as f64 / 1e6 / secs,
            middle.bytes as f64 / middle.events as f64 / 1e3
        );
        println!(
            "    informer → sink    p50 {:.3} ms, p99 {:.3} ms",
            middle.p50, middle.p99
        );
        println!(
            "    peak RSS           {:>10.1} MiB ",
            runs.iter().map(|(f, _)| f.peak_rss).fold(0f64, f64::max)
        );
    }
}

/// The index of the median of `rates` (the lower middle one for an even count), so that the
/// run printed is one that happened.
fn median_index(rates: &[f64]) -> usize {
    let mut order: Vec<usize> = (0..rates.len()).collect();
    order.sort_by(|&a, &b| rates[a].total_cmp(&rates[b]));
    order[(rates.len() - 1) / 2]
}
