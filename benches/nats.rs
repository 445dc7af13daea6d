//! The whole pipeline into NATS JetStream (file storage, one replica) against raw async-nats
//! JetStream publishes of the same bytes, on a nats-server started here: `BENCH_RUNS` rounds
//! (3 by default) of one run each, alternating which goes first. Prints each run's rate, then
//! median events/s and spread, MB/s, p50/p99 from watch event to PubAck, peak RSS, and the
//! ratio of the medians.
//!
//! `cargo bench --bench nats [-- EVENTS_1KB EVENTS_10KB]` (needs `nats-server`, which
//! `scripts/test` installs). `BENCH_OBJECTS` sets how many objects the events update (10,000).

#[path = "../tests/support/nats.rs"]
#[allow(dead_code)]
mod nats;
mod support;

use std::{sync::Arc, time::Instant};

use futures::{StreamExt, stream::FuturesUnordered};
use kube_event_bridge::{
    config::SinkConfig, message::Message, metrics::Metrics, sinks::nats::NatsSink,
};
use support::{
    Figures, Runs, Timed, bridge_figures, encoder, notifications, own_cpu_seconds, peak_rss_mib,
    percentiles, reset_peak_rss,
};

const WINDOW: usize = 1024;

async fn bridge(url: &str, events: usize, size: usize, metrics: &Metrics, round: usize) -> Figures {
    let cfg: SinkConfig = serde_json::from_value(serde_json::json!({
        "name": "nats", "type": "nats",
        "nats": {"servers": [url], "max_in_flight": WINDOW, "stream": {"name": "BENCH"}},
    }))
    .unwrap();
    // Built before the clock starts, as raw's messages are encoded before it starts.
    let notes: Vec<_> = notifications(events, support::objects(), size).collect();
    let sink = Arc::new(Timed::new(
        NatsSink::connect("nats", cfg.nats.as_ref().unwrap())
            .await
            .unwrap(),
    ));
    bridge_figures(
        sink,
        notes,
        support::workers(),
        (cfg.objects_in_flight(), cfg.bytes_in_flight()),
        metrics,
        &format!("nats-{size}-{round}"),
        None,
    )
    .await
}

async fn raw(url: &str, events: usize, size: usize) -> Figures {
    // The same bytes the bridge publishes, encoded before the clock starts.
    let enc = encoder();
    let messages: Vec<Message> = notifications(events, support::objects(), size)
        .map(|n| enc.encode(n.key(), &n).unwrap())
        .collect();
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::ContextBuilder::new()
        .max_ack_inflight(WINDOW)
        .backpressure_on_inflight(true)
        .build(client);
    let mut acks = FuturesUnordered::new();
    let (mut samples, mut bytes) = (Vec::with_capacity(events), 0);
    reset_peak_rss();
    let cpu0 = own_cpu_seconds();
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
        let rounds = support::runs();
        println!(
            "nats bench: nats-server {url} JetStream, file storage, 1 replica; {WINDOW} publishes awaiting their PubAck on both sides (bridge: nats.max_in_flight; raw: max_ack_inflight with backpressure); bridge: {} workers (BENCH_WORKERS); events over {} objects (BENCH_OBJECTS); 2 runtime threads; {rounds} rounds, each running bridge and raw once, alternating which goes first",
            support::workers(),
            support::objects()
        );
        for (events, size) in [(events_1k, 1_000), (events_10k, 10_000)] {
            let (mut b, mut r) = (Runs::default(), Runs::default());
            let mut lines = Vec::new();
            for round in 0..rounds {
                for side in [round % 2, 1 - round % 2] {
                    let f = if side == 0 {
                        bridge(&url, events, size, &metrics, round).await
                    } else {
                        raw(&url, events, size).await
                    };
                    lines.push(format!("{}:{:.0}", ["bridge", "raw"][side], f.rate()));
                    [&mut b, &mut r][side].0.push(f);
                }
            }
            println!(
                "  {events} events, objects of ~{} KB (messages with oldObject: ~{:.1} KB); peak RSS includes the pre-built inputs; runs in order (events/s): {}",
                size / 1000,
                b.0[0].bytes as f64 / b.0[0].events as f64 / 1000.0,
                lines.join(" ")
            );
            b.print("bridge");
            r.print("raw");
            println!(
                "    ratio bridge/raw: {:.2} (medians)",
                b.median_rate() / r.median_rate()
            );
        }
    });
}
