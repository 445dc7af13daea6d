//! A model-based test of the whole pipeline: a seeded generator drives random sequences of
//! creates, updates, relabels (objects leaving and entering a filter), deletes, deletes and
//! recreates, restarts and leadership changes, CRD version changes, discovery errors and watch
//! 410s against the API test server, while two replicas of the service (leader election on)
//! export to file sinks with checkpoints (resume on) through filters, `publish_if`, an
//! `events` subset and a wildcard over a CRD's group. Then it waits for quiescence and checks
//! what a consumer of each stream ends with, folding it by the order it reads it, per key,
//! against the API server: every object that belongs ends at its newest state (or, where the
//! route does not publish every change, at least its incarnation), every incarnation that is
//! gone or left ends with a delete, no live member ends deleted. It counts lost deletes,
//! phantom deletes, stale finals, missing objects, duplicate ids and the peak of held
//! notifications (sampled), which must stay within the sinks' bound.
//!
//! Sharded cases (`Settings::sharded`) spread the objects over four namespaces and run the
//! replicas with `sharding.shards` M (2 or 3 at first), and add shard handovers: a replica
//! stopped and replaced, scale out and in, a rolling update to another count (1, 2 or 3: the
//! new replicas take the old count's checkpoints over, the single leader and the group never
//! publish together), replicas with different lease timings side by side, and the CRD
//! deleted (its objects with it) and created again while shards change hands.
//!
//! `tests/model.rs` runs a few bounded cases; `cargo bench --bench chaos -- model MINUTES`
//! runs cases until the time is up.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use serde_json::{Value, json};

use super::{ApiServer, RunningApp, config::ConfigBuilder, objects::custom_resource};

const GROUP: &str = "model.example.org";
const NS: &str = "m";
/// The namespaces of a sharded case: their FNV-1a hashes fall in both shards of 2 and all
/// three of 3.
const SHARDED_NS: [&str; 4] = ["orders", "auth", "payments", "gateway"];
/// `max_pending` of every sink: small, so that the cap and its merging are exercised.
const MAX_PENDING: usize = 64;
/// The file sinks.
const SINKS: usize = 3;

/// What one case does.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub seed: u64,
    /// Operations (changes and faults).
    pub ops: usize,
    /// Sharded replicas and shard handovers (see the module docs).
    pub sharded: bool,
}

/// What one case found. Every loss column must be zero.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub ops: usize,
    /// Objects created (a recreate is a new incarnation).
    pub incarnations: usize,
    pub changes: usize,
    pub restarts: usize,
    pub switches: usize,
    pub discovery_faults: usize,
    pub watch_410s: usize,
    /// Sharded cases: replicas started beside the others, and stopped without a successor.
    pub scale_outs: usize,
    pub scale_ins: usize,
    /// Sharded cases: rolling updates to another shard count.
    pub count_changes: usize,
    /// Sharded cases: the CRD deleted (and later created again).
    pub crd_deletes: usize,
    pub messages: usize,
    pub lost_deletes: Vec<String>,
    pub phantom_deletes: Vec<String>,
    pub stale: Vec<String>,
    pub missing: Vec<String>,
    pub duplicates: usize,
    pub peak_held: i64,
}

impl Outcome {
    /// Whether every loss column is zero and the peak held within the bound: per sink
    /// `max_pending`, plus one per object incarnation with something pending (and once more
    /// while a worker publishes it).
    pub fn holds(&self) -> bool {
        self.nothing_lost() && self.peak_held <= self.bound()
    }

    /// Whether every loss column is zero.
    fn nothing_lost(&self) -> bool {
        self.lost_deletes.is_empty()
            && self.phantom_deletes.is_empty()
            && self.stale.is_empty()
            && self.missing.is_empty()
    }

    /// The figures and the keys of every loss column (for a failing case).
    pub fn details(&self) -> String {
        format!(
            "{}\nlost deletes {:?}\nphantom deletes {:?}\nstale {:?}\nmissing {:?}",
            self.line(),
            self.lost_deletes,
            self.phantom_deletes,
            self.stale,
            self.missing
        )
    }

    fn bound(&self) -> i64 {
        (SINKS * MAX_PENDING + 2 * SINKS * self.incarnations) as i64
    }

    pub fn add(&mut self, o: &Outcome) {
        self.ops += o.ops;
        self.incarnations += o.incarnations;
        self.changes += o.changes;
        self.restarts += o.restarts;
        self.switches += o.switches;
        self.discovery_faults += o.discovery_faults;
        self.watch_410s += o.watch_410s;
        self.scale_outs += o.scale_outs;
        self.scale_ins += o.scale_ins;
        self.count_changes += o.count_changes;
        self.crd_deletes += o.crd_deletes;
        self.messages += o.messages;
        self.lost_deletes.extend(o.lost_deletes.iter().cloned());
        self.phantom_deletes
            .extend(o.phantom_deletes.iter().cloned());
        self.stale.extend(o.stale.iter().cloned());
        self.missing.extend(o.missing.iter().cloned());
        self.duplicates += o.duplicates;
        self.peak_held = self.peak_held.max(o.peak_held);
    }

    /// One line of figures.
    pub fn line(&self) -> String {
        format!(
            "ops {} (changes {}, restarts {}, version switches {}, discovery faults {}, watch 410s {}{}), \
             messages {}, lost deletes {}, phantom deletes {}, stale finals {}, missing {}, \
             duplicate ids {}, peak held {} (bound {})",
            self.ops,
            self.changes,
            self.restarts,
            self.switches,
            self.discovery_faults,
            self.watch_410s,
            if self.scale_outs + self.scale_ins + self.count_changes + self.crd_deletes > 0 {
                format!(
                    ", scale-outs {}, scale-ins {}, shard count changes {}, CRD deletes {}",
                    self.scale_outs, self.scale_ins, self.count_changes, self.crd_deletes
                )
            } else {
                String::new()
            },
            self.messages,
            self.lost_deletes.len(),
            self.phantom_deletes.len(),
            self.stale.len(),
            self.missing.len(),
            self.duplicates,
            self.peak_held,
            self.bound(),
        )
    }
}

/// xorshift64*: a small seeded generator (the case is replayed from its seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// The streams: one file sink each.
struct Streams {
    /// ConfigMaps that pass the filter, every change; and every Widget (the wildcard).
    out: PathBuf,
    /// The same ConfigMaps, changes only when `data` changed (`publish_if`).
    quiet: PathBuf,
    /// Every ConfigMap, adds and deletes only (`events`).
    life: PathBuf,
}

/// How one replica runs: its shard count and lease timings (sharded cases give replicas
/// different ones side by side; the takeover waits must follow the holder's).
#[derive(Debug, Clone, Copy)]
struct Run {
    shards: u32,
    lease_duration: &'static str,
    renew_deadline: &'static str,
}

impl Run {
    const SINGLE: Run = Run {
        shards: 1,
        lease_duration: "3s",
        renew_deadline: "2s",
    };
}

fn config(streams: &Streams, identity: &str, run: Run) -> kube_event_bridge::config::Config {
    let sink = |name: &str, path: &Path| {
        // Slower than a burst of changes: the cap is reached and notifications merge.
        json!({"name": name, "type": "stdout", "stdout": {"path": path},
               "max_pending": MAX_PENDING, "rate_limit": {"qps": 400, "burst": 20}})
    };
    let member = r#"object.metadata.labels["team"] == "a""#;
    ConfigBuilder::new()
        .grace_period("10s")
        .kubernetes(json!({
            "discovery_refresh": "1s", "discovery_grace": "4s", "watch_stall_timeout": "5s",
        }))
        .resources(json!([
            {"name": "cms", "api_version": "v1", "kind": "ConfigMap",
             "label_selector": "model=yes", "filter": member},
            {"name": "quiet", "api_version": "v1", "kind": "ConfigMap",
             "label_selector": "model=yes", "filter": member,
             "publish_if": r#"type != "updated" || object.data != oldObject.data"#},
            {"name": "life", "api_version": "v1", "kind": "ConfigMap",
             "label_selector": "model=yes", "events": ["added", "deleted"]},
            {"name": "shop", "api_version": format!("{GROUP}/*"), "kind": "*"},
        ]))
        .sink(sink("out", &streams.out))
        .sink(sink("quiet", &streams.quiet))
        .sink(sink("life", &streams.life))
        .route("cms", &["out"])
        .route("quiet", &["quiet"])
        .route("life", &["life"])
        .route("shop", &["out"])
        .set(
            "leader_election",
            json!({
                "enabled": true, "identity": identity, "namespace": "kube-system",
                "lease_duration": run.lease_duration, "renew_deadline": run.renew_deadline,
                "retry_period": "100ms",
            }),
        )
        .set("sharding", json!({"shards": run.shards}))
        .build()
}

/// One object the model changes: a ConfigMap (team label `a` or `b`) or a Widget.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    ConfigMap,
    Widget,
}

struct Model {
    api: ApiServer,
    rng: Rng,
    widget_version: &'static str,
    /// Whether the Widget CRD exists (sharded cases delete it and create it again).
    crd: bool,
    namespaces: &'static [&'static str],
    names: Vec<(Kind, &'static str, String)>,
    next_name: usize,
    incarnations: usize,
    counter: u64,
}

impl Model {
    fn api_version(&self, kind: Kind) -> String {
        match kind {
            Kind::ConfigMap => "v1".into(),
            Kind::Widget => format!("{GROUP}/{}", self.widget_version),
        }
    }

    fn kind_name(kind: Kind) -> &'static str {
        match kind {
            Kind::ConfigMap => "ConfigMap",
            Kind::Widget => "Widget",
        }
    }

    fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        if kind == Kind::Widget && !self.crd {
            return None;
        }
        self.api
            .get(&self.api_version(kind), Self::kind_name(kind), ns, name)
    }

    fn fresh(&mut self, kind: Kind, ns: &str, name: &str) -> Value {
        self.counter += 1;
        self.incarnations += 1;
        let team = if self.rng.chance(50) { "a" } else { "b" };
        match kind {
            Kind::ConfigMap => json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"namespace": ns, "name": name,
                             "labels": {"model": "yes", "team": team}},
                "data": {"v": self.counter.to_string()},
            }),
            Kind::Widget => {
                let mut w = custom_resource(&self.api_version(kind), "Widget", Some(ns), name);
                w["spec"] = json!({"v": self.counter});
                w
            }
        }
    }

    fn create(&mut self) {
        let kind = if self.rng.chance(60) || !self.crd {
            Kind::ConfigMap
        } else {
            Kind::Widget
        };
        let ns = self.namespaces[self.rng.below(self.namespaces.len())];
        let prefix = if kind == Kind::ConfigMap { "c" } else { "w" };
        let name = format!("{prefix}{}", self.next_name);
        self.next_name += 1;
        let obj = self.fresh(kind, ns, &name);
        self.api.create(obj);
        self.names.push((kind, ns, name));
    }

    /// A random object that exists now.
    fn pick(&mut self) -> Option<(Kind, &'static str, String, Value)> {
        for _ in 0..4 {
            if self.names.is_empty() {
                return None;
            }
            let (kind, ns, name) = self.names[self.rng.below(self.names.len())].clone();
            if let Some(obj) = self.get(kind, ns, &name) {
                return Some((kind, ns, name, obj));
            }
        }
        None
    }

    /// Deletes the Widget CRD (the API server deletes its objects) or creates it again.
    fn toggle_crd(&mut self) {
        if self.crd {
            self.api.delete_crd(GROUP, "widgets");
        } else {
            self.api
                .install_crd(GROUP, self.widget_version, "Widget", "widgets", true);
        }
        self.crd = !self.crd;
    }

    /// One random change; false when there was nothing to change.
    fn change(&mut self) -> bool {
        let roll = self.rng.below(100);
        if roll < 25 || self.names.len() < 4 {
            self.create();
            return true;
        }
        let Some((kind, ns, name, mut obj)) = self.pick() else {
            return false;
        };
        self.counter += 1;
        match roll {
            // An update of what every route publishes.
            25..=49 => {
                match kind {
                    Kind::ConfigMap => obj["data"] = json!({"v": self.counter.to_string()}),
                    Kind::Widget => obj["spec"] = json!({"v": self.counter}),
                }
                self.api.update(obj);
            }
            // A metadata-only update (`publish_if` holds it back).
            50..=59 => {
                obj["metadata"]["annotations"] = json!({"touch": self.counter.to_string()});
                self.api.update(obj);
            }
            // A relabel: the ConfigMap leaves or enters the filter.
            60..=74 => {
                let team = obj["metadata"]["labels"]["team"].as_str() == Some("a");
                obj["metadata"]["labels"]["team"] = json!(if team { "b" } else { "a" });
                obj["metadata"]["labels"]["model"] = json!("yes");
                self.api.update(obj);
            }
            75..=89 => {
                self.api
                    .delete(&self.api_version(kind), Self::kind_name(kind), ns, &name);
            }
            // Deleted and recreated under the same name: a new uid.
            _ => {
                self.api
                    .delete(&self.api_version(kind), Self::kind_name(kind), ns, &name);
                let obj = self.fresh(kind, ns, &name);
                self.api.create(obj);
            }
        }
        true
    }
}

/// The replicas: the first started leads; a restart stops the leader (a graceful handover:
/// drained, checkpoints written, lease released) and starts a new standby. In sharded cases
/// they share the shards, and handovers stop any of them.
struct Replicas {
    streams: Arc<Streams>,
    apps: Vec<(String, Run, RunningApp)>,
    started: usize,
    peak: Arc<AtomicI64>,
    samplers: Vec<tokio::task::JoinHandle<()>>,
    stopping: Vec<tokio::task::JoinHandle<kube_event_bridge::app::Report>>,
}

impl Replicas {
    async fn start_one(&mut self, api: &ApiServer, run: Run) {
        let identity = format!("r{}", self.started);
        self.started += 1;
        let app = RunningApp::start(config(&self.streams, &identity, run), api).await;
        let (metrics, peak) = (app.metrics.clone(), self.peak.clone());
        self.samplers.push(tokio::spawn(async move {
            loop {
                use prometheus::core::Collector;
                let held: i64 = metrics
                    .listener_buffered
                    .collect()
                    .iter()
                    .flat_map(|f| f.get_metric())
                    .map(|m| m.get_gauge().get_value() as i64)
                    .sum();
                peak.fetch_max(held, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
        self.apps.push((identity, run, app));
    }

    fn leader(&self) -> Option<usize> {
        self.apps
            .iter()
            .position(|(_, _, a)| a.metrics.leader.get() == 1)
    }

    /// Stops replica `i` in the background (changes go on while it drains and hands over).
    fn stop_one(&mut self, i: usize) {
        let (_, _, app) = self.apps.remove(i);
        self.stopping.push(tokio::spawn(app.stop()));
    }

    /// Stops the leader and starts a new standby.
    async fn restart(&mut self, api: &ApiServer) {
        self.stop_one(self.leader().unwrap_or(0));
        self.start_one(api, Run::SINGLE).await;
    }

    async fn stop(mut self) {
        for s in &self.samplers {
            s.abort();
        }
        for (_, _, app) in self.apps.drain(..) {
            let report = app.stop().await;
            assert!(report.undelivered.is_empty(), "{report:?}");
        }
        for stop in self.stopping.drain(..) {
            let report = stop.await.unwrap();
            assert!(report.undelivered.is_empty(), "{report:?}");
        }
    }
}

/// A sharded case's run settings for a new replica at shard count `shards`: lease timings
/// picked at random (3 s / 2 s or 4 s / 3 s), so that replicas with different ones meet.
fn sharded_run(rng: &mut Rng, shards: u32) -> Run {
    let (lease_duration, renew_deadline) = if rng.chance(50) {
        ("3s", "2s")
    } else {
        ("4s", "3s")
    };
    Run {
        shards,
        lease_duration,
        renew_deadline,
    }
}

/// One shard handover of a sharded case (operations 72..=84 of [`run_case`]'s roll).
async fn handover(
    roll: usize,
    model: &mut Model,
    replicas: &mut Replicas,
    shards: &mut u32,
    outcome: &mut Outcome,
) {
    let before: Vec<(String, u32)> = replicas
        .apps
        .iter()
        .map(|(id, run, _)| (id.clone(), run.shards))
        .collect();
    let crd = model.crd;
    handover_once(roll, model, replicas, shards, outcome).await;
    let after: Vec<(String, u32)> = replicas
        .apps
        .iter()
        .map(|(id, run, _)| (id.clone(), run.shards))
        .collect();
    tracing::info!(
        "model handover {roll}: replicas {before:?} -> {after:?}, CRD {crd} -> {}",
        model.crd
    );
}

async fn handover_once(
    roll: usize,
    model: &mut Model,
    replicas: &mut Replicas,
    shards: &mut u32,
    outcome: &mut Outcome,
) {
    match roll {
        // A replica stopped and replaced.
        72..=75 => {
            outcome.restarts += 1;
            let i = model.rng.below(replicas.apps.len());
            replicas.stop_one(i);
            let run = sharded_run(&mut model.rng, *shards);
            replicas.start_one(&model.api, run).await;
        }
        // Scale out (up to four) or in (down to one).
        76..=78 => {
            let n = replicas.apps.len();
            if n < 4 && (n == 1 || model.rng.chance(50)) {
                outcome.scale_outs += 1;
                let run = sharded_run(&mut model.rng, *shards);
                replicas.start_one(&model.api, run).await;
            } else {
                outcome.scale_ins += 1;
                let i = model.rng.below(n);
                replicas.stop_one(i);
            }
        }
        // A rolling update to another shard count: a new replica first, then each old one
        // stopped and replaced, changes going on in between.
        79..=81 => {
            outcome.count_changes += 1;
            let others: Vec<u32> = (1..=3).filter(|m| m != shards).collect();
            *shards = others[model.rng.below(others.len())];
            let run = sharded_run(&mut model.rng, *shards);
            replicas.start_one(&model.api, run).await;
            while let Some(i) = replicas
                .apps
                .iter()
                .position(|(_, r, _)| r.shards != *shards)
            {
                for _ in 0..1 + model.rng.below(4) {
                    outcome.changes += model.change() as usize;
                }
                tokio::time::sleep(Duration::from_millis(model.rng.below(800) as u64)).await;
                replicas.stop_one(i);
                if replicas.apps.len() < 2 {
                    let run = sharded_run(&mut model.rng, *shards);
                    replicas.start_one(&model.api, run).await;
                }
            }
        }
        // The CRD deleted (its Widgets with it), or created again.
        _ => {
            outcome.crd_deletes += model.crd as usize;
            model.toggle_crd();
        }
    }
}

/// Runs one case: see the module docs.
pub async fn run_case(settings: Settings, dir: &Path) -> Outcome {
    let api = ApiServer::start().await;
    api.install_crd(GROUP, "v1beta1", "Widget", "widgets", true);
    let streams = Arc::new(Streams {
        out: dir.join("out.jsonl"),
        quiet: dir.join("quiet.jsonl"),
        life: dir.join("life.jsonl"),
    });
    let mut model = Model {
        api,
        rng: Rng(settings.seed.wrapping_mul(2_654_435_761).max(1)),
        widget_version: "v1beta1",
        crd: true,
        namespaces: if settings.sharded { &SHARDED_NS } else { &[NS] },
        names: Vec::new(),
        next_name: 0,
        incarnations: 0,
        counter: 0,
    };
    for _ in 0..8 {
        model.create();
    }
    let mut replicas = Replicas {
        streams: streams.clone(),
        apps: Vec::new(),
        started: 0,
        peak: Arc::default(),
        samplers: Vec::new(),
        stopping: Vec::new(),
    };
    let mut shards = if settings.sharded {
        2 + model.rng.below(2) as u32
    } else {
        1
    };
    let first = |rng: &mut Rng| {
        if settings.sharded {
            sharded_run(rng, shards)
        } else {
            Run::SINGLE
        }
    };
    let run = first(&mut model.rng);
    replicas.start_one(&model.api, run).await;
    super::wait::until("a leader", Duration::from_secs(10), async || {
        replicas.leader().is_some()
    })
    .await;
    let run = first(&mut model.rng);
    replicas.start_one(&model.api, run).await;
    let mut outcome = Outcome::default();
    for _ in 0..settings.ops {
        outcome.ops += 1;
        let roll = model.rng.below(100);
        match roll {
            72..=84 if settings.sharded => {
                handover(roll, &mut model, &mut replicas, &mut shards, &mut outcome).await;
            }
            0..=79 => {
                // A burst of changes (now and then one past the sinks' cap), now and then
                // with a pause after it.
                let burst = if model.rng.chance(5) {
                    MAX_PENDING * 2
                } else {
                    1 + model.rng.below(4)
                };
                for _ in 0..burst {
                    outcome.changes += model.change() as usize;
                }
                if model.rng.chance(30) {
                    tokio::time::sleep(Duration::from_millis(model.rng.below(60) as u64)).await;
                }
            }
            80..=84 => {
                outcome.restarts += 1;
                replicas.restart(&model.api).await;
            }
            85..=88 => {
                if !model.crd {
                    continue;
                }
                outcome.switches += 1;
                model.widget_version = if model.widget_version == "v1" {
                    "v1beta1"
                } else {
                    "v1"
                };
                model
                    .api
                    .serve_crd_at(GROUP, "widgets", model.widget_version);
            }
            89..=93 => {
                outcome.discovery_faults += 1;
                // Shorter than the grace: a failure or a gap is not an answer.
                let hide = model.rng.chance(50);
                if hide {
                    model.api.hide_from_discovery(GROUP, true);
                } else {
                    model.api.fail_discovery(GROUP, true);
                }
                tokio::time::sleep(Duration::from_millis(200 + model.rng.below(1200) as u64)).await;
                model.api.hide_from_discovery(GROUP, false);
                model.api.fail_discovery(GROUP, false);
            }
            _ => {
                outcome.watch_410s += 1;
                model.api.compact();
                model.api.drop_watches();
            }
        }
    }
    // Quiescence: the owners have published everything and written their checkpoints (in
    // sharded cases after the last handovers' takeover waits).
    let check = || check(&model, &streams);
    let mut last = check();
    for _ in 0..if settings.sharded { 240 } else { 120 } {
        if last.nothing_lost() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        last = check();
    }
    // Nothing more arrives that changes the verdict.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last = check();
    let peak = replicas.peak.load(Ordering::Relaxed);
    replicas.stop().await;
    Outcome {
        messages: last.messages,
        lost_deletes: last.lost_deletes,
        phantom_deletes: last.phantom_deletes,
        stale: last.stale,
        missing: last.missing,
        duplicates: last.duplicates,
        peak_held: peak,
        incarnations: model.incarnations,
        ..outcome
    }
}

/// What the consumers of each stream end with, against the API server.
fn check(model: &Model, streams: &Streams) -> Outcome {
    let live_cms = model.api.objects("v1", "ConfigMap");
    let live_widgets = if model.crd {
        model
            .api
            .objects(&format!("{GROUP}/{}", model.widget_version), "Widget")
    } else {
        BTreeMap::new()
    };
    let is_member = |key: &str| {
        let (ns, name) = key.split_once('/').unwrap();
        model
            .api
            .get("v1", "ConfigMap", ns, name)
            .is_some_and(|o| o["metadata"]["labels"]["team"] == "a")
    };
    let ours = |key: &str| {
        let ns = key.split_once('/').map_or("", |(ns, _)| ns);
        model.namespaces.contains(&ns)
    };
    let members: BTreeMap<String, (String, String)> = live_cms
        .iter()
        .filter(|(k, _)| ours(k) && is_member(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let all_cms: BTreeMap<String, (String, String)> =
        live_cms.into_iter().filter(|(k, _)| ours(k)).collect();
    let mut o = Outcome::default();
    let mut compare =
        |stream: &Path, kind: &str, live: &BTreeMap<String, (String, String)>, exact: bool| {
            let events: Vec<Value> = super::cloudevent_lines(stream)
                .into_iter()
                .filter(|e| e["k8skind"] == kind)
                .collect();
            o.messages += events.len();
            let mut ids: HashMap<&str, usize> = HashMap::new();
            for e in &events {
                *ids.entry(e["id"].as_str().unwrap_or_default()).or_default() += 1;
            }
            o.duplicates += ids.values().filter(|&&n| n > 1).count();
            let mut folded = super::fold_in_order(&events);
            let mut live = live.clone();
            if !exact {
                // Not every change is published: the incarnation (uid) must match.
                folded.values_mut().flatten().for_each(|s| s.1.clear());
                live.values_mut().for_each(|s| s.1.clear());
            }
            let d = super::differences(&folded, &live);
            let name = |k: &String| {
                format!(
                    "{}:{kind}:{k}",
                    stream.file_name().unwrap().to_string_lossy()
                )
            };
            o.lost_deletes.extend(d.lost_deletes.iter().map(name));
            o.phantom_deletes.extend(d.phantom_deletes.iter().map(name));
            o.stale.extend(d.stale.iter().map(name));
            o.missing.extend(d.missing.iter().map(name));
        };
    compare(&streams.out, "ConfigMap", &members, true);
    compare(&streams.out, "Widget", &live_widgets, true);
    compare(&streams.quiet, "ConfigMap", &members, false);
    compare(&streams.life, "ConfigMap", &all_cms, false);
    o
}
