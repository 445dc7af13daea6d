//! Shared test support: the Kubernetes API test server, object and config builders, waits,
//! and helpers to read what listeners, sinks and the admin server say.
#![allow(dead_code)] // each test binary uses a different part

pub mod api_server;
pub mod broker;
pub mod cluster;
pub mod config;
pub mod deployed;
pub mod fold;
pub mod kafka;
pub mod loopback;
pub mod model;
pub mod nats;
pub mod objects;
pub mod parity;
pub mod procfs;
pub mod replica;
pub mod schema;
pub mod sink_scenarios;
pub mod tools;
pub mod wait;

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
};

use kube_event_bridge::informer::{Notification, NotificationHandler, NotificationKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use api_server::ApiServer;
#[allow(unused_imports)] // each test binary uses a different part
pub use fold::{
    Differences, assert_both_match_cluster, assert_matches_cluster, compare, compare_both,
    compare_kinds, deduplicated, differences, fold_in_order, until_both_match, until_matches,
};
use objects::{configmap, typed};
use wait::PATIENCE;

/// What `scripts/test` builds outside cargo (`realk8s/realk8s`, `helm/helm`,
/// `peers/otelcol-peers`), under the target directory; panics naming the script to run.
pub fn built_tool(relative: &str, script: &str) -> std::path::PathBuf {
    let target = option_env!("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    let bin = target.join(relative);
    assert!(bin.exists(), "{} is missing: run {script}", bin.display());
    bin
}

/// The peak RSS (VmHWM) of process `pid`, in MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmHWM:")
}

/// A `kB` field of `/proc/PID/status` (`"VmRSS:"`), in MiB; 0 when gone.
pub fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// A short description of a notification: `add ns/a v=1 initial`, `update ns/a v=1->2`,
/// `sync ns/a v=2`, `delete ns/a v=2 final-state-unknown`.
pub fn describe(n: &Notification) -> String {
    let v = |o: &kube_event_bridge::informer::CachedObject| {
        o.to_dynamic().unwrap().data["data"]["v"]
            .as_str()
            .unwrap_or("-")
            .to_owned()
    };
    match n.kind() {
        NotificationKind::Add {
            obj,
            is_initial_list,
        } => {
            format!(
                "add {} v={}{}",
                n.key(),
                v(obj),
                if *is_initial_list { " initial" } else { "" }
            )
        }
        NotificationKind::Update { old, new }
            if old.resource_version() == new.resource_version() =>
        {
            format!("sync {} v={}", n.key(), v(new))
        }
        NotificationKind::Update { old, new } => {
            format!("update {} v={}->{}", n.key(), v(old), v(new))
        }
        NotificationKind::Delete {
            obj,
            final_state_unknown,
        } => {
            format!(
                "delete {} v={}{}",
                n.key(),
                v(obj),
                if *final_state_unknown {
                    " final-state-unknown"
                } else {
                    ""
                }
            )
        }
    }
}

/// A listener's handler that keeps every notification for the test to read.
#[derive(Default)]
pub struct Collector {
    items: Mutex<VecDeque<Notification>>,
    notify: tokio::sync::Notify,
    /// How many times `on_synced` came, and how many notifications had come before the last.
    synced: Mutex<(usize, usize)>,
    received: std::sync::atomic::AtomicUsize,
}

impl NotificationHandler for Collector {
    fn on_notification(&self, n: Notification) {
        self.received
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.items.lock().unwrap().push_back(n);
        self.notify.notify_one();
    }

    fn on_synced(&self, _namespace: Option<&str>, _listed_at: Option<&str>) {
        let received = self.received.load(std::sync::atomic::Ordering::SeqCst);
        let mut synced = self.synced.lock().unwrap();
        *synced = (synced.0 + 1, received);
    }
}

impl Collector {
    /// An empty collector, shared with the listener that feeds it.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The oldest notification not yet taken, if any.
    pub fn try_pop(&self) -> Option<Notification> {
        self.items.lock().unwrap().pop_front()
    }

    /// How many times the listener said its initial state was through, and how many
    /// notifications had come before the last time.
    pub fn synced(&self) -> (usize, usize) {
        *self.synced.lock().unwrap()
    }

    /// Whether every notification has been taken.
    pub fn is_empty(&self) -> bool {
        self.items.lock().unwrap().is_empty()
    }

    /// The oldest notification not yet taken, waiting for one if none is there.
    pub async fn pop(&self) -> Notification {
        loop {
            if let Some(n) = self.try_pop() {
                return n;
            }
            self.notify.notified().await;
        }
    }
}

/// The next notification of `l`, or a panic after [`PATIENCE`].
pub async fn next(l: &Arc<Collector>) -> Notification {
    tokio::time::timeout(PATIENCE, l.pop())
        .await
        .expect("no notification in time")
}

/// The next `n` notifications, described.
pub async fn take(l: &Arc<Collector>, n: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(describe(&next(l).await));
    }
    out
}

/// The sum of every series of metric `name` at `admin`'s `/metrics`.
pub async fn metric_sum(admin: std::net::SocketAddr, name: &str) -> f64 {
    let (_, body) = http_get(admin, "/metrics").await;
    metric_in(&body, name)
}

/// The sum of metric `name` over all its labels in `text`, a /metrics page.
pub fn metric_in(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A plain HTTP/1.0 GET; returns (status code, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let code = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// The whole service, built from a config and running until `stop`.
pub struct RunningApp {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<kube_event_bridge::app::Report>,
    pub metrics: Arc<kube_event_bridge::metrics::Metrics>,
    pub factory: Arc<kube_event_bridge::informer::SharedInformerFactory>,
    pub admin: std::net::SocketAddr,
}

impl RunningApp {
    /// How many objects the resume of `route` (`configmap/out`) found unchanged since its
    /// checkpoint (`keb_resume_objects`).
    pub fn unchanged_on_resume(&self, route: &str) -> u64 {
        let outcome = [route, "unchanged"];
        self.metrics
            .resume_objects
            .with_label_values(&outcome)
            .get()
    }

    /// How many of `sink`'s ConfigMap publishes failed as a broker outage fails them
    /// (`keb_sink_failed` with reason `timeout` or `unavailable`).
    pub fn outage_failures(&self, sink: &str) -> u64 {
        ["timeout", "unavailable"]
            .iter()
            .map(|r| {
                let labels = [sink, "configmap", r];
                self.metrics.sink_failed.with_label_values(&labels).get()
            })
            .sum()
    }

    /// Builds the service against `api` and runs it.
    pub async fn start(config: kube_event_bridge::config::Config, api: &ApiServer) -> Self {
        // The service's own client for its `kubernetes` settings (rate limit, retries, stall
        // timeout), as `run` builds it.
        let metrics: Arc<kube_event_bridge::metrics::Metrics> = Default::default();
        let client = kube_event_bridge::cluster::client(
            kube::Config::new(api.url().parse().unwrap()),
            &config.kubernetes,
            &metrics,
        )
        .unwrap();
        Self::start_with(config, client, metrics).await
    }

    /// Builds the service with `client` (made with `metrics`) and runs it.
    pub async fn start_with(
        config: kube_event_bridge::config::Config,
        client: kube::Client,
        metrics: Arc<kube_event_bridge::metrics::Metrics>,
    ) -> Self {
        let app = kube_event_bridge::app::App::build_with_metrics(config, client, metrics)
            .await
            .unwrap();
        let (metrics, factory, admin) = (
            app.metrics().clone(),
            app.factory().clone(),
            app.admin_addr(),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(app.run(async move {
            let _ = stopped.await;
        }));
        Self {
            stop: Some(stop),
            task,
            metrics,
            factory,
            admin,
        }
    }

    /// Waits until every informer has synced.
    pub async fn synced(&self) {
        wait::until("informers synced", PATIENCE, async || {
            self.factory.has_synced()
        })
        .await;
    }

    /// Shuts down as on SIGTERM; returns the shutdown report.
    pub async fn stop(mut self) -> kube_event_bridge::app::Report {
        self.stop.take().unwrap().send(()).unwrap();
        self.task.await.unwrap()
    }
}

/// Changes ConfigMaps `ns/cm-NN` as a restart test makes them while the bridge is down:
/// deletes `deleted`, updates `updated` (to `v=2`), creates `created`, and deletes and
/// recreates `recreated` (new uid). Returns, per object key, the event types a resume must
/// publish, in order.
pub fn change_while_down(
    api: &ApiServer,
    deleted: std::ops::Range<usize>,
    updated: std::ops::Range<usize>,
    created: std::ops::Range<usize>,
    recreated: std::ops::Range<usize>,
) -> std::collections::HashMap<String, Vec<&'static str>> {
    let name = |i: usize| format!("cm-{i:02}");
    let mut want = std::collections::HashMap::new();
    for i in deleted {
        api.delete("v1", "ConfigMap", "ns", &name(i));
        want.insert(format!("ns/{}", name(i)), vec!["deleted"]);
    }
    for i in updated {
        api.update(typed(&configmap("ns", &name(i), "2")));
        want.insert(format!("ns/{}", name(i)), vec!["updated"]);
    }
    for i in created {
        api.create(typed(&configmap("ns", &name(i), "1")));
        want.insert(format!("ns/{}", name(i)), vec!["added"]);
    }
    for i in recreated {
        api.delete("v1", "ConfigMap", "ns", &name(i));
        api.create(typed(&configmap("ns", &name(i), "3")));
        want.insert(format!("ns/{}", name(i)), vec!["deleted", "added"]);
    }
    want
}

/// Per object key, the event types (`added`, `updated`, `deleted`, `synced`) of the
/// structured CloudEvents marked `k8sresumed`, in order.
pub fn resumed_types<'a>(
    events: impl IntoIterator<Item = &'a serde_json::Value>,
) -> std::collections::HashMap<String, Vec<&'static str>> {
    let mut got: std::collections::HashMap<String, Vec<&'static str>> = Default::default();
    for e in events {
        if e["k8sresumed"] != true {
            continue;
        }
        let ty = event_type(e);
        let ty = ["added", "updated", "deleted", "synced"]
            .into_iter()
            .find(|t| *t == ty)
            .expect("a known event type");
        got.entry(e["subject"].as_str().unwrap().to_owned())
            .or_default()
            .push(ty);
    }
    got
}

/// The JSON lines a file sink has written so far: complete lines only (the sink may be in the
/// middle of the last one while a test reads).
pub fn json_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// Waits until the file sink at `path` has written at least `n` complete JSON lines;
/// returns them.
pub async fn wait_for_lines(path: &std::path::Path, n: usize) -> Vec<serde_json::Value> {
    let what = format!("{n} lines in {}", path.display());
    wait::until(what, PATIENCE, async || json_lines(path).len() >= n).await;
    json_lines(path)
}

/// [`json_lines`] of a sink that writes CloudEvents: each must match the published schema.
pub fn cloudevent_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    let lines = json_lines(path);
    lines.iter().for_each(schema::check_cloudevent);
    lines
}

/// Per object (`Kind namespace/name`), the event types (`added`, `updated`, …) a file sink
/// at `path` delivered, in order; each message must match the published schema.
pub fn delivered(path: &std::path::Path) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut by_object: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for e in cloudevent_lines(path) {
        let key = format!(
            "{} {}",
            e["k8skind"].as_str().unwrap(),
            e["subject"].as_str().unwrap()
        );
        by_object
            .entry(key)
            .or_default()
            .push(event_type(&e).to_owned());
    }
    by_object
}

/// The short type of a CloudEvent: `added`, `updated`, `deleted` or `synced`.
pub fn event_type(event: &serde_json::Value) -> &str {
    event["type"].as_str().unwrap().rsplit('.').next().unwrap()
}

/// The `id`s of CloudEvents, sorted (a repeated id shows twice).
pub fn sorted_ids(events: &[serde_json::Value]) -> Vec<String> {
    let mut ids: Vec<String> = events
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

/// `keb_message_degraded_total` of `sink`'s ConfigMap route by step: `old_object`, `patch`,
/// `reference`, `dead_letter`.
pub fn degraded(metrics: &kube_event_bridge::metrics::Metrics, sink: &str) -> [u64; 4] {
    ["old_object", "patch", "reference", "dead_letter"].map(|step| {
        metrics
            .message_degraded
            .with_label_values(&[sink, "configmap", step])
            .get()
    })
}

/// Makes a file sink's checkpoint file unreadable until the test renames the file returned
/// over it again: the checkpoint moved aside (`saved.checkpoint` beside it) and a link to a
/// directory in its place, so that the rename brings the checkpoint back in one step (a
/// checkpoint briefly absent reads as "nothing published yet").
pub fn block_checkpoint(checkpoint: &std::path::Path) -> std::path::PathBuf {
    let dir = checkpoint.parent().unwrap();
    let saved = dir.join("saved.checkpoint");
    std::fs::rename(checkpoint, &saved).unwrap();
    let blocker = dir.join("blocker");
    std::fs::create_dir(&blocker).unwrap();
    std::os::unix::fs::symlink(&blocker, checkpoint).unwrap();
    saved
}

/// How many of something a test runs with: the environment variable `var`'s number (to run
/// it at scale), else `default` (the CI run).
pub fn scaled(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Creates ConfigMap `ns/cm-{i}` (`v: 1`) and updates it (`v: 2`) for each `i` below `n`, in
/// a task of its own, pausing 20 ms after every `every`-th: a load of `2 n` notifications.
pub fn spawn_creates_and_updates(
    api: &Arc<ApiServer>,
    n: usize,
    every: usize,
) -> tokio::task::JoinHandle<()> {
    let api = api.clone();
    tokio::spawn(async move {
        for i in 0..n {
            api.create(typed(&configmap("ns", &format!("cm-{i}"), "1")));
            api.update(typed(&configmap("ns", &format!("cm-{i}"), "2")));
            if i % every == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    })
}

/// Changes ConfigMaps on `api` at about `per_second` until `stop`, the one of change `c`
/// being `name_of(c * 7919 % objects)`: updates mostly, a delete every seventh change (where
/// the object is there), a create where it is gone. Returns how many changes it made.
pub async fn churn(
    api: Arc<ApiServer>,
    objects: usize,
    name_of: impl Fn(usize) -> (String, String),
    per_second: u64,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> u64 {
    let mut changes = 0u64;
    let pause = std::time::Duration::from_micros(1_000_000 / per_second);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let (ns, name) = name_of((changes * 7919 % objects as u64) as usize);
        let value = format!("v{changes}");
        match api.get("v1", "ConfigMap", &ns, &name) {
            None => api.create(typed(&configmap(&ns, &name, &value))),
            Some(_) if changes.is_multiple_of(7) => api.delete("v1", "ConfigMap", &ns, &name),
            Some(_) => api.update(typed(&configmap(&ns, &name, &value))),
        };
        changes += 1;
        tokio::time::sleep(pause).await;
    }
    changes
}

/// A message about ConfigMap `ns/{name}` of cluster `cluster`, with `payload` as it is (for
/// tests that hand messages to a sink themselves).
pub fn message(cluster: &str, name: &str, payload: &str) -> kube_event_bridge::message::Message {
    use kube_event_bridge::{informer::EventType, message};
    message::Message {
        id: format!("{cluster}-{name}:added"),
        key: format!("ns/{name}"),
        event_type: EventType::Added,
        payload: payload.to_owned().into(),
        attributes: Vec::new(),
        content_type: message::STRUCTURED_CONTENT_TYPE,
        resource: Arc::new(message::ResourceInfo {
            cluster: cluster.into(),
            group: String::new(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
            plural: "configmaps".into(),
        }),
        namespace: Some("ns".into()),
        name: name.into(),
        received: std::time::Instant::now(),
    }
}
