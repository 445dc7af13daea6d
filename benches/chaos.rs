//! Reliability under faults, with figures: the real service (the release binary, as a pod runs
//! it) exports ConfigMaps from the API test server to a real nats-server (JetStream) while a
//! steady workload changes them and a fault is injected; at the end every object's last state
//! (or its delete) is looked up in the stream.
//!
//! `cargo bench --bench chaos -- SCENARIO|all [MINUTES] [--rate CHANGES_PER_S] [--objects N]
//! [--exactly-once]` (`-- all 1`: every scenario for one minute; `--exactly-once`: the
//! `kafka-` scenarios with `kafka.exactly_once`, every reader `read_committed`). Scenarios: `watch-drop`, `gone-storm`,
//! `throttle`, `broker-down`, `kafka-broker-down`, `slow-sink`, `sigterm`, `sigkill`,
//! `zombie-leader` (two replicas with leader election, a 3 s lease; every 20 s the leader is
//! frozen with SIGSTOP for 8 s, the other takes over, and the frozen one is thawed: it must
//! publish nothing behind the new leader), `kafka-zombie-leader` (the same into Kafka),
//! `shard-churn` (replicas sharing 6 shards with 3 s Leases: 3 replicas, 5 after a sixth of
//! the time, 2 (three SIGTERMed) after two sixths, a rolling update to 4 shards after three,
//! whose new replicas take over the old count's checkpoints (with Kafka it also lowers
//! `kafka.delivery_timeout` to 10 s: the old replicas' messages must still be waited out),
//! one SIGKILLed and replaced after four, a third added after five; beside the ConfigMaps, a
//! tenth as many Gadgets of a CRD: the CRD is deleted right after the three SIGTERMs, while
//! their shards move, and created again, with new Gadgets, right after the SIGKILL),
//! `kafka-shard-churn` (the same into Kafka), `upgrade` (three replicas of the release before the sharding round,
//! `aa48fea`, sharing 6 shards with 3 s Leases, replaced one at a time by this tree's while
//! the workload goes on: its Leases, route names and checkpoints are the old release's; `--from
//! PATH` names another old binary, and without it `scripts/build-release-at` builds aa48fea
//! once), `kafka-upgrade` (the same into Kafka),
//! `filter-churn` (a CEL filter on a label the workload flips, `ignore_fields`, `diff: patch`
//! without `oldObject`, and watch drops: objects leave and re-enter the stream; the final
//! stream must hold exactly the matching objects, those that left with a `k8sfilteredout`
//! delete, and every patch applied to the object last read must give the new one), `model`
//! (the model-based test of `tests/model.rs`, in this process: filters, `publish_if`, an
//! `events` subset, a CRD wildcard, resume, leader handovers, version switches, discovery
//! faults and watch 410s combined, case after case; see `tests/support/model.rs`). Every
//! scenario exports to JetStream except the `kafka-` ones, which export to Apache Kafka (a
//! single KRaft node of the test support, from the jars `scripts/test` fetches; a topic of
//! 12 partitions); `kafka-broker-down` stops the node (SIGTERM) and starts it again on its
//! data.
//!
//! One line per scenario: changes made, messages the broker acknowledged (last process) and
//! holds, `lost` (once the service caught up, the stream folded per object in the order the
//! broker holds it, in both consumer models, "last message wins" and "deduplicate by id, then
//! last wins": stale finals + lost deletes + phantom deletes + missing objects, the larger of
//! the two models; each model's figures are printed above the line), duplicate message ids, the service's peak RSS (VmHWM; for the restart
//! scenarios, the larger of the two processes), the peak of notifications it held (sampled
//! every 250 ms under load) and the p99 of `keb_end_to_end_latency_seconds` (watch event to
//! acknowledgement; the bucket's upper bound, of the last process).

// The test support (the API test server, config builder, brokers, waits, and the model-based
// test's engine).
#[path = "../tests/support/mod.rs"]
mod support;

use support::{api_server, config, kafka, nats, objects, wait};

use std::{
    collections::HashMap,
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use api_server::ApiServer;
use config::ConfigBuilder;
use futures::StreamExt;
use kube_event_bridge::consumer::event::Summary;
use nats::NatsServer;
use objects::{Meta, configmap_with_data, typed};
use serde_json::{Value, json};
use wait::Patience;

const STREAM: &str = "KEB_CHAOS";
const SCENARIOS: [&str; 16] = [
    "watch-drop",
    "gone-storm",
    "throttle",
    "broker-down",
    "kafka-broker-down",
    "slow-sink",
    "sigterm",
    "sigkill",
    "filter-churn",
    "zombie-leader",
    "kafka-zombie-leader",
    "shard-churn",
    "kafka-shard-churn",
    "upgrade",
    "kafka-upgrade",
    "model",
];
/// The release `upgrade` starts from unless `--from` names a binary.
const UPGRADE_FROM: &str = "aa48fea";
/// `shard-churn`'s shard count, and the one its rolling update moves to.
const CHURN_SHARDS: (u32, u32) = (6, 4);
/// `shard-churn`'s CRD: group, version, kind, plural.
const GADGETS: (&str, &str, &str, &str) = ("chaos.example.com", "v1", "Gadget", "gadgets");

/// Namespaces the objects are spread over.
const NAMESPACES: usize = 20;
/// The slow sink's cap on held notifications, and the RSS it must stay under.
const SLOW_MAX_PENDING: usize = 5_000;
const SLOW_RSS_CAP_MIB: f64 = 256.0;

struct Options {
    minutes: Option<f64>,
    rate: u64,
    objects: usize,
    /// `--exactly-once`: the `kafka-` scenarios' sink with `exactly_once` (read committed).
    exactly_once: bool,
    /// `--from PATH`: the old release's binary `upgrade` starts with.
    from: Option<std::path::PathBuf>,
}

/// The old release's binary of `upgrade`: `--from`, or [`UPGRADE_FROM`] built by
/// `scripts/build-release-at` (once; kept under the target directory).
fn old_release(opts: &Options) -> std::path::PathBuf {
    if let Some(path) = &opts.from {
        return path.clone();
    }
    let out = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/build-release-at"
    ))
    .arg(UPGRADE_FROM)
    .stderr(Stdio::inherit())
    .output()
    .expect("scripts/build-release-at runs");
    assert!(
        out.status.success(),
        "scripts/build-release-at {UPGRADE_FROM} failed"
    );
    std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// What the workload did, and each object's true last state: `Some(resourceVersion)`, or
/// `None` once deleted.
#[derive(Default)]
struct Truth {
    changes: u64,
    objects: HashMap<String, Option<String>>,
    /// Whether each object's last state passes `filter-churn`'s filter.
    matching: HashMap<String, bool>,
    /// Updates that touched only an annotation (`filter-churn` suppresses them).
    annotation_only: u64,
    /// `objects` as of each object's last change that was not annotation-only: what a stream
    /// that suppresses those ends with.
    unsuppressed: HashMap<String, Option<String>>,
}

/// A small xorshift generator: the workload is random but needs no crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Whether `configmap(i, version)` carries `keep: "yes"` (two versions in three).
fn keeps(i: usize, version: u64) -> bool {
    !(i as u64 + version).is_multiple_of(3)
}

/// ConfigMap `i` at workload version `version`: labelled `app: chaos` and `keep` (see
/// [`keeps`]), about 400 bytes of data.
fn configmap(i: usize, version: u64) -> Value {
    let cm = configmap_with_data(
        &namespace(i),
        &format!("cm-{i:06}"),
        [
            ("version", version.to_string()),
            ("payload", "x".repeat(400)),
        ],
    )
    .label("app", "chaos")
    .label("keep", if keeps(i, version) { "yes" } else { "no" });
    typed(&cm)
}

/// The namespace of object `i`: `chaos-<n>-ns`, names whose FNV-1a hashes spread over
/// `shard-churn`'s shards (`chaos-<n>` would put all 20 in one: the hash's high bits hardly
/// change with a name's last characters).
fn namespace(i: usize) -> String {
    format!("chaos-{}-ns", i % NAMESPACES)
}

/// Installs `shard-churn`'s CRD and creates its `n` Gadgets of `generation` (in their names:
/// the deleted ones' keys stay deleted in `truth`, so a lost delete shows), recorded in
/// `truth`.
fn create_gadgets(api: &ApiServer, truth: &Mutex<Truth>, n: usize, generation: u64) {
    let (group, version, kind, plural) = GADGETS;
    api.install_crd(group, version, kind, plural, true);
    let mut t = truth.lock().unwrap();
    for i in 0..n {
        let o = api.create(json!({
            "apiVersion": format!("{group}/{version}"),
            "kind": kind,
            "metadata": {"namespace": namespace(i), "name": gadget_name(i, generation)},
        }));
        let rv = o["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned();
        let key = format!("{}/{}", namespace(i), gadget_name(i, generation));
        t.unsuppressed.insert(key.clone(), Some(rv.clone()));
        t.objects.insert(key, Some(rv));
        t.changes += 1;
    }
}

/// Deletes `shard-churn`'s CRD: the API server deletes every Gadget with it.
fn delete_gadgets(api: &ApiServer, truth: &Mutex<Truth>) {
    let (group, _, _, plural) = GADGETS;
    // The workload never touches Gadgets: the truth is written after the deletes.
    api.delete_crd(group, plural);
    let mut t = truth.lock().unwrap();
    let keys: Vec<String> = t
        .objects
        .iter()
        .filter(|(k, v)| k.contains("/gd") && v.is_some())
        .map(|(k, _)| k.clone())
        .collect();
    for k in keys {
        t.unsuppressed.insert(k.clone(), None);
        t.objects.insert(k, None);
        t.changes += 1;
    }
}

fn gadget_name(i: usize, generation: u64) -> String {
    format!("gd{generation}-{i:06}")
}

fn key(i: usize) -> String {
    format!("{}/cm-{i:06}", namespace(i))
}

/// Changes `rate` objects a second until `stop`: updates (75%; 10 of those points change only
/// an annotation), deletes (15%) and creates of
/// deleted objects (recreates), in 10 ms slices; trims the API server's watch history to the
/// last 10 s of changes (etcd compaction), so that long runs stay bounded.
async fn workload(
    api: Arc<ApiServer>,
    truth: Arc<Mutex<Truth>>,
    objects: usize,
    rate: u64,
    stop: Arc<AtomicBool>,
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let start = Instant::now();
    let mut done = 0u64;
    let mut version = 1u64;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut trimmed = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        let mut t = truth.lock().unwrap();
        while done < due {
            done += 1;
            version += 1;
            let i = (rng.next() % objects as u64) as usize;
            let k = key(i);
            let exists = t.objects.get(&k).is_some_and(Option::is_some);
            let roll = rng.next() % 100;
            let rv = if !exists {
                t.matching.insert(k.clone(), keeps(i, version));
                Some(api.create(configmap(i, version)))
            } else if roll < 15 {
                t.unsuppressed.insert(k.clone(), None);
                api.delete("v1", "ConfigMap", &namespace(i), &format!("cm-{i:06}"));
                None
            } else if roll < 25 {
                // Only an annotation changes (the data and labels of the current state stay).
                let mut current = api
                    .get("v1", "ConfigMap", &namespace(i), &format!("cm-{i:06}"))
                    .expect("it exists");
                current["metadata"]["annotations"] = json!({"touched": version.to_string()});
                t.annotation_only += 1;
                Some(api.update(current))
            } else {
                t.matching.insert(k.clone(), keeps(i, version));
                Some(api.update(configmap(i, version)))
            };
            let rv = rv.map(|o| {
                o["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            });
            if roll >= 25 || !exists {
                t.unsuppressed.insert(k.clone(), rv.clone());
            }
            t.objects.insert(k, rv);
            t.changes += 1;
        }
        drop(t);
        if trimmed.elapsed() > Duration::from_secs(5) {
            api.trim_history((rate * 10) as usize);
            trimmed = Instant::now();
        }
    }
}

/// The service, run from the release binary with a config file.
struct Service {
    child: Child,
    admin: u16,
    peak_rss_mib: f64,
}

impl Service {
    fn start(dir: &Path, config: &Value, kubeconfig: &Path) -> Self {
        Self::start_binary(
            Path::new(env!("CARGO_BIN_EXE_kube-event-bridge")),
            dir,
            config,
            kubeconfig,
        )
    }

    /// [`Service::start`] with another build of the service (`upgrade`'s old release).
    fn start_binary(binary: &Path, dir: &Path, config: &Value, kubeconfig: &Path) -> Self {
        let admin = support::loopback::free_port();
        let mut config = config.clone();
        config["admin"] = json!({"address": format!("127.0.0.1:{admin}")});
        // A file per process: replicas started together must not read each other's.
        let path = dir.join(format!("config-{admin}.yaml"));
        std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("service.log"))
            .unwrap();
        let child = Command::new(binary)
            .env_clear()
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info")
            .args(["run", "--config", path.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the service starts");
        Self {
            child,
            admin,
            peak_rss_mib: 0.0,
        }
    }

    /// Samples the peak RSS (VmHWM) while the process lives.
    fn sample_rss(&mut self) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        if let Some(kb) = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        {
            self.peak_rss_mib = self.peak_rss_mib.max(kb / 1024.0);
        }
    }

    /// The metrics page; `None` when the process does not answer within a second (a
    /// frozen process accepts connections but never answers).
    async fn metrics(&self) -> Option<String> {
        self.get("/metrics").await.map(|(_, body)| body)
    }

    /// The status code and body of `path` on the admin port; `None` when the process does
    /// not answer within a second.
    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", self.admin).parse().unwrap();
        let read = async {
            let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .ok()?;
            let mut text = String::new();
            s.read_to_string(&mut text).await.ok()?;
            let code = text.split_whitespace().nth(1)?.parse().ok()?;
            let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            Some((code, body.to_owned()))
        };
        tokio::time::timeout(Duration::from_secs(1), read)
            .await
            .ok()
            .flatten()
    }

    /// Sends `signal` (STOP, CONT) without waiting (to a process that is gone: nothing).
    fn send(&self, signal: &str) {
        Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status()
            .unwrap();
    }

    /// Sends `signal` and waits for the exit; returns the exit code (None: killed).
    fn signal(&mut self, signal: &str) -> Option<i32> {
        self.sample_rss();
        Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        self.child.wait().unwrap().code()
    }

    /// Waits for the process to exit (after [`Service::send`]); its exit code.
    fn wait(&mut self) -> Option<i32> {
        self.child.wait().unwrap().code()
    }

    /// Stops it as the kubelet stops a pod: SIGTERM, and SIGKILL if it has not exited after
    /// `grace` (`terminationGracePeriodSeconds`). Its exit code; `None` when it was killed.
    async fn terminate(&mut self, grace: Duration) -> Option<i32> {
        self.sample_rss();
        self.send("TERM");
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!(
            "  a replica did not exit within {grace:?} of SIGTERM: SIGKILLed, as the kubelet does"
        );
        self.send("KILL");
        self.child.wait().unwrap().code()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.send("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The upper bound of the bucket holding the 99th percentile of a histogram (all labels).
fn histogram_p99(text: &str, name: &str) -> Option<f64> {
    let bucket = format!("{name}_bucket");
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for l in text.lines().filter(|l| l.starts_with(&bucket)) {
        let le = l.split("le=\"").nth(1)?.split('"').next()?;
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().ok()?
        };
        let count: f64 = l.rsplit(' ').next()?.parse().ok()?;
        match buckets.iter_mut().find(|(b, _)| *b == le) {
            Some((_, c)) => *c += count,
            None => buckets.push((le, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    (total > 0.0).then_some(())?;
    buckets
        .iter()
        .find(|(_, c)| *c >= 0.99 * total)
        .map(|(le, _)| *le)
}

/// What the stream holds, folded per object in the order the broker holds the messages (never
/// by resourceVersion: consumers see order, not numbers); messages; duplicate ids.
struct Stream {
    messages: u64,
    duplicates: u64,
    /// Per key, (resourceVersion, deleted) of the last message in the order the broker holds
    /// them: what a "last message wins" consumer ends with.
    last: HashMap<String, (u64, bool)>,
    /// The same, skipping a message whose id was seen before: a "deduplicate by id, then last
    /// message wins" consumer.
    last_deduplicated: HashMap<String, (u64, bool)>,
    ids: std::collections::HashSet<String>,
    /// Messages the broker dropped by its own limits before they were read.
    evicted: u64,
    /// Deletes marked `k8sfilteredout`.
    filtered_out: u64,
    /// Each object as the stream last gave it, for applying patches as a consumer does.
    objects: HashMap<String, Value>,
    /// Updates with `data.patch`, and those whose patch applied to the last object gives
    /// something else than their `data.object` (or does not apply).
    patches: u64,
    patch_mismatches: u64,
}

impl Stream {
    fn new() -> Self {
        Self {
            messages: 0,
            duplicates: 0,
            last: HashMap::new(),
            last_deduplicated: HashMap::new(),
            ids: std::collections::HashSet::new(),
            evicted: 0,
            filtered_out: 0,
            objects: HashMap::new(),
            patches: 0,
            patch_mismatches: 0,
        }
    }

    /// Folds one structured CloudEvent in.
    fn add(&mut self, payload: &[u8]) {
        self.messages += 1;
        let event: Value = serde_json::from_slice(payload).expect("a structured CloudEvent");
        let first_of_its_id = self
            .ids
            .insert(event["id"].as_str().unwrap_or_default().to_owned());
        if !first_of_its_id {
            self.duplicates += 1;
        }
        if event["k8sfilteredout"] == true {
            self.filtered_out += 1;
        }
        let s = Summary::of(&event);
        let rv: u64 = s.resource_version.parse().unwrap_or_default();
        let deleted = s.event_type == "deleted";
        if deleted {
            self.objects.remove(&s.key());
        } else {
            let object = event["data"]["object"].clone();
            if let Some(patch) = event["data"].get("patch") {
                self.patches += 1;
                let applied = self.objects.get(&s.key()).cloned().and_then(|mut doc| {
                    let patch: json_patch::Patch = serde_json::from_value(patch.clone()).ok()?;
                    json_patch::patch(&mut doc, &patch).ok()?;
                    Some(doc)
                });
                if applied.as_ref() != Some(&object) {
                    self.patch_mismatches += 1;
                }
            }
            self.objects.insert(s.key(), object);
        }
        self.last.insert(s.key(), (rv, deleted));
        if first_of_its_id {
            self.last_deduplicated.insert(s.key(), (rv, deleted));
        }
    }
}

/// What a consumer that folds `last` (per key, in the broker's order) ends with, against the
/// truth. A stale final is a live object whose last message is another state; a lost delete, a
/// deleted object whose last message is not a delete; a phantom delete, a live object whose
/// last message is a delete; missing, a live object never published. With `filtered`, an
/// object whose last state fails the filter must be absent (never published, or deleted).
#[derive(Default)]
struct Finals {
    stale: u64,
    lost_deletes: u64,
    phantom: u64,
    missing: u64,
    /// The first wrong keys, described.
    wrong: Vec<String>,
}

impl Finals {
    fn total(&self) -> u64 {
        self.stale + self.lost_deletes + self.phantom + self.missing
    }
}

fn fold_by_order(truth: &Truth, last: &HashMap<String, (u64, bool)>, filtered: bool) -> Finals {
    let objects = if filtered {
        &truth.unsuppressed
    } else {
        &truth.objects
    };
    let mut f = Finals::default();
    for (k, want) in objects {
        let want = want
            .as_ref()
            .filter(|_| !filtered || truth.matching.get(k).copied().unwrap_or(false));
        let got = last.get(k);
        let counter = match (want, got) {
            (Some(rv), Some((got, false))) if rv.parse::<u64>().ok() != Some(*got) => &mut f.stale,
            (Some(_), Some((_, true))) => &mut f.phantom,
            (Some(_), None) => &mut f.missing,
            (None, Some((_, false))) => &mut f.lost_deletes,
            _ => continue,
        };
        *counter += 1;
        if f.wrong.len() < 10 {
            f.wrong
                .push(format!("{k}: want {want:?}, last message {got:?}"));
        }
    }
    f.wrong.sort();
    f
}

/// Where the service exports to.
enum Broker {
    Nats(NatsServer),
    Kafka(kafka::Kafka),
}

const KAFKA_TOPIC: &str = "chaos-events";
const KAFKA_PARTITIONS: i32 = 12;

/// The fault of `scenario`: `kafka-X` is `X` into Kafka.
fn fault(scenario: &str) -> &str {
    scenario.strip_prefix("kafka-").unwrap_or(scenario)
}

impl Broker {
    fn start(kafka: bool) -> Self {
        if !kafka {
            return Self::Nats(NatsServer::start());
        }
        let node = tokio::task::block_in_place(kafka::Kafka::start);
        // The service creates its checkpoint topic itself.
        node.create_topic(KAFKA_TOPIC, KAFKA_PARTITIONS as u32);
        Self::Kafka(node)
    }

    /// The service's sink.
    fn sink(&self) -> Value {
        let mut sink = json!({
            "workers": 64, "checkpoint_interval": "1s",
            "retry": {"base_delay": "50ms", "max_delay": "2s"},
        });
        match self {
            Self::Nats(n) => {
                sink["name"] = json!("out");
                sink["type"] = json!("nats");
                sink["nats"] = json!({"servers": [n.url()], "ack_timeout": "5s",
                    "stream": {"name": STREAM, "create": true, "subjects": ["k8s.>"], "duplicate_window": "30m"}});
            }
            Self::Kafka(k) => {
                sink["name"] = json!("out");
                sink["type"] = json!("kafka");
                sink["kafka"] = json!({"brokers": [k.brokers()], "topic": KAFKA_TOPIC,
                    "create_topics": null, "delivery_timeout": "5s"});
            }
        }
        sink
    }

    fn kafka_client(k: &kafka::Kafka) -> rdkafka::ClientConfig {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", k.brokers());
        c
    }

    /// Messages the destination holds now.
    async fn len(&self) -> u64 {
        match self {
            Self::Nats(n) => stream_len(&n.url()).await.unwrap_or(0),
            Self::Kafka(m) => tokio::task::block_in_place(|| {
                use rdkafka::consumer::{BaseConsumer, Consumer};
                let Ok(c) = Self::kafka_client(m).create::<BaseConsumer>() else {
                    return 0;
                };
                (0..KAFKA_PARTITIONS)
                    .filter_map(|p| {
                        c.fetch_watermarks(KAFKA_TOPIC, p, Duration::from_secs(5))
                            .ok()
                    })
                    .map(|(lo, hi)| (hi - lo) as u64)
                    .sum()
            }),
        }
    }

    /// Every message, folded.
    async fn read(&self) -> Stream {
        match self {
            Self::Nats(n) => read_stream(&n.url()).await,
            Self::Kafka(m) => tokio::task::block_in_place(|| {
                use rdkafka::consumer::{BaseConsumer, Consumer};
                let mut out = Stream::new();
                let c: BaseConsumer = Self::kafka_client(m).create().unwrap();
                out.evicted = (0..KAFKA_PARTITIONS)
                    .map(|p| {
                        c.fetch_watermarks(KAFKA_TOPIC, p, Duration::from_secs(5))
                            .unwrap()
                            .0 as u64
                    })
                    .sum();
                kube_event_bridge::sinks::kafka::reader::read_to_end(
                    &Self::kafka_client(m),
                    &[KAFKA_TOPIC.to_owned()],
                    |r| out.add(r.value.as_deref().unwrap_or_default()),
                )
                .expect("the events topic reads");
                out
            }),
        }
    }

    /// Takes the broker down for `down` under load (blocking this runtime thread; the load and
    /// the API server go on on the other).
    fn outage(&mut self, down: Duration) {
        tokio::task::block_in_place(|| match self {
            Self::Nats(n) => n.restart_after(down),
            Self::Kafka(k) => k.outage(down),
        });
    }
}

async fn read_stream(url: &str) -> Stream {
    use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(STREAM).await.unwrap();
    let mut consumer = stream
        .create_consumer(pull::Config {
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let pending = consumer.info().await.unwrap().num_pending;
    let mut out = Stream::new();
    let mut messages = consumer.messages().await.unwrap();
    for _ in 0..pending {
        let m = messages.next().await.unwrap().unwrap();
        out.add(&m.payload);
    }
    out
}

fn service_config(broker: &Broker, scenario: &str, opts: &Options) -> Value {
    let rate = opts.rate;
    let mut sink = broker.sink();
    if opts.exactly_once && matches!(broker, Broker::Kafka(_)) {
        sink["kafka"]["exactly_once"] = json!(true);
        // Longer than `kafka-broker-down`'s outage (up to 60 s): the open transaction's commit
        // is tried until the brokers are back, instead of ending in an unknown outcome (which
        // stops publishing until a restart).
        sink["kafka"]["transaction_timeout"] = json!("2m");
    }
    if scenario == "slow-sink" {
        // Ten times slower than the input.
        sink["rate_limit"] = json!({"qps": (rate / 10).max(1) as f64, "burst": 10});
        sink["max_pending"] = json!(SLOW_MAX_PENDING);
    }
    let mut resource = json!({"api_version": "v1", "kind": "ConfigMap"});
    let mut message = json!({});
    if scenario == "filter-churn" {
        resource["filter"] = json!(r#"object.metadata.labels["keep"] == "yes""#);
        resource["ignore_fields"] = json!(["/metadata/annotations", "/metadata/resourceVersion"]);
        // Patches alone: the bench applies each to the object it last read, as a consumer.
        message["diff"] = json!("patch");
        message["include_old_object"] = json!(false);
    }
    let mut builder = ConfigBuilder::new();
    if fault(scenario) == "shard-churn" {
        let (group, version, kind, _) = GADGETS;
        builder = builder
            .resource(json!({"api_version": format!("{group}/{version}"), "kind": kind}))
            .route(&format!("{}.{group}", kind.to_lowercase()), &["out"]);
    }
    if matches!(fault(scenario), "shard-churn" | "upgrade") {
        builder = builder
            .set(
                "leader_election",
                json!({"enabled": true, "namespace": "kube-system", "lease_duration": "3s",
                       "renew_deadline": "2s", "retry_period": "200ms"}),
            )
            .set("sharding", json!({"shards": CHURN_SHARDS.0}));
    }
    if fault(scenario) == "zombie-leader" {
        // A 3 s lease, renewed within 2 s: with the 5 s ack timeout, a 4 s takeover wait.
        builder = builder.set(
            "leader_election",
            json!({"enabled": true, "namespace": "kube-system", "lease_duration": "3s",
                   "renew_deadline": "2s", "retry_period": "200ms"}),
        );
    }
    // The admin address is the one Service::start gives.
    builder
        .cluster("chaos")
        .grace_period("30s")
        .kubernetes(json!({"qps": 1000, "burst": 1000}))
        .message(message)
        .resource(resource)
        .sink(sink)
        .route("configmap", &["out"])
        .value()
}

/// Default length of a scenario, in minutes.
fn default_minutes(scenario: &str) -> f64 {
    match scenario {
        "watch-drop" => 10.0,
        "slow-sink" | "model" => 2.0,
        "zombie-leader" | "kafka-zombie-leader" => 3.0,
        "shard-churn" | "kafka-shard-churn" | "upgrade" | "kafka-upgrade" => 4.0,
        "broker-down" | "kafka-broker-down" => 3.0,
        _ => 5.0,
    }
}

/// The `model` scenario: the model-based test's cases (200 operations each, seeds from 1000, every
/// other one sharded) until the time is up; the line sums them. Fails loudly, naming the seed, on any loss.
async fn run_model(duration: Duration) -> String {
    use support::model::{Outcome, Settings, run_case};
    let start = Instant::now();
    let mut total = Outcome::default();
    let mut cases = 0;
    while cases == 0 || start.elapsed() < duration {
        let seed = 1000 + cases;
        let dir = tempfile::tempdir().unwrap();
        // Every other case sharded, with shard handovers.
        let sharded = cases % 2 == 1;
        let o = run_case(
            Settings {
                seed,
                ops: 200,
                sharded,
            },
            dir.path(),
        )
        .await;
        assert!(
            o.holds(),
            "seed {seed} (replay: KEB_MODEL_SEED={seed} KEB_MODEL_CASES=1 KEB_MODEL_OPS=200 \
             cargo test --test model {}): {}",
            if sharded {
                "random_shard"
            } else {
                "random_sequences"
            },
            o.details()
        );
        total.add(&o);
        cases += 1;
    }
    format!(
        "model: {cases} cases in {:.0?}: {}",
        start.elapsed(),
        total.line()
    )
}

async fn run(scenario: &str, opts: &Options) -> String {
    let minutes = opts.minutes.unwrap_or_else(|| default_minutes(scenario));
    let duration = Duration::from_secs_f64(minutes * 60.0);
    if scenario == "model" {
        return run_model(duration).await;
    }
    // This tree's build, and `upgrade`'s old release (built first, before anything starts).
    let this = Path::new(env!("CARGO_BIN_EXE_kube-event-bridge"));
    let old = (fault(scenario) == "upgrade").then(|| {
        // The old release knows no `exactly_once` (its config refuses the field).
        assert!(
            !opts.exactly_once,
            "{scenario}: the release upgraded from has no exactly_once; run it without --exactly-once"
        );
        old_release(opts)
    });
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(ApiServer::start().await);
    let mut broker = Broker::start(scenario.starts_with("kafka-"));
    let truth = Arc::new(Mutex::new(Truth::default()));
    {
        let mut t = truth.lock().unwrap();
        for i in 0..opts.objects {
            let o = api.create(configmap(i, 0));
            t.matching.insert(key(i), keeps(i, 0));
            let rv = o["metadata"]["resourceVersion"].as_str().map(str::to_owned);
            t.unsuppressed.insert(key(i), rv);
            t.objects.insert(
                key(i),
                Some(
                    o["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                ),
            );
        }
    }
    // `shard-churn`: the Gadgets (a tenth as many as ConfigMaps), their CRD deleted and created
    // again during the churn.
    let gadgets = if fault(scenario) == "shard-churn" {
        (opts.objects / 10).max(1)
    } else {
        0
    };
    let mut crd_changes = (0, 0);
    if gadgets > 0 {
        create_gadgets(&api, &truth, gadgets, 0);
    }
    let kubeconfig = api.write_kubeconfig(dir.path());
    let config = service_config(&broker, scenario, opts);
    let replica = |identity: &str| {
        let mut config = config.clone();
        if let Some(le) = config.get_mut("leader_election") {
            le["identity"] = json!(identity);
        }
        Service::start_binary(
            old.as_deref().unwrap_or(this),
            dir.path(),
            &config,
            &kubeconfig,
        )
    };
    let mut service = replica("chaos-a");
    // `zombie-leader`: the second replica, and the one frozen now (since when).
    let standby = if fault(scenario) == "zombie-leader" {
        // Started once the first listens, so that the two get different admin ports.
        wait::until(
            "the first replica's admin port",
            Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(100)),
            async || service.metrics().await.is_some(),
        )
        .await;
        Some(replica("chaos-b"))
    } else {
        None
    };
    let mut frozen: Option<(bool, Instant)> = None;
    let mut peak_rss: f64 = 0.0;
    let mut exits = Vec::new();
    // `shard-churn`: the replicas beside `service`, how many were started in all, and the
    // config of the rolling update (the other shard count; with Kafka, a lower
    // `delivery_timeout`: the old pods' messages must still be waited out).
    let mut churn: Vec<Service> = Vec::new();
    let mut started_replicas = 1;
    let mut churn_step = 0;
    let rolled = {
        let mut c = config.clone();
        if let Some(sharding) = c.get_mut("sharding") {
            sharding["shards"] = json!(CHURN_SHARDS.1);
        }
        if let Some(kafka) = c.pointer_mut("/sinks/0/kafka") {
            kafka["delivery_timeout"] = json!("10s");
        }
        c
    };
    let start_replica = async |binary: &Path, config: &Value, n: usize| {
        let mut config = config.clone();
        config["leader_election"]["identity"] = json!(format!("churn-{n}"));
        let s = Service::start_binary(binary, dir.path(), &config, &kubeconfig);
        // Listening before the next one picks a free port.
        wait::until(
            "a replica's admin port",
            Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(100)),
            async || s.metrics().await.is_some(),
        )
        .await;
        s
    };
    if matches!(fault(scenario), "shard-churn" | "upgrade") {
        wait::until(
            "the first replica's admin port",
            Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(100)),
            async || service.metrics().await.is_some(),
        )
        .await;
        for _ in 0..2 {
            let binary = old.as_deref().unwrap_or(this);
            churn.push(start_replica(binary, &config, started_replicas).await);
            started_replicas += 1;
        }
    }
    // The initial list goes out before the load starts.
    let first_list = opts.objects as u64 / 2;
    wait::until(
        "the service to publish its first list",
        Patience::of(Duration::from_secs(120)).polling(Duration::from_millis(200)),
        async || broker.len().await >= first_list,
    )
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(workload(
        api.clone(),
        truth.clone(),
        opts.objects,
        opts.rate,
        stop.clone(),
    ));
    let started = Instant::now();
    let mut fault_done = false;
    let mut last_fault = Instant::now();
    let faults = Arc::new(AtomicU64::new(0));
    if scenario == "throttle" {
        api.throttle_every(Some(3));
    }
    let mut peak_held = 0.0f64;
    while started.elapsed() < duration {
        tokio::time::sleep(Duration::from_millis(250)).await;
        service.sample_rss();
        let mut held = 0.0;
        for s in std::iter::once(&service).chain(&standby).chain(&churn) {
            if let Some(m) = s.metrics().await {
                held += support::metric_in(&m, "keb_listener_buffered_notifications");
            }
        }
        peak_held = peak_held.max(held);
        let since = last_fault.elapsed();
        match fault(scenario) {
            "watch-drop" | "filter-churn" if since >= Duration::from_secs(5) => {
                api.drop_watches();
                faults.fetch_add(1, Ordering::Relaxed);
                last_fault = Instant::now();
            }
            "gone-storm" if since >= Duration::from_secs(4) => {
                api.compact();
                api.drop_watches();
                faults.fetch_add(1, Ordering::Relaxed);
                last_fault = Instant::now();
            }
            "broker-down" if !fault_done && started.elapsed() >= duration / 4 => {
                let down = Duration::from_secs(60).min(duration / 2);
                broker.outage(down);
                faults.fetch_add(down.as_secs(), Ordering::Relaxed);
                fault_done = true;
            }
            "zombie-leader" => {
                let standby = standby.as_ref().expect("two replicas");
                match frozen {
                    Some((a, at)) if at.elapsed() >= Duration::from_secs(8) => {
                        (if a { &service } else { standby }).send("CONT");
                        frozen = None;
                        last_fault = Instant::now();
                    }
                    None if since >= Duration::from_secs(12) => {
                        if let Some(holder) = api.lease_holder() {
                            let a = holder == "chaos-a";
                            (if a { &service } else { standby }).send("STOP");
                            frozen = Some((a, Instant::now()));
                            faults.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    _ => {}
                }
            }
            // 3 replicas → 5 → 2 → a rolling update to another shard count (and, with Kafka, a
            // lower `delivery_timeout`) → one SIGKILLed and replaced → 3.
            "shard-churn" if started.elapsed() >= duration * (churn_step + 1) / 6 => {
                churn_step += 1;
                let mut stop = |s: &mut Service, signal: &str| {
                    exits.push(s.signal(signal));
                    peak_rss = peak_rss.max(s.peak_rss_mib);
                };
                match churn_step {
                    1 => {
                        for _ in 0..2 {
                            churn.push(start_replica(this, &config, started_replicas).await);
                            started_replicas += 1;
                        }
                    }
                    2 => {
                        let mut stopping: Vec<Service> = churn.drain(..3).collect();
                        for s in &mut stopping {
                            s.sample_rss();
                            s.send("TERM");
                        }
                        // While they drain and their shards move, the CRD goes (with its
                        // Gadgets).
                        delete_gadgets(&api, &truth);
                        crd_changes.0 += 1;
                        for s in &mut stopping {
                            exits.push(s.wait());
                            peak_rss = peak_rss.max(s.peak_rss_mib);
                        }
                    }
                    3 => {
                        let new = start_replica(this, &rolled, started_replicas).await;
                        started_replicas += 1;
                        tokio::time::sleep(Duration::from_secs(10)).await;
                        let mut old = std::mem::replace(&mut service, new);
                        stop(&mut old, "TERM");
                        let new = start_replica(this, &rolled, started_replicas).await;
                        started_replicas += 1;
                        tokio::time::sleep(Duration::from_secs(10)).await;
                        for mut s in churn.drain(..) {
                            stop(&mut s, "TERM");
                        }
                        churn.push(new);
                    }
                    4 => {
                        for mut s in churn.drain(..) {
                            stop(&mut s, "KILL");
                        }
                        // The killed replica's shards have no owner: the CRD comes back.
                        create_gadgets(&api, &truth, gadgets, 1);
                        crd_changes.1 += 1;
                        churn.push(start_replica(this, &rolled, started_replicas).await);
                        started_replicas += 1;
                    }
                    5 => {
                        churn.push(start_replica(this, &rolled, started_replicas).await);
                        started_replicas += 1;
                    }
                    _ => {}
                }
                faults.fetch_add(1, Ordering::Relaxed);
            }
            // A rolling update from the old release, as a Deployment does it (one surge pod,
            // then an old one terminated), one replica per quarter of the time.
            "upgrade" if churn_step < 3 && started.elapsed() >= duration * (churn_step + 1) / 4 => {
                churn_step += 1;
                let new = start_replica(this, &config, started_replicas).await;
                started_replicas += 1;
                tokio::time::sleep(Duration::from_secs(10)).await;
                let mut gone = if churn_step == 1 {
                    std::mem::replace(&mut service, new)
                } else {
                    let gone = churn.remove(0);
                    churn.push(new);
                    gone
                };
                // The chart's terminationGracePeriodSeconds beside the 30 s grace period: 40 s.
                exits.push(gone.terminate(Duration::from_secs(40)).await);
                peak_rss = peak_rss.max(gone.peak_rss_mib);
                faults.fetch_add(1, Ordering::Relaxed);
            }
            "sigterm" | "sigkill" if !fault_done && started.elapsed() >= duration / 2 => {
                let signal = if scenario == "sigterm" {
                    "TERM"
                } else {
                    "KILL"
                };
                exits.push(service.signal(signal));
                peak_rss = peak_rss.max(service.peak_rss_mib);
                service = Service::start(dir.path(), &config, &kubeconfig);
                fault_done = true;
            }
            _ => {}
        }
    }
    if let Some((a, _)) = frozen {
        (if a {
            &service
        } else {
            standby.as_ref().unwrap()
        })
        .send("CONT");
    }
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    api.throttle_every(None);
    // Caught up: the service holds nothing and the stream stopped growing.
    let services: Vec<&Service> = std::iter::once(&service)
        .chain(&standby)
        .chain(&churn)
        .collect();
    // Sharded: every shard owned, and quiet for longer (a shard taken over after its owner
    // was killed publishes nothing for its lease, the takeover wait and the resume).
    let sharded = matches!(fault(scenario), "shard-churn" | "upgrade");
    let caught_up = catch_up(
        &services,
        &broker,
        Duration::from_secs(300),
        sharded.then_some(CHURN_SHARDS),
    )
    .await;
    service.sample_rss();
    peak_rss = peak_rss.max(service.peak_rss_mib);
    for s in &mut churn {
        s.sample_rss();
        peak_rss = peak_rss.max(s.peak_rss_mib);
    }
    let (p99, acked, suppressed) = match service.metrics().await {
        Some(m) => (
            histogram_p99(&m, "keb_end_to_end_latency_seconds"),
            support::metric_in(&m, "keb_sink_published_total") as u64,
            m.lines()
                .filter(|l| {
                    l.starts_with("keb_filtered_total{") && l.contains("reason=\"suppressed\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as u64,
        ),
        None => (None, 0, 0),
    };
    let stream = broker.read().await;
    let t = truth.lock().unwrap();
    let mut lost_n = 0;
    for (model, last) in [
        ("last message wins", &stream.last),
        (
            "deduplicate by id, then last wins",
            &stream.last_deduplicated,
        ),
    ] {
        let f = fold_by_order(&t, last, scenario == "filter-churn");
        println!(
            "  {scenario}: folded by order ({model}): stale finals {}, lost deletes {}, phantom deletes {}, missing {}",
            f.stale, f.lost_deletes, f.phantom, f.missing
        );
        for l in &f.wrong {
            eprintln!("  {scenario}: ({model}) {l}");
        }
        lost_n = lost_n.max(f.total());
    }
    if lost_n > 0 || !caught_up {
        let keep = std::env::temp_dir().join(format!("chaos-{scenario}.log"));
        let _ = std::fs::copy(dir.path().join("service.log"), &keep);
        eprintln!(
            "  {scenario}: the service's log is kept in {}",
            keep.display()
        );
    }
    let extra = match fault(scenario) {
        "watch-drop" | "gone-storm" => format!("  faults {}", faults.load(Ordering::Relaxed)),
        "zombie-leader" => format!("  leaders frozen {}", faults.load(Ordering::Relaxed)),
        "filter-churn" => format!(
            "  faults {}  annotation-only updates {}  filtered out (k8sfilteredout) {}  suppressed {}  patches {} (not giving the object: {})",
            faults.load(Ordering::Relaxed),
            t.annotation_only,
            stream.filtered_out,
            suppressed,
            stream.patches,
            stream.patch_mismatches
        ),
        "broker-down" => {
            format!("  down {} s", faults.load(Ordering::Relaxed))
        }
        "sigterm" | "sigkill" => format!("  exit {:?}", exits.first().copied().flatten()),
        "shard-churn" => format!(
            "  steps {}  replicas started {started_replicas}  exits {exits:?}  gadgets {gadgets}: CRD deleted {}, created again {}",
            faults.load(Ordering::Relaxed),
            crd_changes.0,
            crd_changes.1
        ),
        "upgrade" => format!(
            "  old replicas replaced {} (from {})  exits {exits:?}",
            faults.load(Ordering::Relaxed),
            old.as_deref()
                .map_or(String::new(), |p| p.display().to_string())
        ),
        "slow-sink" => format!(
            "  rss cap {SLOW_RSS_CAP_MIB} MiB: {}",
            if peak_rss <= SLOW_RSS_CAP_MIB {
                "held"
            } else {
                "EXCEEDED"
            }
        ),
        _ => String::new(),
    };
    format!(
        "{scenario:<12} {minutes:>4} min  changes {:>8}  acked {acked:>8}  delivered {:>8}  lost = {lost_n}  duplicates {:>5}  max RSS {:>5.0} MiB  peak held {peak_held:>6.0}  p99 watch→ack {}{}{extra}",
        t.changes,
        stream.messages,
        stream.duplicates,
        peak_rss,
        p99.map_or("n/a".into(), |s| if s.is_infinite() {
            "> 10 s".into()
        } else {
            format!("{:.0} ms", s * 1000.0)
        }),
        if caught_up { "" } else { "  (NOT CAUGHT UP)" },
    ) + &if stream.evicted > 0 {
        format!(
            "  (THE BROKER EVICTED {} MESSAGES: lost is not meaningful)",
            stream.evicted
        )
    } else {
        String::new()
    }
}

async fn stream_len(url: &str) -> Option<u64> {
    let client = async_nats::connect(url).await.ok()?;
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(STREAM).await.ok()?;
    Some(s.info().await.ok()?.state.messages)
}

/// Waits until the service holds no notification and the stream has not grown for 5 s.
/// With `shards` (the counts a sharded scenario ran with), every shard of one count must be
/// owned, every replica's routes resumed (`keb_route_resuming` and `keb_checkpoint_waiting`
/// 0: a shard whose new owner still reads its checkpoint or compares it has not published its
/// deletes yet, however long the stream has been still) and ready (`/readyz` 200), and the
/// stream still for 15 s.
async fn catch_up(
    services: &[&Service],
    broker: &Broker,
    within: Duration,
    shards: Option<(u32, u32)>,
) -> bool {
    let deadline = Instant::now() + within;
    let (mut last, mut still_since) = (0, Instant::now());
    let quiet = Duration::from_secs(if shards.is_some() { 15 } else { 5 });
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (mut held, mut owned, mut unresumed, mut unready) = (0.0, 0.0, 0.0, 0);
        for service in services {
            match service.metrics().await {
                Some(m) => {
                    held += support::metric_in(&m, "keb_listener_buffered_notifications");
                    owned += support::metric_in(&m, "keb_shard_owned");
                    unresumed += support::metric_in(&m, "keb_route_resuming")
                        + support::metric_in(&m, "keb_checkpoint_waiting");
                }
                None => held = f64::NAN,
            };
            if shards.is_some() && service.get("/readyz").await.map(|(code, _)| code) != Some(200) {
                unready += 1;
            }
        }
        let all_owned = shards.is_none_or(|(a, b)| owned == f64::from(a) || owned == f64::from(b))
            && unresumed == 0.0
            && unready == 0;
        let len = broker.len().await;
        if len != last || held != 0.0 || !all_owned {
            (last, still_since) = (len, Instant::now());
        } else if still_since.elapsed() >= quiet {
            return true;
        }
    }
    false
}

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let mut scenario = None;
    let mut opts = Options {
        minutes: None,
        rate: 5_000,
        objects: 20_000,
        exactly_once: false,
        from: None,
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rate" => opts.rate = args.next().and_then(|v| v.parse().ok()).expect("--rate N"),
            "--exactly-once" => opts.exactly_once = true,
            "--from" => opts.from = Some(args.next().expect("--from PATH").into()),
            "--objects" => {
                opts.objects = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--objects N")
            }
            s if scenario.is_none() && (s == "all" || SCENARIOS.contains(&s)) => {
                scenario = Some(s.to_owned())
            }
            m if opts.minutes.is_none() && m.parse::<f64>().is_ok() => {
                opts.minutes = m.parse().ok()
            }
            other => {
                eprintln!(
                    "unknown argument {other:?}; usage: cargo bench --bench chaos -- SCENARIO|all [MINUTES] [--rate N] [--objects N] [--exactly-once] [--from OLD_BINARY]; scenarios: {}",
                    SCENARIOS.join(", ")
                );
                std::process::exit(2);
            }
        }
    }
    // The library's own warnings (a read that stalls, say) show on stderr.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let scenario = scenario.unwrap_or_else(|| "all".into());
    let list: Vec<&str> = if scenario == "all" {
        SCENARIOS.to_vec()
    } else {
        vec![scenario.as_str()]
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "chaos bench: {} changes/s over {} ConfigMaps (75% updates, of which 10 points touch only an annotation; 15% deletes; recreates), service binary → nats-server JetStream (kafka-: Apache Kafka 4.3{}); {} cores",
        opts.rate,
        opts.objects,
        if opts.exactly_once {
            ", exactly once, read committed"
        } else {
            ""
        },
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for s in list {
        let line = runtime.block_on(run(s, &opts));
        println!("{line}");
    }
}
