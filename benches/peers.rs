//! kube-event-bridge beside what users would run instead, on one real kube-apiserver v1.36
//! (etcd with `--unsafe-no-fsync`) and one Apache Kafka 4.3 node: the OpenTelemetry Collector
//! v0.111.0 (`k8sobjects` receiver → batch processor → `kafka` exporter, built from the Go
//! module proxy by scripts/build-peers) and client-go v0.36.3's shared informer (the
//! reference program of tests/realk8s; no broker). Each tool runs alone against the same
//! ConfigMaps, one after another, and rounds interleave the tools.
//!
//! Every tool is measured from outside the same way:
//! - **At a Kafka consumer**: each message's time of arrival, parsed back to (namespace/name,
//!   resourceVersion, deleted). Each tool writes to a topic of its own with one partition, so
//!   that the order of the collector's unkeyed records is the order they were written.
//!   client-go has no broker: its notifications are read from its output as it writes them
//!   (polled every 10 ms).
//! - **Bytes read from the API server**, through a counting loopback proxy between the tool
//!   and the API server (TLS passes through it).
//! - **CPU seconds and peak RSS** of the tool's process, from /proc.
//!
//! Phases per tool and round:
//! 1. **Initial sync** of BENCH_OBJECTS ConfigMaps (about 1 KB each, in 5 namespaces): until
//!    the last object's message arrives (client-go: until `HasSynced`).
//! 2. **Steady changes** at each rate of BENCH_RATES (per second, for BENCH_STEADY_SECS): 80%
//!    updates, 10% deletes, 10% creates from 16 writers; the lag from the write's
//!    acknowledgement to the message's arrival (p50, p99), CPU per change, messages per change.
//! 3. **A restart**: the tool stopped (SIGTERM), BENCH_RESTART_CHANGES deletes, updates and
//!    creates each, the tool started again: how many of each arrive, and how many unchanged
//!    objects are sent again.
//! 4. **A failover**, the bridge only (the collector v0.111's k8sobjects receiver has no
//!    leader elector): two replicas with leader election, the leader SIGKILLed, the same
//!    changes as 3.; when the survivor took the Lease and had published them.
//! 5. **What a consumer ends with**: the topic folded by order per key against the API server
//!    (lost deletes, phantom deletes, stale finals, missing).
//!
//! Settings, as each tool's docs recommend for production:
//! - the bridge: its defaults (a Kafka sink with `resume` on a checkpoint topic; lz4, acks=all,
//!   idempotence), leader election off (one replica);
//! - the collector: `k8sobjects` with `pull` (the only mode that sends the objects that exist,
//!   once per `interval`: 1h here) and `watch` (changes) for configmaps; the batch processor;
//!   the kafka exporter with `encoding: raw` (the value is the log body as JSON: the object for
//!   `pull`, `{"type", "object"}` for `watch`), `required_acks: -1`, lz4, its default sending
//!   queue (in memory: no persistent queue) and retries; no leader elector (one replica).
//!
//! `cargo bench --bench peers` (after scripts/build-realk8s and scripts/build-peers; defaults
//! BENCH_OBJECTS=50000, BENCH_ROUNDS=2, BENCH_RATES=200,500, BENCH_STEADY_SECS=60,
//! BENCH_RESTART_CHANGES=100, BENCH_TOOLS=bridge,collector,client-go;
//! BENCH_BRIDGE_KUBERNETES='{"page_size": 0}' sets the bridge's `kubernetes` section).

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    collections::{BTreeMap, HashMap},
    io::{BufRead, Seek},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use rdkafka::{
    ClientConfig, Message as _,
    consumer::{Consumer, StreamConsumer},
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
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of stat; `after` starts at field 3.
    (ticks(11) + ticks(12)) / 100.0
}

/// A loopback TCP proxy in front of the API server that counts the bytes it sends back.
struct CountingProxy {
    port: u16,
    read: Arc<AtomicU64>,
}

impl CountingProxy {
    async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let read = Arc::new(AtomicU64::new(0));
        let counter = read.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                        let _ = sw.shutdown().await;
                    });
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = sr.read(&mut buf).await {
                        if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        counter.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    up.abort();
                });
            }
        });
        Self { port, read }
    }

    fn bytes(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }
}

/// A copy of `kubeconfig` whose server is the proxy (the certificate names 127.0.0.1, any
/// port).
fn proxied_kubeconfig(kubeconfig: &Path, upstream: u16, proxy: u16, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    let from = format!("127.0.0.1:{upstream}");
    assert!(text.contains(&from), "{text}");
    let path = dir.join("proxied.kubeconfig");
    std::fs::write(&path, text.replace(&from, &format!("127.0.0.1:{proxy}"))).unwrap();
    path
}

/// One message as a consumer sees it.
#[derive(Debug, Clone)]
struct Arrival {
    at: Instant,
    key: String,
    uid: String,
    rv: String,
    deleted: bool,
}

fn arrival_of(at: Instant, object: &Value, deleted: bool) -> Option<Arrival> {
    let m = &object["metadata"];
    Some(Arrival {
        at,
        key: format!("{}/{}", m["namespace"].as_str()?, m["name"].as_str()?),
        uid: m["uid"].as_str().unwrap_or_default().to_owned(),
        rv: m["resourceVersion"].as_str().unwrap_or_default().to_owned(),
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
            Tool::Collector => "otelcol k8sobjects→kafka",
            Tool::ClientGo => "client-go informer",
        }
    }

    /// A message value (or a client-go line) as an arrival.
    fn parse(self, at: Instant, value: &Value) -> Option<Arrival> {
        match self {
            // A structured CloudEvent.
            Tool::Bridge => {
                arrival_of(at, &value["data"]["object"], event_type(value) == "deleted")
            }
            // `raw`: the object (pull), or {"type", "object"} (watch).
            Tool::Collector => match value["type"].as_str() {
                Some(ty) if value.get("object").is_some() => {
                    arrival_of(at, &value["object"], ty == "DELETED")
                }
                _ => arrival_of(at, value, false),
            },
            Tool::ClientGo => match value["type"].as_str()? {
                "add" | "update" | "delete" => {
                    arrival_of(at, &value["object"], value["type"] == "delete")
                }
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

    /// Reads `topic` from its start until dropped.
    fn consume(tool: Tool, brokers: &str, topic: &str) -> (Self, tokio::task::JoinHandle<()>) {
        let arrivals = Self::default();
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", format!("peers-{topic}"))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", "10")
            .create()
            .unwrap();
        let mut assignment = rdkafka::TopicPartitionList::new();
        assignment
            .add_partition_offset(topic, 0, rdkafka::Offset::Beginning)
            .unwrap();
        consumer.assign(&assignment).unwrap();
        let sink = arrivals.clone();
        let task = tokio::spawn(async move {
            let mut messages = consumer.stream();
            while let Some(Ok(m)) = messages.next().await {
                let at = Instant::now();
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
    Collector(Child),
    ClientGo(ReferenceInformer),
}

impl Process {
    fn pid(&self) -> u32 {
        match self {
            Process::Bridge(r) => r.child.id(),
            Process::Collector(c) => c.id(),
            Process::ClientGo(r) => r.pid(),
        }
    }

    /// SIGTERM, then waits for the exit (a SIGKILL after 30 s).
    fn stop(self) {
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
        if let Process::Collector(mut child) = self {
            let _ = child.wait();
        }
    }
}

fn collector_binary() -> PathBuf {
    support::built_tool("peers/otelcol-peers", "scripts/build-peers")
}

/// Where a tool runs: its topic, its directory, the proxied kubeconfig.
struct Setup<'a> {
    dir: &'a Path,
    kubeconfig: &'a Path,
    brokers: &'a str,
    topic: String,
}

fn start(tool: Tool, s: &Setup) -> Process {
    start_as(tool, s, None)
}

/// `start`, for the bridge as replica `identity` with leader election (the defaults'
/// timings, the Lease in kube-system).
fn start_as(tool: Tool, s: &Setup, identity: Option<&str>) -> Process {
    match tool {
        Tool::Bridge => {
            // BENCH_BRIDGE_KUBERNETES: JSON for the `kubernetes` section, to try list settings
            // (`{"page_size": 0}`, `{"streaming_list": true}`).
            let kubernetes: Value = std::env::var("BENCH_BRIDGE_KUBERNETES")
                .ok()
                .map(|j| serde_json::from_str(&j).expect("BENCH_BRIDGE_KUBERNETES is JSON"))
                .unwrap_or_else(|| json!({}));
            let config = ConfigBuilder::new()
                .kubernetes(kubernetes)
                .resource(json!({"api_version": "v1", "kind": "ConfigMap"}))
                .sink(json!({
                    "name": "kafka", "type": "kafka",
                    "kafka": {"brokers": [s.brokers], "topic": s.topic,
                              "checkpoint_topic": format!("{}.checkpoints", s.topic)},
                }))
                .route("configmap", &["kafka"]);
            let (config, name) = match identity {
                Some(id) => (config.leader_election(id), id),
                None => (config, "bridge"),
            };
            Process::Bridge(Replica::start(s.dir, name, &config.value(), s.kubeconfig))
        }
        Tool::Collector => {
            let config = json!({
                "receivers": {"k8sobjects": {
                    "auth_type": "kubeConfig",
                    "objects": [
                        {"name": "configmaps", "mode": "pull", "interval": "1h"},
                        {"name": "configmaps", "mode": "watch"},
                    ],
                }},
                "processors": {"batch": {}},
                "exporters": {"kafka": {
                    "brokers": [s.brokers],
                    "topic": s.topic,
                    "encoding": "raw",
                    "protocol_version": "2.8.0",
                    "producer": {"required_acks": -1, "compression": "lz4"},
                }},
                "service": {
                    "telemetry": {"metrics": {"level": "none"}},
                    "pipelines": {"logs": {
                        "receivers": ["k8sobjects"], "processors": ["batch"],
                        "exporters": ["kafka"],
                    }},
                },
            });
            let path = s.dir.join("otelcol.yaml");
            std::fs::write(&path, config.to_string()).unwrap();
            let child = Command::new(collector_binary())
                .arg("--config")
                .arg(&path)
                .env("KUBECONFIG", s.kubeconfig)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(s.dir.join("otelcol.log")).unwrap())
                .spawn()
                .expect("the collector starts");
            Process::Collector(child)
        }
        Tool::ClientGo => Process::ClientGo(ReferenceInformer::start(
            s.kubeconfig,
            s.dir,
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

/// Writes `changes` changes at `rate` per second from [`WRITERS`] writers (writer w owns
/// the objects i ≡ w mod WRITERS): 80% updates, 10% deletes, 10% creates (of deleted ones).
async fn write(
    api_of: &dyn Fn(&str) -> Api<ConfigMap>,
    world: &World,
    rate: u64,
    changes: u64,
    seed: u64,
) -> Vec<Write> {
    let n = world.exists.lock().unwrap().len() as u64;
    let interval = Duration::from_secs_f64(WRITERS as f64 / rate as f64);
    let writes = Mutex::new(Vec::new());
    stream::iter(0..WRITERS)
        .for_each_concurrent(WRITERS as usize, |w| {
            let writes = &writes;
            async move {
                let mut rng = Rng(seed ^ (w + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                for _ in 0..changes / WRITERS {
                    tick.tick().await;
                    let i = w + WRITERS * rng.below(n / WRITERS);
                    let round = world.round.fetch_add(1, Ordering::Relaxed);
                    let api = api_of(&namespace(i));
                    let exists = world.exists.lock().unwrap()[i as usize];
                    let dice = rng.below(10);
                    let key = format!("{}/{}", namespace(i), name(i));
                    // Only what the API server accepted is a write (none should fail: each
                    // writer owns its objects, and World follows every change).
                    let rv = if !exists {
                        let made = api.create(&PostParams::default(), &object(i, round)).await;
                        world.exists.lock().unwrap()[i as usize] = true;
                        made.map(|o| o.metadata.resource_version)
                    } else if dice == 0 {
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

/// The stream folded by order per key against the API server.
fn fold(arrivals: &[Arrival], live: &BTreeMap<String, (String, String)>) -> support::Differences {
    let mut folded = BTreeMap::new();
    for a in arrivals {
        folded.insert(
            a.key.clone(),
            (!a.deleted).then(|| (a.uid.clone(), a.rv.clone())),
        );
    }
    support::differences(&folded, live)
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

/// Changes made while a tool is down: deletes, updates and creates, and what the API server
/// held after them.
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
        round: u64,
        tool: Tool,
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
            let i = 10_000_000 + round * 100_000 + tool as u64 * 10_000 + salt * 1_000 + k;
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

    /// Of `got`: deletes, updates (to the final state) and creates delivered, and messages for
    /// objects not changed.
    fn delivered(&self, got: &[Arrival]) -> (usize, usize, usize, usize) {
        let has =
            |key: &String, deleted: bool| got.iter().any(|a| &a.key == key && a.deleted == deleted);
        let deletes = self.deleted.iter().filter(|k| has(k, true)).count();
        let updates = self
            .updated
            .iter()
            .filter(|k| {
                got.iter()
                    .any(|a| &a.key == *k && Some(&a.rv) == self.after.get(*k).map(|s| &s.1))
            })
            .count();
        let creates = self.created.iter().filter(|k| has(k, false)).count();
        let touched: std::collections::HashSet<&String> = self
            .deleted
            .iter()
            .chain(&self.updated)
            .chain(&self.created)
            .collect();
        let replayed = got.iter().filter(|a| !touched.contains(&a.key)).count();
        (deletes, updates, creates, replayed)
    }
}

// ---------------------------------------------------------------------------------------
// One run of one tool

/// One rate of the steady phase.
#[derive(Clone, Copy)]
struct Steady {
    achieved: f64,
    p50: f64,
    p99: f64,
    cpu_ms: f64,
    per_change: f64,
}

#[derive(Default, Clone)]
struct Row {
    sync: Option<Duration>,
    sync_cpu: f64,
    sync_rss: f64,
    sync_bytes: u64,
    /// Per rate of BENCH_RATES.
    steady: Vec<Steady>,
    restart: Option<(usize, usize, usize, usize, usize, usize, usize)>,
    fold: Option<String>,
    peak_rss: f64,
    total_bytes: u64,
}

#[allow(clippy::too_many_arguments)]
async fn run_tool(
    tool: Tool,
    round: u64,
    cluster: &Cluster,
    kafka: &Kafka,
    proxy: &CountingProxy,
    kubeconfig: &Path,
    world: &World,
    rates: &[u64],
    steady_secs: u64,
    restart_changes: u64,
    seed: u64,
) -> Row {
    let dir = tempfile::tempdir().unwrap();
    let topic = format!("peers.{}.r{round}", format!("{tool:?}").to_lowercase());
    if tool != Tool::ClientGo {
        kafka.create_topic(&topic, 1);
    }
    let setup = Setup {
        dir: dir.path(),
        kubeconfig,
        brokers: &kafka.brokers(),
        topic,
    };
    let client = cluster.client().await;
    let api_of = |ns: &str| Api::<ConfigMap>::namespaced(client.clone(), ns);
    let mut row = Row::default();
    let n = live(cluster).await.len();

    // 1. Initial sync.
    let bytes0 = proxy.bytes();
    let began = Instant::now();
    let mut process = start(tool, &setup);
    let (arrivals, reader) = match tool {
        Tool::ClientGo => Arrivals::follow(dir.path().join("client-go-configmaps.jsonl")),
        _ => Arrivals::consume(tool, setup.brokers, &setup.topic),
    };
    let synced_line = dir.path().join("client-go-configmaps.jsonl");
    row.sync = until(Duration::from_secs(900), || match tool {
        Tool::ClientGo => std::fs::read(&synced_line)
            .is_ok_and(|b| b.windows(15).any(|w| w == b"\"type\":\"synced\"")),
        _ => arrivals.len() >= n,
    })
    .await;
    let _ = began;
    row.sync_cpu = cpu_seconds(process.pid());
    row.sync_rss = support::peak_rss_mib(process.pid());
    row.sync_bytes = proxy.bytes() - bytes0;
    println!(
        "  [{}] initial sync of {n}: {:?}, CPU {:.1} s, peak RSS {:.0} MiB, read {:.1} MiB",
        tool.label(),
        row.sync,
        row.sync_cpu,
        row.sync_rss,
        row.sync_bytes as f64 / 1048576.0
    );
    if row.sync.is_none() {
        println!(
            "  [{}] did not sync; see {}",
            tool.label(),
            dir.path().display()
        );
        std::mem::forget(dir);
        return row;
    }
    quiet(&arrivals, Duration::from_secs(2), Duration::from_secs(60)).await;

    // 2. Steady changes.
    for &rate in rates {
        let changes = rate * steady_secs;
        let (cpu0, from) = (cpu_seconds(process.pid()), arrivals.len());
        let began = Instant::now();
        let writes = write(&api_of, world, rate, changes, seed ^ rate ^ round).await;
        let took = began.elapsed();
        quiet(&arrivals, Duration::from_secs(3), Duration::from_secs(120)).await;
        let got = arrivals.since(from);
        let (l, unseen_writes) = lags(&writes, &got);
        let unseen = unseen_writes.len();
        if unseen > 0 {
            println!("    never seen, e.g. {:?}", &unseen_writes[..unseen.min(4)]);
        }
        let achieved = writes.len() as f64 / took.as_secs_f64();
        let cpu_ms = (cpu_seconds(process.pid()) - cpu0) * 1000.0 / writes.len() as f64;
        let per_change = got.len() as f64 / writes.len() as f64;
        println!(
            "  [{}] {rate}/s asked, {achieved:.0}/s achieved: lag p50 {:.0} ms, p99 {:.0} ms, {unseen} writes never seen, CPU {cpu_ms:.2} ms/change, {per_change:.2} messages/change",
            tool.label(),
            percentile(&l, 0.5),
            percentile(&l, 0.99),
        );
        row.steady.push(Steady {
            achieved,
            p50: percentile(&l, 0.5),
            p99: percentile(&l, 0.99),
            cpu_ms,
            per_change,
        });
    }
    row.peak_rss = support::peak_rss_mib(process.pid());

    // 3. A restart. client-go has no state to resume from: it is not restarted.
    if tool != Tool::ClientGo {
        process.stop();
        let changes = Changes::make(cluster, &api_of, world, round, tool, 0, restart_changes).await;
        let from = arrivals.len();
        process = start(tool, &setup);
        quiet(&arrivals, Duration::from_secs(10), Duration::from_secs(300)).await;
        let (deletes, updates, creates, replayed) = changes.delivered(&arrivals.since(from));
        let (deleted, updated, created) = (&changes.deleted, &changes.updated, &changes.created);
        println!(
            "  [{}] restart: {deletes}/{} deletes, {updates}/{} updates, {creates}/{} creates delivered; {replayed} messages for unchanged objects",
            tool.label(),
            deleted.len(),
            updated.len(),
            created.len()
        );
        row.restart = Some((
            deletes,
            deleted.len(),
            updates,
            updated.len(),
            creates,
            created.len(),
            replayed,
        ));
    }

    // A failover, the bridge only (the collector v0.111's k8sobjects receiver has no leader
    // elector: two replicas would both send everything). Two replicas with leader election;
    // the leader is SIGKILLed and the same changes follow while nobody leads.
    if tool == Tool::Bridge {
        process.stop();
        let a = start_as(tool, &setup, Some("replica-a"));
        let b = start_as(tool, &setup, Some("replica-b"));
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
            Api::namespaced(client.clone(), "kube-system");
        let holder = async || {
            leases
                .get_opt("kube-event-bridge")
                .await
                .ok()
                .flatten()
                .and_then(|l| l.spec?.holder_identity)
        };
        let mut leader = None;
        let began = Instant::now();
        while leader.is_none() && began.elapsed() < Duration::from_secs(120) {
            leader = holder().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        quiet(&arrivals, Duration::from_secs(5), Duration::from_secs(120)).await;
        let leader = leader.expect("a leader");
        let (mut dying, survivor) = match (leader.as_str(), a, b) {
            ("replica-a", Process::Bridge(a), b) => (a, b),
            (_, a, Process::Bridge(b)) => (b, a),
            _ => unreachable!(),
        };
        let survivor_id = if leader == "replica-a" {
            "replica-b"
        } else {
            "replica-a"
        };
        let from = arrivals.len();
        let killed = Instant::now();
        let _ = dying.child.kill();
        let changes = Changes::make(cluster, &api_of, world, round, tool, 1, restart_changes).await;
        let mut took_over = None;
        while took_over.is_none() && killed.elapsed() < Duration::from_secs(300) {
            if holder().await.as_deref() == Some(survivor_id) {
                took_over = Some(killed.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The new leader publishes after its takeover wait (the last leader's deliveries may
        // land until then): wait for as many messages as changes, then for quiet.
        let wanted = changes.deleted.len() + changes.updated.len() + changes.created.len();
        let published = until(Duration::from_secs(300), || arrivals.len() - from >= wanted)
            .await
            .map(|_| killed.elapsed());
        quiet(&arrivals, Duration::from_secs(5), Duration::from_secs(120)).await;
        let (deletes, updates, creates, replayed) = changes.delivered(&arrivals.since(from));
        println!(
            "  [{}] failover: {survivor_id} took the Lease {took_over:?} and had published the changes {published:?} after the leader's SIGKILL; {deletes}/{} deletes, {updates}/{} updates, {creates}/{} creates delivered; {replayed} messages for unchanged objects",
            tool.label(),
            changes.deleted.len(),
            changes.updated.len(),
            changes.created.len()
        );
        drop(dying);
        process = survivor;
    }

    // 4. What a consumer ends with.
    quiet(&arrivals, Duration::from_secs(3), Duration::from_secs(60)).await;
    let d = fold(&arrivals.since(0), &live(cluster).await);
    let f = format!(
        "{} lost deletes, {} phantom deletes, {} stale, {} missing",
        d.lost_deletes.len(),
        d.phantom_deletes.len(),
        d.stale.len(),
        d.missing.len()
    );
    println!("  [{}] a consumer ends with: {f}", tool.label());
    let all = arrivals.since(0);
    for key in d
        .lost_deletes
        .iter()
        .chain(&d.phantom_deletes)
        .chain(&d.stale)
        .take(4)
    {
        let history: Vec<String> = all
            .iter()
            .filter(|a| &a.key == key)
            .map(|a| format!("{}{}", if a.deleted { "deleted@" } else { "" }, a.rv))
            .collect();
        println!("    {key}: {history:?}");
    }
    row.fold = Some(f);
    row.peak_rss = row.peak_rss.max(support::peak_rss_mib(process.pid()));
    row.total_bytes = proxy.bytes() - bytes0;
    process.stop();
    reader.abort();
    row
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
    let rounds = from_env("BENCH_ROUNDS", 2);
    let steady_secs = from_env("BENCH_STEADY_SECS", 60);
    let restart_changes = from_env("BENCH_RESTART_CHANGES", 100);
    let rates: Vec<u64> = std::env::var("BENCH_RATES")
        .unwrap_or_else(|_| "200,500".into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect();
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
    println!(
        "peers: {n} ConfigMaps in {NAMESPACES} namespaces, {rounds} rounds, rates {rates:?}/s for {steady_secs} s, {restart_changes} deletes/updates/creates while stopped; tools {tools:?}"
    );
    let cluster = Cluster::start().await;
    let kafka = Kafka::start();
    println!(
        "kube-apiserver v1.36.3 ready in {:.1?}; Kafka at {}",
        cluster.last_start,
        kafka.brokers()
    );
    for ns in 0..NAMESPACES {
        cluster.create_namespace(&namespace(ns)).await;
    }
    let client = cluster.client().await;
    let began = Instant::now();
    stream::iter(0..n)
        .for_each_concurrent(64, |i| {
            let api = Api::<ConfigMap>::namespaced(client.clone(), &namespace(i));
            async move {
                api.create(&PostParams::default(), &object(i, 0))
                    .await
                    .unwrap();
            }
        })
        .await;
    println!("created {n} in {:.1?}", began.elapsed());
    let world = World {
        exists: Mutex::new(vec![true; n as usize]),
        round: AtomicU64::new(1),
    };
    let upstream: u16 = cluster
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap();
    let proxy = CountingProxy::start(upstream).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = proxied_kubeconfig(&cluster.kubeconfig(), upstream, proxy.port, dir.path());
    let seed = support::parity::seed();

    let mut rows: Vec<(Tool, Vec<Row>)> = tools.iter().map(|t| (*t, Vec::new())).collect();
    for round in 1..=rounds {
        for (tool, results) in rows.iter_mut() {
            println!("round {round}: {}", tool.label());
            let row = run_tool(
                *tool,
                round,
                &cluster,
                &kafka,
                &proxy,
                &kubeconfig,
                &world,
                &rates,
                steady_secs,
                restart_changes,
                seed,
            )
            .await;
            results.push(row);
        }
    }

    // The table: medians over rounds where numeric, the last round's text.
    println!(
        "\n| tool | initial sync | CPU s | peak RSS MiB | MiB read | {} restart: deletes / updates / creates, unchanged resent | a consumer ends with |",
        rates
            .iter()
            .map(|r| format!("{r}/s: achieved, lag p50/p99 ms, CPU ms/change, msgs/change |"))
            .collect::<String>()
    );
    println!(
        "|---|---|---|---|---|{}---|---|",
        "---|".repeat(rates.len())
    );
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    for (tool, results) in &rows {
        let sync = med(results
            .iter()
            .filter_map(|r| r.sync.map(|d| d.as_secs_f64()))
            .collect());
        let cpu = med(results.iter().map(|r| r.sync_cpu).collect());
        let rss = med(results.iter().map(|r| r.peak_rss).collect());
        let read = med(results
            .iter()
            .map(|r| r.sync_bytes as f64 / 1048576.0)
            .collect());
        let mut cells = String::new();
        for (k, _) in rates.iter().enumerate() {
            let of = |f: &dyn Fn(&Steady) -> f64| {
                med(results
                    .iter()
                    .filter_map(|r| r.steady.get(k).map(f))
                    .collect())
            };
            cells += &format!(
                "{:.0}/s, {:.0}/{:.0}, {:.2}, {:.2} | ",
                of(&|s| s.achieved),
                of(&|s| s.p50),
                of(&|s| s.p99),
                of(&|s| s.cpu_ms),
                of(&|s| s.per_change)
            );
        }
        let restart = results.last().and_then(|r| r.restart).map_or(
            "not restarted (no state)".into(),
            |(d, dn, u, un, c, cn, rep)| format!("{d}/{dn}, {u}/{un}, {c}/{cn}, {rep}"),
        );
        let fold = results
            .last()
            .and_then(|r| r.fold.clone())
            .unwrap_or_default();
        println!(
            "| {} | {sync:.1} s | {cpu:.1} | {rss:.0} | {read:.0} | {cells}{restart} | {fold} |",
            tool.label()
        );
    }
}
