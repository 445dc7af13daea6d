//! Time to sync: how long the bridge's informer takes to list OBJECTS ConfigMaps of about 1 KB
//! (the memory bench's realistic objects) from the API test server until every initial add has
//! reached a listener, printed beside the time the same server takes to send the same list to
//! a client that only reads the bytes. The target: sync within 1.5× of reading.
//!
//! Sides, each run `BENCH_RUNS` times (at least 3) in rotating order, median and spread printed:
//! - `read paged`: GET the list in pages of PAGE_SIZE (the bridge's largest page by default,
//!   5000; the bridge's own first page is 500, its later ones at most 8 MiB), following
//!   `continue`, reading only the bytes (the token is found by a text search, nothing parsed);
//! - `read whole`: one GET of the whole list;
//! - `read streaming`: a streaming watch-list (`sendInitialEvents`), read until the bookmark
//!   that ends the initial events;
//! - `bridge paged`: the bridge's informer (its API client, page size, transform) with one
//!   listener counting initial adds;
//! - `bridge streaming`: the same with `streaming_list` (a watch with `sendInitialEvents`).
//!
//! The server runs on a runtime of its own (2 threads) beside the client's (2 threads); on a
//! 2-core machine they share the cores, as a bridge shares a node.
//!
//! A bridge side's round also prints when its list was complete (the reflector's `listed`
//! count), the rest being the informer handing the adds on.
//!
//! Last, the decoding alone, on one thread: OBJECTS watch lines (`MODIFIED`, the same
//! objects) turned into cached objects from their bytes (`watch_events::events`, what the
//! informer does) and through a parsed `DynamicObject` (kube's `WatchEvent`, the transform,
//! `CachedObject::new`: what it did before), microseconds per event, median of the rounds.
//!
//! `cargo bench --bench sync [-- OBJECTS [PAGE_SIZE]]` (default 100000, 5000); `BENCH_ONLY=paged`
//! (any part of a bridge side's name) runs only the matching bridge side beside the reads.

mod support;

#[path = "../tests/support/api_server.rs"]
#[allow(dead_code)]
mod api_server;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use api_server::ApiServer;
use http_body_util::BodyExt;
use kube_event_bridge::{
    config::MessageConfig,
    informer::{
        EventType, InformerKey, Notification, NotificationHandler, ProcessorListener,
        SharedInformerFactory, factory::WatchOptions, watch_events,
    },
    message::object_transform,
    metrics::Metrics,
};
use support::{
    median,
    objects::{configmaps, realistic_configmap, typed},
    runs,
};
use tokio_util::sync::CancellationToken;

const SIDES: [&str; 5] = [
    "read paged",
    "read whole",
    "read streaming",
    "bridge paged",
    "bridge streaming",
];

/// Counts initial adds.
#[derive(Default)]
struct Count(AtomicUsize);

impl NotificationHandler for Count {
    fn on_notification(&self, _: Notification) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let objects = args.first().copied().unwrap_or(100_000);
    let page_size = args.get(1).copied().unwrap_or(5000);
    let server_rt = runtime("api-server");
    let client_rt = runtime("client");
    let server = server_rt.block_on(async {
        let server = ApiServer::start().await;
        for i in 0..objects {
            server.create(typed(&realistic_configmap(i)));
        }
        server
    });
    let url = server.url();
    let whole = client_rt.block_on(read(&url, None));
    println!(
        "sync bench: {objects} ConfigMaps, {:.1} MB of list JSON ({} bytes per object), \
         pages of {page_size}, {} rounds",
        whole.0 as f64 / 1e6,
        whole.0 / objects.max(1),
        runs()
    );
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let mut sides: Vec<(&str, Vec<f64>)> = SIDES
        .into_iter()
        .filter(|s| s.contains(&only) || s.starts_with("read"))
        .map(|s| (s, Vec::new()))
        .collect();
    // Of the bridge's sides: when the list was complete (the rest is the informer handing
    // the adds on).
    let mut listed: Vec<(&str, Vec<f64>)> = Vec::new();
    for round in 0..runs() {
        for i in 0..sides.len() {
            let side = (round + i) % sides.len();
            let name = sides[side].0;
            let (list, secs) = client_rt.block_on(async {
                match name {
                    "read paged" => (f64::NAN, read(&url, Some(page_size)).await.1),
                    "read whole" => (f64::NAN, read(&url, None).await.1),
                    "read streaming" => (f64::NAN, read_streaming(&url).await),
                    "bridge paged" => sync(&server, objects, page_size, false).await,
                    _ => sync(&server, objects, page_size, true).await,
                }
            });
            if list.is_nan() {
                println!("  round {round}  {name:<17} {secs:>7.3} s");
            } else {
                println!("  round {round}  {name:<17} {secs:>7.3} s (listed at {list:.3} s)");
                match listed.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, l)) => l.push(list),
                    None => listed.push((name, vec![list])),
                }
            }
            sides[side].1.push(secs);
        }
    }
    for (name, secs) in &sides {
        let m = median(secs.clone());
        let (min, max) = secs
            .iter()
            .fold((f64::MAX, 0f64), |(a, b), s| (a.min(*s), b.max(*s)));
        println!(
            "{name:<17} median {m:>7.3} s  ({:.0} objects/s; spread {min:.3}..{max:.3} s)",
            objects as f64 / m,
        );
    }
    for (name, secs) in &listed {
        println!(
            "{name:<17} listed at median {:>7.3} s (the rest: the informer handing on the adds)",
            median(secs.clone())
        );
    }
    let median = |name| {
        let side = sides.iter().find(|(n, _)| *n == name);
        side.map_or(f64::NAN, |(_, secs)| median(secs.clone()))
    };
    println!(
        "ratio bridge paged / read paged        {:.2} (target ≤ 1.5)",
        median("bridge paged") / median("read paged")
    );
    println!(
        "ratio bridge streaming / read streaming {:.2}",
        median("bridge streaming") / median("read streaming")
    );
    decode_costs(objects);
    drop(server_rt);
}

/// See the module docs.
fn decode_costs(objects: usize) {
    use futures::StreamExt;
    use kube::api::{DynamicObject, WatchEvent};
    let transform = object_transform(&configmaps(), &MessageConfig::default());
    let mut body = String::new();
    for i in 0..objects {
        let line =
            serde_json::json!({"type": "MODIFIED", "object": typed(&realistic_configmap(i))});
        body += &line.to_string();
        body.push('\n');
    }
    let rt = runtime("decode");
    let (mut parsed, mut bytes) = (Vec::new(), Vec::new());
    for _ in 0..runs() {
        let started = Instant::now();
        let mut n = 0;
        for line in body.lines() {
            let Ok(WatchEvent::Modified(mut obj)) =
                serde_json::from_str::<WatchEvent<DynamicObject>>(line)
            else {
                panic!("a MODIFIED event");
            };
            transform.apply(&mut obj);
            n += kube_event_bridge::informer::CachedObject::new(&obj)
                .json()
                .get()
                .len()
                .min(1);
        }
        parsed.push(started.elapsed().as_secs_f64() * 1e6 / n as f64);
        let reader = futures::io::Cursor::new(body.clone().into_bytes());
        let started = Instant::now();
        let n = rt.block_on(async {
            watch_events::events(reader, transform.clone(), None)
                .filter(|e| std::future::ready(matches!(e, Ok(WatchEvent::Modified(_)))))
                .count()
                .await
        });
        assert_eq!(n, objects);
        bytes.push(started.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
    let (parsed, bytes) = (median(parsed), median(bytes));
    println!(
        "decode {objects} watch events ({:.0} B per line): parsed {parsed:.2} µs/event, \
         from bytes {bytes:.2} µs/event ({:.1}x)",
        body.len() as f64 / objects.max(1) as f64,
        parsed / bytes
    );
}

/// A runtime of 2 threads named `name` (to tell them apart in a profile).
fn runtime(name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

/// Reads the list (in pages of `limit`, or whole); returns its bytes and seconds.
async fn read(url: &str, limit: Option<usize>) -> (usize, f64) {
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let started = Instant::now();
    let mut bytes = 0;
    let mut token = String::new();
    loop {
        let mut path = "/api/v1/configmaps".to_owned();
        if let Some(limit) = limit {
            path += &format!("?limit={limit}");
            if !token.is_empty() {
                path += &format!("&continue={token}");
            }
        }
        let request = http::Request::get(path).body(Vec::new()).unwrap();
        let response = client.send(request.map(Into::into)).await.unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        let mut body = response.into_body();
        // The token is in `metadata`, the last member the server writes: keep the tail only.
        let mut tail: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                bytes += data.len();
                tail.extend_from_slice(&data[data.len().saturating_sub(512)..]);
                let cut = tail.len().saturating_sub(512);
                tail.drain(..cut);
            }
        }
        token = continue_token(&tail).unwrap_or_default();
        if limit.is_none() || token.is_empty() {
            return (bytes, started.elapsed().as_secs_f64());
        }
    }
}

/// Reads a streaming watch-list until the bookmark that ends its initial events; returns the
/// seconds.
async fn read_streaming(url: &str) -> f64 {
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let started = Instant::now();
    let path = "/api/v1/configmaps?watch=true&sendInitialEvents=true&allowWatchBookmarks=true\
                &resourceVersionMatch=NotOlderThan&timeoutSeconds=600";
    let request = http::Request::get(path).body(Vec::new()).unwrap();
    let response = client.send(request.map(Into::into)).await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    let mut body = response.into_body();
    let end = b"initial-events-end";
    let mut tail: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            // The bookmark is a line of its own: search the new bytes and a few before them.
            tail.extend_from_slice(&data);
            if tail.windows(end.len()).any(|w| w == end) {
                return started.elapsed().as_secs_f64();
            }
            let cut = tail.len().saturating_sub(end.len());
            tail.drain(..cut);
        }
    }
    panic!("the watch ended before its initial events did");
}

/// `metadata.continue` of a list's last bytes, found by text search.
fn continue_token(tail: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(tail);
    let at = text.rfind("\"continue\":\"")? + "\"continue\":\"".len();
    let end = text[at..].find('"')?;
    Some(text[at..at + end].to_owned())
}

/// Starts the bridge's informer over ConfigMaps; returns the seconds until the list was
/// complete (the reflector's `listed` count reached `objects`) and until every initial add
/// reached the listener.
async fn sync(
    server: &ApiServer,
    objects: usize,
    page_size: usize,
    streaming_list: bool,
) -> (f64, f64) {
    let metrics = Arc::new(Metrics::new());
    let listed = metrics
        .informer_watch_events
        .with_label_values(&["v1/configmaps", "listed"]);
    let client = kube_event_bridge::cluster::client(
        kube::Config::new(server.url().parse().unwrap()),
        &Default::default(),
        &metrics,
    )
    .unwrap();
    let factory = SharedInformerFactory::new(
        client,
        WatchOptions {
            page_size: page_size as u32,
            streaming_list,
            watch_timeout_seconds: 290,
            max_concurrent_lists: 16,
        },
        metrics,
    );
    let resource = configmaps();
    let key = InformerKey {
        group: String::new(),
        version: "v1".into(),
        plural: "configmaps".into(),
        namespace: None,
        label_selector: None,
        field_selector: None,
        shard: None,
    };
    let transform = object_transform(&resource, &MessageConfig::default());
    let started = Instant::now();
    let informer = factory.informer_for(&resource, key, Some(transform));
    let count = Arc::new(Count::default());
    let listener = ProcessorListener::new("count", &[EventType::Added], None, count.clone());
    informer.add_listener(Arc::new(listener));
    let cancel = CancellationToken::new();
    factory.start(&cancel);
    let mut listed_at = None;
    while count.0.load(Ordering::Relaxed) < objects {
        if listed_at.is_none() && listed.get() as usize >= objects {
            listed_at = Some(started.elapsed().as_secs_f64());
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no sync in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    cancel.cancel();
    (listed_at.unwrap_or(secs), secs)
}
