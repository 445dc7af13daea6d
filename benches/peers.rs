//! kube-event-bridge beside what users would run instead, on one real kube-apiserver v1.36
//! (etcd with `--unsafe-no-fsync`) and one Apache Kafka 4.3 node: the OpenTelemetry Collector
//! contrib v0.145.0 (`k8sobjects` receiver in `watch` mode with `include_initial_state`, the
//! `k8s_leader_elector` extension, the batch processor and the `kafka` exporter; built from
//! the Go module proxy by scripts/build-peers, configuration in `benches/peers/collector.yaml`)
//! and client-go v0.36's shared informer (the reference program of tests/realk8s; no broker).
//! Each tool runs alone for the performance phases, the order rotating from round to round.
//!
//! Every tool is measured from outside the same way:
//! - **At a Kafka consumer**: each message's time of arrival, parsed back to (namespace/name,
//!   uid, resourceVersion, type). Each tool writes to a topic of its own with one partition, so
//!   that the order of the collector's records is the order they were written. client-go has
//!   no broker: its notifications are read from its output as it writes them (every 10 ms).
//! - **Bytes read from the API server**, through a counting loopback proxy between the tool
//!   and the API server (TLS passes through it); **bytes stored in Kafka** (the partition's
//!   log segments on disk, compressed as stored).
//! - **CPU seconds and peak RSS** of the tool's process, of the API server's and of etcd's,
//!   from /proc (RSS sampled every 100 ms), and **the API server's requests by verb** (its
//!   `apiserver_request_total`).
//! - The bridge's own **peaks during a sync** of the notifications it held (pending or being
//!   published, `keb_listener_buffered_notifications`) and of the publishes awaiting Kafka's
//!   acknowledgement (`keb_sink_in_flight`), from its /metrics every 100 ms.
//!
//! Phases:
//! 1. Per round and tool, at BENCH_OBJECTS ConfigMaps (about 1 KB, 5 namespaces):
//!    **initial sync** (first and last message, read by a consumer started a second before the
//!    tool; client-go: `HasSynced`); **idle**: CPU per
//!    second over BENCH_IDLE_SECS with nothing changing; **steady changes** at
//!    BENCH_RATE per second and as fast as 16 writers go (80% updates, 10% deletes, 10%
//!    creates) for BENCH_STEADY_SECS each: lag from the write's acknowledgement to the
//!    message's arrival, CPU per change, bytes stored per change; **a burst** of
//!    BENCH_BURST updates: time until the last is in Kafka; **a restart** down 10 s (inside
//!    the watch history): deletes, updates and creates made meanwhile delivered, unchanged
//!    objects sent again; **what a consumer ends with**, folded by message order per object.
//! 2. **Failover**, per round, for each tool with a leader elector (the bridge without and
//!    with `exactly_once`, the collector): two replicas, the leader SIGKILLed, then
//!    BENCH_RESTART_CHANGES deletes, updates and creates each: from the kill to the Lease
//!    taken and to the first message that reflects one of those changes; what was delivered,
//!    duplicates, unchanged objects sent again.
//! 3. **Initial sync at BENCH_OBJECTS_LARGE** (the extra objects made only after every phase
//!    above), per round and tool.
//! 4. (`outage`, its own invocation) Per round and tool with state, at BENCH_OBJECTS: the
//!    initial sync, then **an outage past the watch history**: the tool frozen (SIGSTOP), its
//!    connections cut by an API server restart, the changes made, etcd compacted and the API
//!    server restarted again, the tool thawed, so that its watch resumes from a version that
//!    is gone (410, looked for in its log); what was delivered, and the consumer's ending.
//!
//! The floor: the API server's own unpaged list of the BENCH_OBJECTS objects (a raw GET, timed
//! to its last byte) plus a raw rdkafka producer with the bridge's settings writing as many
//! pre-encoded CloudEvents.
//!
//! The table (markdown, medians over rounds with the spread) goes to stdout, and a summary to
//! `target/peers/summary.json`: per tool `sync_s`, `peak_rss_mib` (and the bridge's `peak_held`)
//! at `objects`, `sync_large_s`, `peak_rss_large_mib` (`peak_held_large`) at `objects_large`,
//! the steady figures, the failover's, and the floor (`floor_s` at `floor_objects`).
//!
//! `cargo bench --bench peers` (after scripts/build-realk8s and scripts/build-peers; defaults
//! BENCH_OBJECTS=50000, BENCH_OBJECTS_LARGE=200000, BENCH_ROUNDS=3, BENCH_RATE=500,
//! BENCH_STEADY_SECS=30, BENCH_IDLE_SECS=10, BENCH_BURST=10000, BENCH_RESTART_CHANGES=100,
//! BENCH_TOOLS=bridge,collector,client-go, BENCH_PHASES=main,failover,large (and outage),
//! BENCH_SYNC_PATIENCE_SECS=600 (a sync not done by then is reported as not done),
//! BENCH_TIMELINE=1 (also prints how many messages had arrived by each half second of a sync,
//! when the tool was started, and when its first record was made (CreateTime) and received);
//! BENCH_KEEP_LOGS=DIR copies each round's tool logs there (`{phase}-{tool}-r{round}-{file}`);
//! BENCH_BRIDGE_KUBERNETES='{"page_size": 100000}' sets the bridge's `kubernetes` section,
//! BENCH_BRIDGE_SINK='{"kafka": {"linger": "20ms"}}' is merged into its sink, a null removing
//! a key).

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::{BufRead, Seek},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{StreamExt, stream};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::api::{Api, DeleteParams, PostParams};
use rdkafka::{
    ClientConfig, Message as _,
    consumer::{Consumer, StreamConsumer},
    producer::{FutureProducer, FutureRecord},
};
use serde_json::{Value, json};
use support::{
    cluster::{Cluster, ReferenceInformer},
    config::ConfigBuilder,
    event_type,
    kafka::Kafka,
    objects::{configmap_with_data, configmaps, realistic_configmap},
    parity::Rng,
    replica::Replica,
};

const NAMESPACES: u64 = 5;
const WRITERS: u64 = 16;

fn from_env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn namespace(i: u64) -> String {
    format!("peers-{}", i % NAMESPACES)
}

fn name(i: u64) -> String {
    format!("cm-{i:06}")
}

/// ConfigMap `i` (about 1 KB), with `round` in its data.
fn object(i: u64, round: u64) -> ConfigMap {
    let mut data = realistic_configmap(i as usize).data.unwrap();
    data.insert("round".into(), round.to_string());
    configmap_with_data(&namespace(i), &name(i), data)
}

// ---------------------------------------------------------------------------------------
// Measuring from outside

/// Current RSS of `pid`, MiB.
fn rss_mib(pid: u32) -> f64 {
    support::status_mib(pid, "VmRSS:")
}

/// The API server's and etcd's CPU seconds and peak RSS while it runs (RSS every 100 ms), and
/// the Kafka node's CPU seconds.
struct ServerLoad {
    pids: [u32; 2],
    cpu0: [f64; 2],
    kafka: (u32, f64),
    peak: Arc<Mutex<[f64; 2]>>,
    stop: Arc<AtomicBool>,
}

impl ServerLoad {
    fn start(cluster: &Cluster, kafka: &Kafka) -> Self {
        let kafka = kafka.jvm_pid().expect("the Kafka node runs");
        let (etcd, apiserver) = cluster.pids();
        let pids = [apiserver.expect("the API server runs"), etcd];
        let peak = Arc::new(Mutex::new([0.0f64; 2]));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                {
                    let mut peak = p.lock().unwrap();
                    for (k, pid) in pids.iter().enumerate() {
                        peak[k] = peak[k].max(rss_mib(*pid));
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self {
            pids,
            cpu0: pids.map(support::procfs::cpu_seconds),
            kafka: (kafka, support::procfs::cpu_seconds(kafka)),
            peak,
            stop,
        }
    }

    /// (API server CPU s, peak RSS MiB, etcd CPU s, peak RSS MiB, Kafka CPU s).
    fn end(self) -> [f64; 5] {
        self.stop.store(true, Ordering::Relaxed);
        let peak = *self.peak.lock().unwrap();
        let cpu = [0, 1].map(|k| support::procfs::cpu_seconds(self.pids[k]) - self.cpu0[k]);
        let kafka = support::procfs::cpu_seconds(self.kafka.0) - self.kafka.1;
        [cpu[0], peak[0], cpu[1], peak[1], kafka]
    }
}

/// The API server's requests so far (`apiserver_request_total`), by resource and verb.
async fn requests(client: &kube::Client) -> BTreeMap<(String, String), f64> {
    let text = client
        .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
        .await
        .unwrap_or_default();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|l| l.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        *out.entry((label("resource"), label("verb"))).or_default() +=
            value.trim().parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// The requests made between `before` and `after`, as `configmaps LIST 2, WATCH 1; leases …`
/// (the tools' own resources only).
fn requests_between(
    before: &BTreeMap<(String, String), f64>,
    after: &BTreeMap<(String, String), f64>,
) -> String {
    let mut by: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for ((resource, verb), n) in after {
        let d = n - before
            .get(&(resource.clone(), verb.clone()))
            .copied()
            .unwrap_or(0.0);
        if d >= 1.0 && ["configmaps", "leases"].contains(&resource.as_str()) {
            by.entry(resource)
                .or_default()
                .push(format!("{verb} {d:.0}"));
        }
    }
    by.iter()
        .map(|(r, v)| format!("{r}: {}", v.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// One message as a consumer sees it.
#[derive(Debug, Clone)]
struct Arrival {
    at: Instant,
    key: String,
    uid: String,
    rv: String,
    /// The tool's type of the message, lower case (`deleted`, `DELETED` → `deleted`).
    ty: String,
    deleted: bool,
}

fn arrival_of(at: Instant, object: &Value, ty: &str) -> Option<Arrival> {
    let m = &object["metadata"];
    let ty = ty.to_lowercase();
    let deleted = ty == "deleted" || ty == "delete";
    Some(Arrival {
        at,
        key: format!("{}/{}", m["namespace"].as_str()?, m["name"].as_str()?),
        uid: m["uid"].as_str().unwrap_or_default().to_owned(),
        rv: m["resourceVersion"].as_str().unwrap_or_default().to_owned(),
        ty,
        deleted,
    })
}

/// What each tool writes, parsed back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tool {
    Bridge,
    Collector,
    ClientGo,
}

impl Tool {
    fn label(self) -> &'static str {
        match self {
            Tool::Bridge => "kube-event-bridge",
            Tool::Collector => "otelcol v0.145 k8sobjects→kafka",
            Tool::ClientGo => "client-go informer",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Tool::Bridge => "bridge",
            Tool::Collector => "collector",
            Tool::ClientGo => "client-go",
        }
    }

    /// A message value (or a client-go line) as an arrival.
    fn parse(self, at: Instant, value: &Value) -> Option<Arrival> {
        match self {
            // A structured CloudEvent.
            Tool::Bridge => arrival_of(at, &value["data"]["object"], event_type(value)),
            // `raw`: the log body, a watch event {"type", "object"} (the initial state too).
            Tool::Collector => match value["type"].as_str() {
                Some(ty) if value.get("object").is_some() => arrival_of(at, &value["object"], ty),
                _ => arrival_of(at, value, "object"),
            },
            Tool::ClientGo => match value["type"].as_str()? {
                ty @ ("add" | "update" | "delete") => arrival_of(at, &value["object"], ty),
                _ => None,
            },
        }
    }
}

/// Every arrival so far, appended by a background reader.
#[derive(Clone, Default)]
struct Arrivals(Arc<Mutex<Vec<Arrival>>>);

impl Arrivals {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    fn since(&self, from: usize) -> Vec<Arrival> {
        self.0.lock().unwrap()[from..].to_vec()
    }

    /// How many had arrived by each half second after `began` (BENCH_TIMELINE).
    fn timeline(&self, began: Instant) -> String {
        let all = self.0.lock().unwrap();
        let mut counts: Vec<usize> = Vec::new();
        for a in all.iter() {
            let slot = (a.at.duration_since(began).as_secs_f64() / 0.5) as usize;
            if counts.len() <= slot {
                counts.resize(slot + 1, 0);
            }
            counts[slot] += 1;
        }
        counts
            .iter()
            .scan(0, |sum, c| {
                *sum += c;
                Some(*sum)
            })
            .enumerate()
            .map(|(i, sum)| format!("{:.1}s:{sum}", (i + 1) as f64 * 0.5))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn first_at(&self) -> Option<Instant> {
        self.0.lock().unwrap().first().map(|a| a.at)
    }

    /// Reads `topic` from its start until dropped.
    fn consume(tool: Tool, brokers: &str, topic: &str) -> (Self, tokio::task::JoinHandle<()>) {
        let arrivals = Self::default();
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", format!("peers-{topic}"))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "10")
            .create()
            .unwrap();
        let mut assignment = rdkafka::TopicPartitionList::new();
        assignment
            .add_partition_offset(topic, 0, rdkafka::Offset::Beginning)
            .unwrap();
        consumer.assign(&assignment).unwrap();
        let sink = arrivals.clone();
        let mut told = std::env::var_os("BENCH_TIMELINE").is_none();
        let task = tokio::spawn(async move {
            let mut messages = consumer.stream();
            while let Some(Ok(m)) = messages.next().await {
                let at = Instant::now();
                if !told {
                    // When the first record was made (its CreateTime) and when it came.
                    told = true;
                    let made = m.timestamp().to_millis().unwrap_or_default();
                    println!(
                        "  first record: made at {}, received at {}",
                        jiff::Timestamp::from_millisecond(made).unwrap_or_default(),
                        jiff::Timestamp::now()
                    );
                }
                let Some(payload) = m.payload() else { continue };
                if let Ok(value) = serde_json::from_slice::<Value>(payload)
                    && let Some(a) = tool.parse(at, &value)
                {
                    sink.0.lock().unwrap().push(a);
                }
            }
        });
        (arrivals, task)
    }

    /// Follows client-go's output file (polled every 10 ms) until dropped.
    fn follow(path: PathBuf) -> (Self, tokio::task::JoinHandle<()>) {
        let arrivals = Self::default();
        let sink = arrivals.clone();
        let task = tokio::spawn(async move {
            let mut offset = 0u64;
            let mut partial = String::new();
            loop {
                if let Ok(mut f) = std::fs::File::open(&path) {
                    let _ = f.seek(std::io::SeekFrom::Start(offset));
                    let mut reader = std::io::BufReader::new(f);
                    let mut line = String::new();
                    while let Ok(n) = reader.read_line(&mut line) {
                        if n == 0 {
                            break;
                        }
                        offset += n as u64;
                        if !line.ends_with('\n') {
                            partial.push_str(&line);
                            line.clear();
                            continue;
                        }
                        let whole = std::mem::take(&mut partial) + &line;
                        line.clear();
                        if let Ok(v) = serde_json::from_str::<Value>(&whole)
                            && let Some(a) = Tool::ClientGo.parse(Instant::now(), &v)
                        {
                            sink.0.lock().unwrap().push(a);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        (arrivals, task)
    }
}

// ---------------------------------------------------------------------------------------
// The tools

enum Process {
    Bridge(Replica),
    /// The collector and its log file.
    Collector(Child, PathBuf),
    ClientGo(ReferenceInformer),
}

impl Process {
    fn pid(&self) -> u32 {
        match self {
            Process::Bridge(r) => r.child.id(),
            Process::Collector(c, _) => c.id(),
            Process::ClientGo(r) => r.pid(),
        }
    }

    fn log(&self) -> String {
        match self {
            Process::Bridge(r) => r.log(),
            Process::Collector(_, log) => std::fs::read_to_string(log).unwrap_or_default(),
            Process::ClientGo(_) => String::new(),
        }
    }

    /// The identity it holds a Lease as: the bridge's replica name; the collector's elector
    /// UUID, from its "Starting k8s leader elector with UUID" line.
    fn identity(&self) -> Option<String> {
        match self {
            Process::Bridge(r) => Some(r.identity.clone()),
            Process::Collector(..) => self.log().lines().find_map(|l| {
                // Its zap fields come after the message, the resource's
                // `service.instance.id` (another UUID) among them: the one named "UUID".
                let at = l.find("Starting k8s leader elector with UUID")?;
                let rest = &l[at..];
                let at = rest.find("\"UUID\"")?;
                rest[at + 6..]
                    .split(|c: char| !(c.is_ascii_hexdigit() || c == '-'))
                    .find(|w| w.len() == 36 && w.matches('-').count() == 4)
                    .map(str::to_owned)
            }),
            Process::ClientGo(_) => None,
        }
    }

    fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status();
    }

    /// SIGTERM, then waits for the exit (a SIGKILL after 30 s).
    fn stop(&mut self) {
        let pid = self.pid();
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Path::new(&format!("/proc/{pid}/stat")).exists()
            && std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| !s.contains(") Z "))
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        if let Process::Collector(child, _) = self {
            let _ = child.wait();
        }
    }
}

fn collector_binary() -> PathBuf {
    support::built_tool("peers/otelcol-peers", "scripts/build-peers")
}

/// Where a tool runs: its topic, its directory, the proxied kubeconfig, its Lease.
struct Setup {
    dir: PathBuf,
    kubeconfig: PathBuf,
    brokers: String,
    topic: String,
    lease: String,
    exactly_once: bool,
}

/// Merges `changes` into `into`: objects key by key, a null removing the key, anything else
/// replacing what was there.
fn merge(into: &mut Value, changes: Value) {
    match (into, changes) {
        (Value::Object(into), Value::Object(changes)) => {
            for (k, v) in changes {
                if v.is_null() {
                    into.remove(&k);
                } else {
                    merge(into.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        (into, changes) => *into = changes,
    }
}

/// The bridge's peaks of notifications held (`keb_listener_buffered_notifications`: pending or
/// being published) and of publishes awaiting Kafka's acknowledgement (`keb_sink_in_flight`),
/// read from its /metrics every 100 ms once its log gives the admin address.
struct HeldPeaks {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Option<[f64; 2]>>,
}

impl HeldPeaks {
    fn sample(log: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut peaks = None::<[f64; 2]>;
                let mut admin = None;
                while !stop.load(Ordering::Relaxed) {
                    if admin.is_none() {
                        let log = std::fs::read_to_string(&log).unwrap_or_default();
                        admin = support::replica::admin_in(&log);
                    }
                    if let Some(addr) = admin {
                        let (code, m) = support::http_get(addr, "/metrics").await;
                        if code != 200 {
                            // Not read: no peak from this sample.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                        let held = support::metric_in(&m, "keb_listener_buffered_notifications");
                        let awaiting = support::metric_in(&m, "keb_sink_in_flight");
                        let [h, a] = peaks.unwrap_or_default();
                        peaks = Some([h.max(held), a.max(awaiting)]);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                peaks
            }
        });
        Self { stop, task }
    }

    /// The peaks; `None` if the bridge was never read (no admin address logged, or its
    /// /metrics not answering: the sampler failed), not a peak of 0.
    async fn end(self) -> Option<[f64; 2]> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.ok().flatten()
    }
}

/// Starts `tool` as `name`; `elect`: the bridge with leader election (the collector always
/// runs its elector, as configured for production).
fn start(tool: Tool, s: &Setup, name: &str, elect: bool) -> Process {
    match tool {
        Tool::Bridge => {
            // BENCH_BRIDGE_KUBERNETES: JSON for the `kubernetes` section, to try list settings
            // (`{"page_size": 100000}`, `{"streaming_list": true}`).
            let kubernetes: Value = std::env::var("BENCH_BRIDGE_KUBERNETES")
                .ok()
                .map(|j| serde_json::from_str(&j).expect("BENCH_BRIDGE_KUBERNETES is JSON"))
                .unwrap_or_else(|| json!({}));
            let mut sink = json!({
                "name": "kafka", "type": "kafka",
                "kafka": {"brokers": [s.brokers], "topic": s.topic,
                          "checkpoint_topic": format!("{}.checkpoints", s.topic),
                          "exactly_once": s.exactly_once},
            });
            // BENCH_BRIDGE_SINK: JSON merged into the sink, objects key by key and a null
            // removing a key (`{"kafka": {"linger": "20ms"}}`, `{"resume": false}`).
            if let Ok(j) = std::env::var("BENCH_BRIDGE_SINK") {
                merge(
                    &mut sink,
                    serde_json::from_str(&j).expect("BENCH_BRIDGE_SINK is JSON"),
                );
            }
            let config = ConfigBuilder::new()
                .kubernetes(kubernetes)
                .resource(json!({"api_version": "v1", "kind": "ConfigMap"}))
                .sink(sink)
                .route("configmap", &["kafka"]);
            let config = if elect {
                config.leader_election(name).set(
                    "leader_election",
                    json!({"enabled": true, "identity": name, "namespace": "kube-system",
                           "lease_name": s.lease}),
                )
            } else {
                config
            };
            Process::Bridge(Replica::start(&s.dir, name, &config.value(), &s.kubeconfig))
        }
        Tool::Collector => {
            let template = std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/peers/collector.yaml"),
            )
            .unwrap();
            let config = template
                .replace("${BROKERS}", &s.brokers)
                .replace("${TOPIC}", &s.topic)
                .replace("${LEASE}", &s.lease);
            let path = s.dir.join(format!("otelcol-{name}.yaml"));
            std::fs::write(&path, config).unwrap();
            let log = s.dir.join(format!("otelcol-{name}.log"));
            let child = Command::new(collector_binary())
                .arg("--config")
                .arg(&path)
                .env("KUBECONFIG", &s.kubeconfig)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("the collector starts");
            Process::Collector(child, log)
        }
        Tool::ClientGo => Process::ClientGo(ReferenceInformer::start(
            &s.kubeconfig,
            &s.dir,
            ("", "v1", "configmaps"),
            None,
        )),
    }
}

// ---------------------------------------------------------------------------------------
// The workload

/// What the API server holds now, in every namespace (what each tool watches; kube-system's
/// ConfigMaps included): key → (uid, resourceVersion).
async fn live(cluster: &Cluster) -> BTreeMap<String, (String, String)> {
    cluster.objects(&configmaps(), None).await
}

/// One write: its key, the resourceVersion it made (deletes: none), and when it was
/// acknowledged.
struct Write {
    key: String,
    rv: Option<String>,
    acked: Instant,
}

/// Object states the writers share: which exist.
struct World {
    exists: Mutex<Vec<bool>>,
    round: AtomicU64,
}

/// Writes for `secs` seconds at `rate` per second (`None`: as fast as they go) from
/// [`WRITERS`] writers (writer w owns the objects i ≡ w mod WRITERS, of the first `n`): 80%
/// updates, 10% deletes, 10% creates (of deleted ones); `updates_only`: `count` updates.
async fn write(
    api_of: &dyn Fn(&str) -> Api<ConfigMap>,
    world: &World,
    rate: Option<u64>,
    secs: u64,
    updates_only: Option<u64>,
    seed: u64,
) -> Vec<Write> {
    let n = world.exists.lock().unwrap().len() as u64;
    let writers = if updates_only.is_some() { 64 } else { WRITERS };
    let interval = rate.map(|r| Duration::from_secs_f64(writers as f64 / r as f64));
    let writes = Mutex::new(Vec::new());
    let began = Instant::now();
    stream::iter(0..writers)
        .for_each_concurrent(writers as usize, |w| {
            let writes = &writes;
            async move {
                let mut rng = Rng(seed ^ (w + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let mut tick = interval.map(|i| {
                    let mut t = tokio::time::interval(i);
                    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    t
                });
                let mut done = 0u64;
                loop {
                    match updates_only {
                        Some(count) if done >= count / writers => break,
                        None if began.elapsed() >= Duration::from_secs(secs) => break,
                        _ => {}
                    }
                    done += 1;
                    if let Some(t) = tick.as_mut() {
                        t.tick().await;
                    }
                    let i = w + writers * rng.below(n / writers);
                    let round = world.round.fetch_add(1, Ordering::Relaxed);
                    let api = api_of(&namespace(i));
                    let exists = world.exists.lock().unwrap()[i as usize];
                    if updates_only.is_some() && !exists {
                        continue;
                    }
                    let dice = rng.below(10);
                    let key = format!("{}/{}", namespace(i), name(i));
                    // Only what the API server accepted is a write (none should fail: each
                    // writer owns its objects, and World follows every change).
                    let rv = if !exists {
                        let made = api.create(&PostParams::default(), &object(i, round)).await;
                        world.exists.lock().unwrap()[i as usize] = true;
                        made.map(|o| o.metadata.resource_version)
                    } else if dice == 0 && updates_only.is_none() {
                        let gone = api.delete(&name(i), &DeleteParams::default()).await;
                        world.exists.lock().unwrap()[i as usize] = false;
                        gone.map(|_| None)
                    } else {
                        let made = api
                            .replace(&name(i), &PostParams::default(), &object(i, round))
                            .await;
                        made.map(|o| o.metadata.resource_version)
                    };
                    match rv {
                        Ok(rv) => writes.lock().unwrap().push(Write {
                            key,
                            rv,
                            acked: Instant::now(),
                        }),
                        Err(e) => eprintln!("write of {key} refused: {e}"),
                    }
                }
            }
        })
        .await;
    writes.into_inner().unwrap()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Lags (ms) from each write's acknowledgement to the first arrival of what it made (a
/// delete: the first delete of the key after the write was sent), and the writes never seen.
fn lags(writes: &[Write], arrivals: &[Arrival]) -> (Vec<f64>, Vec<String>) {
    let mut by_state: HashMap<(&str, &str), Instant> = HashMap::new();
    let mut deletes: HashMap<&str, Vec<Instant>> = HashMap::new();
    for a in arrivals {
        if a.deleted {
            deletes.entry(&a.key).or_default().push(a.at);
        } else {
            by_state.entry((&a.key, &a.rv)).or_insert(a.at);
        }
    }
    let (mut out, mut unseen) = (Vec::new(), Vec::new());
    for w in writes {
        let seen = match &w.rv {
            Some(rv) => by_state.get(&(w.key.as_str(), rv.as_str())).copied(),
            // A delete's arrival may precede its acknowledgement: count it from the ack, at 0.
            None => deletes.get(w.key.as_str()).and_then(|ts| {
                ts.iter()
                    .copied()
                    .find(|t| *t + Duration::from_secs(5) >= w.acked)
            }),
        };
        match seen {
            Some(t) => out.push(t.saturating_duration_since(w.acked).as_secs_f64() * 1000.0),
            None => unseen.push(match &w.rv {
                Some(rv) => format!("{}@{rv}", w.key),
                None => format!("{} deleted", w.key),
            }),
        }
    }
    out.sort_by(f64::total_cmp);
    (out, unseen)
}

/// What a consumer ends with: the stream folded by order per key against the API server,
/// and the stream's duplicates (a repeated key, resourceVersion and type) and per-object
/// order violations (a message of an incarnation older in resourceVersion than one before).
struct Ending {
    d: support::Differences,
    duplicates: usize,
    out_of_order: usize,
}

fn ending(arrivals: &[Arrival], live: &BTreeMap<String, (String, String)>) -> Ending {
    let mut folded = BTreeMap::new();
    let mut seen = HashSet::new();
    let mut newest: HashMap<(&str, &str), u64> = HashMap::new();
    let (mut duplicates, mut out_of_order) = (0, 0);
    for a in arrivals {
        folded.insert(
            a.key.clone(),
            (!a.deleted).then(|| (a.uid.clone(), a.rv.clone())),
        );
        if !seen.insert((a.key.as_str(), a.rv.as_str(), a.ty.as_str())) {
            duplicates += 1;
        }
        let rv: u64 = a.rv.parse().unwrap_or(0);
        let last = newest.entry((&a.key, &a.uid)).or_default();
        if rv < *last {
            out_of_order += 1;
        }
        *last = (*last).max(rv);
    }
    Ending {
        d: support::differences(&folded, live),
        duplicates,
        out_of_order,
    }
}

/// Waits until `done` holds or `patience` passes; returns the time it took.
async fn until(patience: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let began = Instant::now();
    while began.elapsed() < patience {
        if done() {
            return Some(began.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Waits until `done` holds for what arrived from `from` on, or until something arrived and
/// then nothing new for `quiet` (a tool that never delivers some changes), at most
/// `patience`.
async fn settle(
    arrivals: &Arrivals,
    from: usize,
    quiet: Duration,
    patience: Duration,
    mut done: impl FnMut(&[Arrival]) -> bool,
) {
    let began = Instant::now();
    let (mut last, mut since) = (arrivals.len(), Instant::now());
    while began.elapsed() < patience {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = arrivals.len();
        if now != last {
            (last, since) = (now, Instant::now());
            if done(&arrivals.since(from)) {
                return;
            }
        } else if now > from && since.elapsed() >= quiet {
            return;
        }
    }
}

/// Waits until nothing new has arrived for `quiet` (at most `patience`).
async fn quiet(arrivals: &Arrivals, quiet: Duration, patience: Duration) {
    let began = Instant::now();
    let (mut last, mut since) = (arrivals.len(), Instant::now());
    while began.elapsed() < patience {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = arrivals.len();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= quiet {
            return;
        }
    }
}

/// Changes made while a tool is down (or nobody leads): deletes, updates and creates, and
/// what the API server held after them.
struct Changes {
    deleted: Vec<String>,
    updated: Vec<String>,
    created: Vec<String>,
    after: BTreeMap<String, (String, String)>,
}

impl Changes {
    /// `count` deletes, updates (of other objects) and creates; `salt` tells runs apart.
    async fn make(
        cluster: &Cluster,
        api_of: &dyn Fn(&str) -> Api<ConfigMap>,
        world: &World,
        salt: u64,
        count: u64,
    ) -> Self {
        let before = live(cluster).await;
        let keys: Vec<&String> = before.keys().filter(|k| k.starts_with("peers-")).collect();
        let pick = |k: u64| keys[((k + salt * 31) as usize * 7919) % keys.len()].clone();
        let mut deleted = Vec::new();
        let mut updated = Vec::new();
        for k in 0..count * 2 {
            let key = pick(k);
            let (ns, nm) = key.split_once('/').unwrap();
            let api = api_of(ns);
            let i: u64 = nm.trim_start_matches("cm-").parse().unwrap();
            if k % 2 == 0 && !deleted.contains(&key) && !updated.contains(&key) {
                api.delete(nm, &DeleteParams::default()).await.unwrap();
                if let Some(e) = world.exists.lock().unwrap().get_mut(i as usize) {
                    *e = false;
                }
                deleted.push(key);
            } else if !deleted.contains(&key) && !updated.contains(&key) {
                api.replace(nm, &PostParams::default(), &object(i, 1_000_000 + k))
                    .await
                    .unwrap();
                updated.push(key);
            }
        }
        let mut created = Vec::new();
        for k in 0..count {
            let i = 10_000_000 + salt * 1_000 + k;
            let api = api_of(&namespace(i));
            api.create(&PostParams::default(), &object(i, 0))
                .await
                .unwrap();
            created.push(format!("{}/{}", namespace(i), name(i)));
        }
        let after = live(cluster).await;
        Self {
            deleted,
            updated,
            created,
            after,
        }
    }

    fn len(&self) -> usize {
        self.deleted.len() + self.updated.len() + self.created.len()
    }

    /// Whether every change was delivered in `got`.
    fn all_in(&self, got: &[Arrival]) -> bool {
        let d = self.delivered(got);
        d.deletes.0 + d.updates.0 + d.creates.0 >= self.len()
    }

    /// Whether `a` reflects one of these changes (a delete of a deleted key, the final state
    /// of an updated or created one).
    fn reflects(&self, a: &Arrival) -> bool {
        if a.deleted {
            return self.deleted.contains(&a.key);
        }
        (self.updated.contains(&a.key) || self.created.contains(&a.key))
            && self.after.get(&a.key).is_some_and(|s| s.1 == a.rv)
    }

    /// Of `got`: deletes, updates (to the final state) and creates delivered, and messages for
    /// objects not changed.
    fn delivered(&self, got: &[Arrival]) -> Delivered {
        let mut states: HashMap<&str, (bool, bool, HashSet<&str>)> = HashMap::new();
        for a in got {
            let s = states.entry(&a.key).or_default();
            if a.deleted {
                s.0 = true;
            } else {
                s.1 = true;
                s.2.insert(&a.rv);
            }
        }
        let has = |key: &String, deleted: bool| {
            states
                .get(key.as_str())
                .is_some_and(|s| if deleted { s.0 } else { s.1 })
        };
        let deletes = self.deleted.iter().filter(|k| has(k, true)).count();
        let updates = self
            .updated
            .iter()
            .filter(|k| {
                let want = self.after.get(*k).map(|s| s.1.as_str());
                states
                    .get(k.as_str())
                    .is_some_and(|s| want.is_some_and(|rv| s.2.contains(rv)))
            })
            .count();
        let creates = self.created.iter().filter(|k| has(k, false)).count();
        let touched: HashSet<&String> = self
            .deleted
            .iter()
            .chain(&self.updated)
            .chain(&self.created)
            .collect();
        let resent = got.iter().filter(|a| !touched.contains(&a.key)).count();
        Delivered {
            deletes: (deletes, self.deleted.len()),
            updates: (updates, self.updated.len()),
            creates: (creates, self.created.len()),
            resent,
        }
    }
}

/// Changes delivered (got, made) and messages for unchanged objects.
#[derive(Clone, Copy, Default)]
struct Delivered {
    deletes: (usize, usize),
    updates: (usize, usize),
    creates: (usize, usize),
    resent: usize,
}

impl std::fmt::Display for Delivered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}, {}/{}, {}/{}, {}",
            self.deletes.0,
            self.deletes.1,
            self.updates.0,
            self.updates.1,
            self.creates.0,
            self.creates.1,
            self.resent
        )
    }
}

// ---------------------------------------------------------------------------------------
// Phases

/// An initial sync as measured.
#[derive(Default, Clone)]
struct Sync {
    first: Option<f64>,
    last: Option<f64>,
    cpu: f64,
    rss: f64,
    read_mib: f64,
    /// The bridge's peaks of notifications held (pending or being published) and of
    /// publishes awaiting Kafka's acknowledgement, from its /metrics every 100 ms.
    held: Option<[f64; 2]>,
    /// The API server's CPU s and peak RSS MiB, etcd's, and the Kafka node's CPU s (it
    /// serves the bench's consumer too, the same for every tool).
    server: [f64; 5],
    requests: String,
}

/// One rate of the steady phase.
#[derive(Clone, Copy, Default)]
struct Steady {
    achieved: f64,
    p50: f64,
    p99: f64,
    max: f64,
    cpu_ms: f64,
    stored_per_change: f64,
    per_change: f64,
    unseen: usize,
}

/// What one round of one tool measured at BENCH_OBJECTS.
#[derive(Default)]
struct Run {
    sync: Sync,
    /// CPU ms per second while nothing changes (BENCH_IDLE_SECS after the sync): what a
    /// tool spends on its own timers, which the steady phase's CPU per change includes.
    idle_cpu_ms_per_s: Option<f64>,
    /// At BENCH_RATE, and as fast as the writers go.
    steady: [Option<Steady>; 2],
    /// Seconds to write the burst, and until its last update arrived.
    burst: Option<(f64, Option<f64>)>,
    restart_short: Option<(Delivered, bool)>,
    restart_long: Option<(Delivered, bool)>,
    ending: Option<Ending>,
    peak_rss: f64,
}

/// A failover as measured.
#[derive(Default)]
struct Failover {
    lease: Option<f64>,
    first_change: Option<f64>,
    delivered: Delivered,
    ending: Option<Ending>,
}

/// What the phases share.
struct Bench {
    cluster: Cluster,
    kafka: Kafka,
    proxy: support::loopback::CountingProxy,
    kubeconfig: PathBuf,
    client: kube::Client,
    world: World,
    rate: u64,
    steady_secs: u64,
    idle_secs: u64,
    burst: u64,
    restart_changes: u64,
    seed: u64,
}

impl Bench {
    fn api_of(&self) -> impl Fn(&str) -> Api<ConfigMap> + use<> {
        let client = self.client.clone();
        move |ns: &str| Api::<ConfigMap>::namespaced(client.clone(), ns)
    }

    fn setup(&self, dir: &Path, topic: String, lease: String, eos: bool) -> Setup {
        if !topic.is_empty() {
            self.kafka.create_topic(&topic, 1);
        }
        Setup {
            dir: dir.to_owned(),
            kubeconfig: self.kubeconfig.clone(),
            brokers: self.kafka.brokers(),
            topic,
            lease,
            exactly_once: eos,
        }
    }

    /// Starts `tool` and measures its initial sync of what the API server holds.
    async fn sync(
        &self,
        tool: Tool,
        setup: &Setup,
    ) -> (Process, Arrivals, tokio::task::JoinHandle<()>, Sync) {
        let n = live(&self.cluster).await.len();
        let (arrivals, reader) = match tool {
            Tool::ClientGo => Arrivals::follow(setup.dir.join("client-go-configmaps.jsonl")),
            _ => {
                // The consumer connected and fetching before the tool starts: its own start
                // (about 0.3 s) is not the tool's.
                let consuming = Arrivals::consume(tool, &setup.brokers, &setup.topic);
                tokio::time::sleep(Duration::from_secs(1)).await;
                consuming
            }
        };
        let before = requests(&self.client).await;
        let load = ServerLoad::start(&self.cluster, &self.kafka);
        let bytes0 = self.proxy.bytes();
        let (began, spawned) = (Instant::now(), jiff::Timestamp::now());
        let process = start(tool, setup, tool.key(), false);
        let held = match &process {
            Process::Bridge(r) => Some(HeldPeaks::sample(r.log_path().to_owned())),
            _ => None,
        };
        let synced_line = setup.dir.join("client-go-configmaps.jsonl");
        let patience = Duration::from_secs(from_env("BENCH_SYNC_PATIENCE_SECS", 600));
        let last = until(patience, || match tool {
            Tool::ClientGo => std::fs::read(&synced_line)
                .is_ok_and(|b| b.windows(15).any(|w| w == b"\"type\":\"synced\"")),
            _ => arrivals.len() >= n,
        })
        .await;
        let server = load.end();
        let held = match held {
            Some(h) => h.end().await,
            None => None,
        };
        let after = requests(&self.client).await;
        if std::env::var_os("BENCH_TIMELINE").is_some() {
            println!(
                "  timeline (started at {spawned}): {}",
                arrivals.timeline(began)
            );
        }
        let sync = Sync {
            first: arrivals
                .first_at()
                .map(|t| t.duration_since(began).as_secs_f64()),
            last: last.map(|d| d.as_secs_f64()),
            cpu: support::procfs::cpu_seconds(process.pid()),
            rss: support::peak_rss_mib(process.pid()),
            read_mib: (self.proxy.bytes() - bytes0) as f64 / 1048576.0,
            held,
            server,
            requests: requests_between(&before, &after),
        };
        println!(
            "  [{}] initial sync of {n}: first {:?} s, last {:?} s, CPU {:.1} s, peak RSS {:.0} MiB, peak held {}, read {:.1} MiB; kube-apiserver {:.1} s CPU, {:.0} MiB; etcd {:.1} s CPU, {:.0} MiB; Kafka {:.1} s CPU; requests {}",
            tool.label(),
            sync.first,
            sync.last,
            sync.cpu,
            sync.rss,
            sync.held.map_or("–".into(), |[h, f]| format!(
                "{h:.0} notifications, {f:.0} awaiting Kafka"
            )),
            sync.read_mib,
            server[0],
            server[1],
            server[2],
            server[3],
            server[4],
            sync.requests
        );
        (process, arrivals, reader, sync)
    }

    /// One round of `tool` at BENCH_OBJECTS: sync, steady, burst, restart, ending; or
    /// (`outage_only`) sync, the outage past the watch history, ending.
    async fn run(&mut self, tool: Tool, round: u64, outage_only: bool) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let topic = if tool == Tool::ClientGo {
            String::new()
        } else {
            format!("peers.{}.r{round}", tool.key())
        };
        let lease = format!("peers-{}-r{round}", tool.key());
        let setup = self.setup(dir.path(), topic, lease, false);
        let api_of = self.api_of();
        let mut run = Run::default();
        let (mut process, arrivals, reader, sync) = self.sync(tool, &setup).await;
        run.sync = sync;
        if run.sync.last.is_none() {
            println!(
                "  [{}] did not sync; see {}",
                tool.label(),
                dir.path().display()
            );
            std::mem::forget(dir);
            return run;
        }
        quiet(&arrivals, Duration::from_secs(2), Duration::from_secs(60)).await;

        // Nothing changes: what the tool spends on its own.
        if !outage_only && self.idle_secs > 0 {
            let cpu0 = support::procfs::cpu_seconds(process.pid());
            tokio::time::sleep(Duration::from_secs(self.idle_secs)).await;
            let ms = (support::procfs::cpu_seconds(process.pid()) - cpu0) * 1000.0
                / self.idle_secs as f64;
            println!(
                "  [{}] idle for {} s: CPU {ms:.1} ms/s",
                tool.label(),
                self.idle_secs
            );
            run.idle_cpu_ms_per_s = Some(ms);
        }

        // Steady changes: at the rate asked, then as fast as the writers go.
        let rates: &[Option<u64>] = if outage_only {
            &[]
        } else {
            &[Some(self.rate), None]
        };
        for (k, &rate) in rates.iter().enumerate() {
            let (cpu0, from) = (support::procfs::cpu_seconds(process.pid()), arrivals.len());
            let stored0 = self.kafka.stored_bytes(&setup.topic, 0);
            let began = Instant::now();
            let seed = self.seed ^ round ^ k as u64;
            let writes = write(&api_of, &self.world, rate, self.steady_secs, None, seed).await;
            let took = began.elapsed();
            quiet(&arrivals, Duration::from_secs(3), Duration::from_secs(120)).await;
            let got = arrivals.since(from);
            let (l, unseen) = lags(&writes, &got);
            if !unseen.is_empty() {
                println!("    never seen, e.g. {:?}", &unseen[..unseen.len().min(4)]);
            }
            let w = writes.len().max(1) as f64;
            let s = Steady {
                achieved: writes.len() as f64 / took.as_secs_f64(),
                p50: percentile(&l, 0.5),
                p99: percentile(&l, 0.99),
                max: l.last().copied().unwrap_or(f64::NAN),
                cpu_ms: (support::procfs::cpu_seconds(process.pid()) - cpu0) * 1000.0 / w,
                stored_per_change: (self.kafka.stored_bytes(&setup.topic, 0) - stored0) as f64 / w,
                per_change: got.len() as f64 / w,
                unseen: unseen.len(),
            };
            println!(
                "  [{}] {} asked, {:.0}/s achieved: lag p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms, {} writes never seen, CPU {:.2} ms/change, {:.0} bytes stored/change, {:.2} messages/change",
                tool.label(),
                rate.map_or("as fast as the writers go".into(), |r| format!("{r}/s")),
                s.achieved,
                s.p50,
                s.p99,
                s.max,
                s.unseen,
                s.cpu_ms,
                s.stored_per_change,
                s.per_change
            );
            run.steady[k] = Some(s);
        }

        // A burst of updates.
        if !outage_only {
            let from = arrivals.len();
            let began = Instant::now();
            let writes = write(
                &api_of,
                &self.world,
                None,
                0,
                Some(self.burst),
                self.seed ^ 0xb0 ^ round,
            )
            .await;
            let written = began.elapsed().as_secs_f64();
            let wanted: HashSet<(String, String)> = writes
                .iter()
                .filter_map(|w| Some((w.key.clone(), w.rv.clone()?)))
                .collect();
            let mut seen = HashSet::new();
            let mut checked = from;
            let last = until(Duration::from_secs(300), || {
                for a in arrivals.since(checked) {
                    checked += 1;
                    if wanted.contains(&(a.key.clone(), a.rv.clone())) {
                        seen.insert((a.key, a.rv));
                    }
                }
                seen.len() >= wanted.len()
            })
            .await
            .map(|_| began.elapsed().as_secs_f64());
            println!(
                "  [{}] burst of {} updates: written in {written:.1} s, the last in Kafka after {last:?} s",
                tool.label(),
                wanted.len()
            );
            run.burst = Some((written, last));
            quiet(&arrivals, Duration::from_secs(2), Duration::from_secs(60)).await;
        }
        run.peak_rss = support::peak_rss_mib(process.pid());

        // Down 10 s (a restart inside the watch history), and (BENCH_PHASES=outage) down past
        // the watch history: frozen (SIGSTOP), its connections cut by an API server restart
        // before the changes are made (so that none of them waits in its sockets), then etcd
        // compacted and the API server restarted again, then thawed: its watch resumes from
        // a version that is gone (410). client-go has no state to resume from: it is not
        // restarted.
        let outages: &[bool] = if outage_only { &[true] } else { &[false] };
        if tool != Tool::ClientGo {
            for (k, &long) in outages.iter().enumerate() {
                let k = k + usize::from(long);
                run.peak_rss = run.peak_rss.max(support::peak_rss_mib(process.pid()));
                let log_before = process.log().len();
                if long {
                    process.signal("STOP");
                    self.cluster.kill_apiserver();
                    self.cluster.start_apiserver().await;
                } else {
                    process.stop();
                }
                let down = Instant::now();
                let changes = Changes::make(
                    &self.cluster,
                    &api_of,
                    &self.world,
                    round * 10 + k as u64 + tool as u64 * 100,
                    self.restart_changes,
                )
                .await;
                if long {
                    self.cluster.etcd_compact();
                    self.cluster.kill_apiserver();
                    self.cluster.start_apiserver().await;
                }
                if let Some(left) = Duration::from_secs(10).checked_sub(down.elapsed()) {
                    tokio::time::sleep(left).await;
                }
                let from = arrivals.len();
                if long {
                    process.signal("CONT");
                } else {
                    process = start(tool, &setup, tool.key(), false);
                }
                settle(
                    &arrivals,
                    from,
                    Duration::from_secs(10),
                    Duration::from_secs(300),
                    |got| changes.all_in(got),
                )
                .await;
                quiet(&arrivals, Duration::from_secs(5), Duration::from_secs(300)).await;
                let delivered = changes.delivered(&arrivals.since(from));
                let log = process.log();
                let log = if long {
                    log.get(log_before..).unwrap_or(&log)
                } else {
                    &log
                };
                let gone = ["410", "too old", "Gone", "Expired", "expired"]
                    .iter()
                    .any(|w| log.contains(w));
                let alive = std::fs::read_to_string(format!("/proc/{}/stat", process.pid()))
                    .is_ok_and(|s| !s.contains(") Z "));
                println!(
                    "  [{}] {}: deletes / updates / creates delivered, unchanged resent: {delivered}; a 410 in its log: {gone}; still running: {alive}",
                    tool.label(),
                    if long {
                        "frozen past the watch history (etcd compacted, the API server restarted)"
                    } else {
                        "restarted, down 10 s"
                    }
                );
                if long {
                    let said: Vec<&str> = log
                        .lines()
                        .filter(|l| {
                            ["410", "atch", "ist", "Gone", "xpired", "too old"]
                                .iter()
                                .any(|w| l.contains(w))
                        })
                        .take(3)
                        .collect();
                    println!("    after the thaw it logged: {said:?}");
                }
                if !alive {
                    let tail: Vec<&str> = log.lines().rev().take(15).collect();
                    println!(
                        "    its log ends: {:?}",
                        tail.into_iter().rev().collect::<Vec<_>>()
                    );
                }
                if long {
                    run.restart_long = Some((delivered, gone));
                } else {
                    run.restart_short = Some((delivered, gone));
                }
                if !alive {
                    // Started again for what follows (the consumer's ending counts what it
                    // sends then).
                    process = start(tool, &setup, tool.key(), false);
                    let from = arrivals.len();
                    settle(
                        &arrivals,
                        from,
                        Duration::from_secs(10),
                        Duration::from_secs(300),
                        |_| false,
                    )
                    .await;
                }
            }
        }

        // What a consumer ends with.
        quiet(&arrivals, Duration::from_secs(3), Duration::from_secs(60)).await;
        let e = ending(&arrivals.since(0), &live(&self.cluster).await);
        print_ending(tool.label(), &e, &arrivals.since(0));
        run.ending = Some(e);
        run.peak_rss = run.peak_rss.max(support::peak_rss_mib(process.pid()));
        process.stop();
        reader.abort();
        keep_logs(dir.path(), &format!("main-{}-r{round}", tool.key()));
        run
    }

    /// A failover of `tool` (`eos`: the bridge with `exactly_once`).
    async fn failover(&self, tool: Tool, eos: bool, round: u64) -> Failover {
        let dir = tempfile::tempdir().unwrap();
        let key = format!("{}{}", tool.key(), if eos { "-eos" } else { "" });
        let setup = self.setup(
            dir.path(),
            format!("peers.failover.{key}.r{round}"),
            format!("peers-failover-{key}-r{round}"),
            eos,
        );
        let api_of = self.api_of();
        let n = live(&self.cluster).await.len();
        let (arrivals, reader) = Arrivals::consume(tool, &setup.brokers, &setup.topic);
        let mut replicas = [
            start(tool, &setup, "replica-a", true),
            start(tool, &setup, "replica-b", true),
        ];
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), "kube-system");
        let holder = async || {
            leases
                .get_opt(&setup.lease)
                .await
                .ok()
                .flatten()
                .and_then(|l| l.spec?.holder_identity)
        };
        until(Duration::from_secs(300), || arrivals.len() >= n).await;
        quiet(&arrivals, Duration::from_secs(5), Duration::from_secs(120)).await;
        let leader = holder().await.expect("a leader");
        let ids: Vec<Option<String>> = replicas.iter().map(Process::identity).collect();
        let Some(k) = ids.iter().position(|id| id.as_deref() == Some(&leader)) else {
            panic!("no replica is the holder {leader}: {ids:?}");
        };
        let survivor = ids[1 - k].clone().expect("the survivor's identity");
        let from = arrivals.len();
        let killed = Instant::now();
        replicas[k].signal("KILL");
        let changes = Changes::make(
            &self.cluster,
            &api_of,
            &self.world,
            1000 + round * 10 + u64::from(eos) + tool as u64 * 100,
            self.restart_changes,
        )
        .await;
        let mut lease = None;
        while lease.is_none() && killed.elapsed() < Duration::from_secs(300) {
            if holder().await.as_deref() == Some(survivor.as_str()) {
                lease = Some(killed.elapsed().as_secs_f64());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        settle(
            &arrivals,
            from,
            Duration::from_secs(10),
            Duration::from_secs(300),
            |got| changes.all_in(got),
        )
        .await;
        quiet(&arrivals, Duration::from_secs(5), Duration::from_secs(300)).await;
        let first_change = arrivals
            .since(from)
            .iter()
            .find(|a| changes.reflects(a))
            .map(|a| a.at.duration_since(killed).as_secs_f64());
        let delivered = changes.delivered(&arrivals.since(from));
        let e = ending(&arrivals.since(0), &live(&self.cluster).await);
        let label = format!("{}{}", tool.label(), if eos { " exactly_once" } else { "" });
        println!(
            "  [{label}] failover: the Lease taken {lease:?} s and the first change in Kafka {first_change:?} s after the leader's SIGKILL; deletes / updates / creates delivered, unchanged resent: {delivered}; {} duplicates",
            e.duplicates
        );
        print_ending(&label, &e, &arrivals.since(0));
        for p in &mut replicas {
            p.stop();
        }
        reader.abort();
        Failover {
            lease,
            first_change,
            delivered,
            ending: Some(e),
        }
    }

    /// A sync alone (BENCH_OBJECTS_LARGE).
    async fn sync_alone(&self, tool: Tool, round: u64) -> Sync {
        let dir = tempfile::tempdir().unwrap();
        let topic = if tool == Tool::ClientGo {
            String::new()
        } else {
            format!("peers.large.{}.r{round}", tool.key())
        };
        let setup = self.setup(
            dir.path(),
            topic,
            format!("peers-large-{}-r{round}", tool.key()),
            false,
        );
        let (mut process, _arrivals, reader, sync) = self.sync(tool, &setup).await;
        process.stop();
        reader.abort();
        keep_logs(dir.path(), &format!("large-{}-r{round}", tool.key()));
        sync
    }
}

/// Copies the `*.log` files of a round's directory into BENCH_KEEP_LOGS (a directory), named
/// `{tag}-{file}`, when it is set.
fn keep_logs(dir: &Path, tag: &str) {
    let Some(to) = std::env::var_os("BENCH_KEEP_LOGS").map(PathBuf::from) else {
        return;
    };
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".log") {
            std::fs::copy(entry.path(), to.join(format!("{tag}-{name}"))).unwrap();
        }
    }
}

fn print_ending(label: &str, e: &Ending, all: &[Arrival]) {
    println!(
        "  [{label}] a consumer ends with: {} lost deletes, {} phantom deletes, {} stale, {} missing; {} duplicates, {} order violations",
        e.d.lost_deletes.len(),
        e.d.phantom_deletes.len(),
        e.d.stale.len(),
        e.d.missing.len(),
        e.duplicates,
        e.out_of_order
    );
    for key in
        e.d.lost_deletes
            .iter()
            .chain(&e.d.phantom_deletes)
            .chain(&e.d.stale)
            .take(4)
    {
        let history: Vec<String> = all
            .iter()
            .filter(|a| &a.key == key)
            .map(|a| format!("{}@{}", a.ty, a.rv))
            .collect();
        println!("    {key}: {history:?}");
    }
}

/// The floor: the API server's unpaged list (to its last byte) plus a raw producer with the
/// bridge's settings writing as many pre-encoded CloudEvents. Seconds: (list, produce).
async fn floor(bench: &Bench) -> (f64, f64) {
    let began = Instant::now();
    let text = bench
        .client
        .request_text(
            http::Request::get("/api/v1/configmaps")
                .body(Vec::new())
                .unwrap(),
        )
        .await
        .unwrap();
    let list = began.elapsed().as_secs_f64();
    let items: Value = serde_json::from_str(&text).unwrap();
    let events: Vec<(String, String)> = items["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            let m = &o["metadata"];
            let key = format!(
                "{}/{}",
                m["namespace"].as_str().unwrap_or_default(),
                m["name"].as_str().unwrap_or_default()
            );
            let event = json!({
                "specversion": "1.0", "id": format!("{}:{}", m["uid"], m["resourceVersion"]),
                "source": "/clusters/peers", "type": "io.k8s.v1.configmap.added",
                "subject": key, "datacontenttype": "application/json",
                "data": {"object": o},
            });
            (key, event.to_string())
        })
        .collect();
    let topic = "peers.floor";
    bench.kafka.create_topic(topic, 1);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bench.kafka.brokers())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("compression.type", "lz4")
        .set("linger.ms", "5")
        .create()
        .unwrap();
    let began = Instant::now();
    let deliveries: Vec<_> = events
        .iter()
        .map(|(key, value)| {
            loop {
                match producer.send_result(FutureRecord::to(topic).key(key).payload(value)) {
                    Ok(d) => break d,
                    Err((_, _)) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        })
        .collect();
    for d in deliveries {
        d.await.unwrap().unwrap();
    }
    (list, began.elapsed().as_secs_f64())
}

// ---------------------------------------------------------------------------------------
// The table

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The median with the spread over rounds: `7.1 (6.8–7.5)`.
fn spread(v: Vec<f64>, digits: usize) -> String {
    let finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if finite.is_empty() {
        return "–".into();
    }
    let (lo, hi) = finite
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(*x), h.max(*x)));
    let m = median(finite.clone());
    if finite.len() == 1 || (hi - lo) < 0.5 * 10f64.powi(-(digits as i32)) {
        format!("{m:.digits$}")
    } else {
        format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
    }
}

fn sync_rows(label: &str, objects: u64, syncs: &[Sync]) -> String {
    let of = |f: &dyn Fn(&Sync) -> Option<f64>, d| spread(syncs.iter().filter_map(f).collect(), d);
    format!(
        "| {label} | {objects} | {} | {} | {} | {} | {} / {} | {} | {} / {} | {} / {} | {} | {} |",
        of(&|s| s.first, 1),
        of(&|s| s.last, 1),
        of(&|s| Some(s.cpu), 1),
        of(&|s| Some(s.rss), 0),
        of(&|s| s.held.map(|h| h[0]), 0),
        of(&|s| s.held.map(|h| h[1]), 0),
        of(&|s| Some(s.read_mib), 0),
        of(&|s| Some(s.server[0]), 1),
        of(&|s| Some(s.server[1]), 0),
        of(&|s| Some(s.server[2]), 1),
        of(&|s| Some(s.server[3]), 0),
        of(&|s| Some(s.server[4]), 1),
        syncs.last().map_or("", |s| s.requests.as_str()),
    )
}

fn ending_cells(endings: &[&Ending]) -> String {
    let sum = |f: &dyn Fn(&Ending) -> usize| endings.iter().map(|e| f(e)).sum::<usize>();
    format!(
        "{} | {} | {} | {} | {} | {}",
        sum(&|e| e.d.lost_deletes.len()),
        sum(&|e| e.d.phantom_deletes.len()),
        sum(&|e| e.d.stale.len()),
        sum(&|e| e.d.missing.len()),
        sum(&|e| e.duplicates),
        sum(&|e| e.out_of_order),
    )
}

fn main() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run());
}

async fn run() {
    let n = from_env("BENCH_OBJECTS", 50_000);
    let large = from_env("BENCH_OBJECTS_LARGE", 200_000);
    let rounds = from_env("BENCH_ROUNDS", 3);
    let phases = std::env::var("BENCH_PHASES").unwrap_or_else(|_| "main,failover,large".into());
    let tools: Vec<Tool> = std::env::var("BENCH_TOOLS")
        .unwrap_or_else(|_| "bridge,collector,client-go".into())
        .split(',')
        .filter_map(|t| match t.trim() {
            "bridge" => Some(Tool::Bridge),
            "collector" => Some(Tool::Collector),
            "client-go" => Some(Tool::ClientGo),
            _ => None,
        })
        .collect();
    let cluster = Cluster::start().await;
    let kafka = Kafka::start();
    for ns in 0..NAMESPACES {
        cluster.create_namespace(&namespace(ns)).await;
    }
    let client = cluster.client().await;
    let create = async |range: std::ops::Range<u64>| {
        let began = Instant::now();
        let count = range.end - range.start;
        stream::iter(range)
            .for_each_concurrent(64, |i| {
                let api = Api::<ConfigMap>::namespaced(client.clone(), &namespace(i));
                async move {
                    api.create(&PostParams::default(), &object(i, 0))
                        .await
                        .unwrap();
                }
            })
            .await;
        println!("created {count} in {:.1?}", began.elapsed());
    };
    create(0..n).await;
    let upstream = cluster.port();
    let proxy = support::loopback::CountingProxy::start(upstream).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = support::loopback::proxied_kubeconfig(
        &cluster.kubeconfig(),
        upstream,
        proxy.port,
        dir.path(),
    );
    let mut bench = Bench {
        cluster,
        kafka,
        proxy,
        kubeconfig,
        client: client.clone(),
        world: World {
            exists: Mutex::new(vec![true; n as usize]),
            round: AtomicU64::new(1),
        },
        rate: from_env("BENCH_RATE", 500),
        steady_secs: from_env("BENCH_STEADY_SECS", 30),
        idle_secs: from_env("BENCH_IDLE_SECS", 10),
        burst: from_env("BENCH_BURST", 10_000),
        restart_changes: from_env("BENCH_RESTART_CHANGES", 100),
        seed: support::parity::seed(),
    };
    let settings = format!(
        "{n} and {large} ConfigMaps of about 1 KB in {NAMESPACES} namespaces, {rounds} rounds (the order of the tools rotating), steady changes at {}/s and as fast as {WRITERS} writers go for {} s each, a burst of {} updates, {} deletes/updates/creates while a tool is down or nobody leads; tools {tools:?}; phases {phases}",
        bench.rate, bench.steady_secs, bench.burst, bench.restart_changes
    );
    println!("peers: {settings}");
    let (list_s, produce_s) = floor(&bench).await;
    println!(
        "floor at {n}: the API server's unpaged list {list_s:.2} s + a raw producer of as many CloudEvents {produce_s:.2} s = {:.2} s",
        list_s + produce_s
    );
    let rotated = |round: u64| {
        let mut t = tools.clone();
        t.rotate_left(round as usize % tools.len().max(1));
        t
    };

    let mut runs: BTreeMap<&str, Vec<Run>> = BTreeMap::new();
    if phases.contains("main") {
        for round in 1..=rounds {
            for tool in rotated(round) {
                println!("round {round}: {}", tool.label());
                let r = bench.run(tool, round, false).await;
                runs.entry(tool.key()).or_default().push(r);
            }
        }
    }
    let mut outages: BTreeMap<&str, Vec<Run>> = BTreeMap::new();
    if phases.contains("outage") {
        for round in 1..=rounds {
            for tool in rotated(round) {
                if tool == Tool::ClientGo {
                    continue;
                }
                println!(
                    "round {round}: {} frozen past the watch history",
                    tool.label()
                );
                let r = bench.run(tool, round, true).await;
                outages.entry(tool.key()).or_default().push(r);
            }
        }
    }
    let mut failovers: BTreeMap<String, Vec<Failover>> = BTreeMap::new();
    if phases.contains("failover") {
        let mut kinds: Vec<(Tool, bool)> = Vec::new();
        if tools.contains(&Tool::Bridge) {
            kinds.extend([(Tool::Bridge, false), (Tool::Bridge, true)]);
        }
        if tools.contains(&Tool::Collector) {
            kinds.push((Tool::Collector, false));
        }
        for round in 1..=rounds {
            kinds.rotate_left(1);
            for &(tool, eos) in &kinds {
                println!(
                    "round {round}: failover of {}{}",
                    tool.label(),
                    if eos { " exactly_once" } else { "" }
                );
                let f = bench.failover(tool, eos, round).await;
                let key = format!("{}{}", tool.key(), if eos { " exactly_once" } else { "" });
                failovers.entry(key).or_default().push(f);
            }
        }
    }
    let mut larges: BTreeMap<&str, Vec<Sync>> = BTreeMap::new();
    if phases.contains("large") && large > n {
        create(n..large).await;
        for round in 1..=rounds {
            for tool in rotated(round) {
                println!("round {round} at {large}: {}", tool.label());
                let s = bench.sync_alone(tool, round).await;
                larges.entry(tool.key()).or_default().push(s);
            }
        }
    }

    // The tables: medians over rounds with the spread (min–max); counts summed over rounds.
    let label = |key: &str| match key {
        "bridge" => Tool::Bridge.label(),
        "collector" => Tool::Collector.label(),
        _ => Tool::ClientGo.label(),
    };
    println!("\n{settings}\n");
    println!(
        "Floor at {n}: the API server's unpaged list {list_s:.2} s + a raw rdkafka producer with the bridge's settings {produce_s:.2} s = **{:.2} s**.\n",
        list_s + produce_s
    );
    println!(
        "| initial sync | objects | first message s | last message s | CPU s | peak RSS MiB | peak held / awaiting Kafka | MiB read | kube-apiserver CPU s / peak MiB | etcd CPU s / peak MiB | Kafka CPU s | API requests (last round) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (key, rs) in &runs {
        let syncs: Vec<Sync> = rs.iter().map(|r| r.sync.clone()).collect();
        println!("{}", sync_rows(label(key), n, &syncs));
    }
    for (key, syncs) in &larges {
        println!("{}", sync_rows(label(key), large, syncs));
    }
    if !runs.is_empty() {
        println!(
            "\n| steady changes | asked | achieved /s | lag p50 ms | lag p99 ms | lag max ms | CPU ms/change | bytes stored/change | messages/change | never seen |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (key, rs) in &runs {
            for (k, asked) in [format!("{}/s", bench.rate), "max".into()]
                .iter()
                .enumerate()
            {
                let of = |f: &dyn Fn(&Steady) -> f64, d| {
                    spread(
                        rs.iter()
                            .filter_map(|r| r.steady[k].map(|s| f(&s)))
                            .collect(),
                        d,
                    )
                };
                println!(
                    "| {} | {asked} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    label(key),
                    of(&|s| s.achieved, 0),
                    of(&|s| s.p50, 0),
                    of(&|s| s.p99, 0),
                    of(&|s| s.max, 0),
                    of(&|s| s.cpu_ms, 2),
                    if *key == "client-go" {
                        "–".into()
                    } else {
                        of(&|s| s.stored_per_change, 0)
                    },
                    of(&|s| s.per_change, 2),
                    rs.iter()
                        .filter_map(|r| r.steady[k].map(|s| s.unseen))
                        .sum::<usize>(),
                );
            }
        }
        println!(
            "\n| burst of {} updates | written in s | the last in Kafka after s | restarted, down 10 s: deletes, updates, creates delivered, unchanged resent (each round) |",
            bench.burst
        );
        println!("|---|---|---|---|");
        for (key, rs) in &runs {
            let restarts: Vec<String> = rs
                .iter()
                .filter_map(|r| r.restart_short.map(|(d, _)| d.to_string()))
                .collect();
            println!(
                "| {} | {} | {} | {} |",
                label(key),
                spread(rs.iter().filter_map(|r| r.burst.map(|b| b.0)).collect(), 1),
                spread(
                    rs.iter()
                        .filter_map(|r| r.burst.and_then(|b| b.1))
                        .collect(),
                    1
                ),
                if restarts.is_empty() {
                    "not restarted (no state)".to_owned()
                } else {
                    restarts.join(" · ")
                },
            );
        }
        println!(
            "\n| a consumer ends with (all rounds) | lost deletes | phantom deletes | stale finals | missing | duplicates | order violations |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (key, rs) in &runs {
            let endings: Vec<&Ending> = rs.iter().filter_map(|r| r.ending.as_ref()).collect();
            println!("| {} | {} |", label(key), ending_cells(&endings));
        }
    }
    if !outages.is_empty() {
        println!(
            "\n| frozen past the watch history (connections cut, {} deletes/updates/creates, etcd compacted, API server restarted, thawed) | deletes, updates, creates delivered, unchanged resent (each round) | a 410 in its log | lost deletes | phantom deletes | stale finals | missing | duplicates |",
            bench.restart_changes
        );
        println!("|---|---|---|---|---|---|---|---|");
        for (key, rs) in &outages {
            let each: Vec<String> = rs
                .iter()
                .filter_map(|r| r.restart_long.map(|(d, _)| d.to_string()))
                .collect();
            let gone: Vec<String> = rs
                .iter()
                .filter_map(|r| r.restart_long.map(|(_, g)| g.to_string()))
                .collect();
            let endings: Vec<&Ending> = rs.iter().filter_map(|r| r.ending.as_ref()).collect();
            let cells = ending_cells(&endings);
            let cells: Vec<&str> = cells.split(" | ").collect();
            println!(
                "| {} | {} | {} | {} |",
                label(key),
                each.join(" · "),
                gone.join(", "),
                cells[..5].join(" | ")
            );
        }
    }
    if !failovers.is_empty() {
        println!(
            "\n| failover (leader SIGKILLed) | Lease taken s | first change in Kafka s | deletes, updates, creates delivered, unchanged resent (each round) | lost deletes | phantom deletes | stale finals | missing | duplicates | order violations |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (key, fs) in &failovers {
            let endings: Vec<&Ending> = fs.iter().filter_map(|f| f.ending.as_ref()).collect();
            let (tool, eos) = key.split_once(' ').unwrap_or((key, ""));
            println!(
                "| {} {eos} | {} | {} | {} | {} |",
                label(tool),
                spread(fs.iter().filter_map(|f| f.lease).collect(), 1),
                spread(fs.iter().filter_map(|f| f.first_change).collect(), 1),
                fs.iter()
                    .map(|f| f.delivered.to_string())
                    .collect::<Vec<_>>()
                    .join(" · "),
                ending_cells(&endings),
            );
        }
    }

    // The summary a script reads.
    let mut summary_tools = serde_json::Map::new();
    for tool in &tools {
        let key = tool.key();
        let mut t = serde_json::Map::new();
        let mut put = |name: &str, v: f64| {
            if v.is_finite() {
                t.insert(name.into(), json!((v * 1000.0).round() / 1000.0));
            }
        };
        if let Some(rs) = runs.get(key) {
            // At `objects` (BENCH_OBJECTS), as the large phase's keys are at `objects_large`.
            put(
                "sync_s",
                median(rs.iter().filter_map(|r| r.sync.last).collect()),
            );
            put(
                "peak_rss_mib",
                median(rs.iter().map(|r| r.sync.rss.max(r.peak_rss)).collect()),
            );
            put(
                "peak_held",
                median(
                    rs.iter()
                        .filter_map(|r| r.sync.held.map(|h| h[0]))
                        .collect(),
                ),
            );
            let steady = |k: usize, f: &dyn Fn(&Steady) -> f64| {
                median(
                    rs.iter()
                        .filter_map(|r| r.steady[k].map(|s| f(&s)))
                        .collect(),
                )
            };
            put(
                "idle_cpu_ms_per_s",
                median(rs.iter().filter_map(|r| r.idle_cpu_ms_per_s).collect()),
            );
            put("cpu_per_change_ms_500", steady(0, &|s| s.cpu_ms));
            put("lag_p99_ms_500", steady(0, &|s| s.p99));
            put("cpu_per_change_ms_max_rate", steady(1, &|s| s.cpu_ms));
            put("max_rate_per_s", steady(1, &|s| s.achieved));
            let endings: Vec<&Ending> = rs.iter().filter_map(|r| r.ending.as_ref()).collect();
            put(
                "lost_deletes",
                endings
                    .iter()
                    .map(|e| e.d.lost_deletes.len())
                    .sum::<usize>() as f64,
            );
            put(
                "duplicates",
                endings.iter().map(|e| e.duplicates).sum::<usize>() as f64,
            );
        }
        if let Some(ss) = larges.get(key) {
            put(
                "sync_large_s",
                median(ss.iter().filter_map(|s| s.last).collect()),
            );
            put(
                "peak_rss_large_mib",
                median(ss.iter().map(|s| s.rss).collect()),
            );
            put(
                "peak_held_large",
                median(ss.iter().filter_map(|s| s.held.map(|h| h[0])).collect()),
            );
        }
        // The bridge's failover figures are those with `exactly_once: true`.
        let fo = match tool {
            Tool::Bridge => failovers.get("bridge exactly_once"),
            Tool::Collector => failovers.get("collector"),
            Tool::ClientGo => None,
        };
        if let Some(fs) = fo {
            put(
                "failover_lease_s",
                median(fs.iter().filter_map(|f| f.lease).collect()),
            );
            put(
                "failover_first_change_s",
                median(fs.iter().filter_map(|f| f.first_change).collect()),
            );
        }
        summary_tools.insert(key.into(), Value::Object(t));
    }
    let summary = json!({
        // The floor at BENCH_OBJECTS (50,000 by default), whatever that is.
        "floor_s": ((list_s + produce_s) * 1000.0).round() / 1000.0,
        "floor_objects": n,
        "objects": n,
        "objects_large": large,
        "rounds": rounds,
        "tools": summary_tools,
    });
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    let path = target.join("peers/summary.json");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    println!(
        "\nsummary: {}\n{}",
        path.display(),
        serde_json::to_string_pretty(&summary).unwrap()
    );
}
