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
            "ops {} (changes {}, restarts {}, version switches {}, discovery faults {}, watch 410s {}), \
             messages {}, lost deletes {}, phantom deletes {}, stale finals {}, missing {}, \
             duplicate ids {}, peak held {} (bound {})",
            self.ops,
            self.changes,
            self.restarts,
            self.switches,
            self.discovery_faults,
            self.watch_410s,
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

fn config(streams: &Streams, identity: &str) -> kube_event_bridge::config::Config {
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
        .fast_leader_election(identity, "100ms")
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
    names: Vec<(Kind, String)>,
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

    fn get(&self, kind: Kind, name: &str) -> Option<Value> {
        self.api
            .get(&self.api_version(kind), Self::kind_name(kind), NS, name)
    }

    fn fresh(&mut self, kind: Kind, name: &str) -> Value {
        self.counter += 1;
        self.incarnations += 1;
        let team = if self.rng.chance(50) { "a" } else { "b" };
        match kind {
            Kind::ConfigMap => json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"namespace": NS, "name": name,
                             "labels": {"model": "yes", "team": team}},
                "data": {"v": self.counter.to_string()},
            }),
            Kind::Widget => {
                let mut w = custom_resource(&self.api_version(kind), "Widget", Some(NS), name);
                w["spec"] = json!({"v": self.counter});
                w
            }
        }
    }

    fn create(&mut self) {
        let kind = if self.rng.chance(60) {
            Kind::ConfigMap
        } else {
            Kind::Widget
        };
        let prefix = if kind == Kind::ConfigMap { "c" } else { "w" };
        let name = format!("{prefix}{}", self.next_name);
        self.next_name += 1;
        let obj = self.fresh(kind, &name);
        self.api.create(obj);
        self.names.push((kind, name));
    }

    /// A random object that exists now.
    fn pick(&mut self) -> Option<(Kind, String, Value)> {
        for _ in 0..4 {
            if self.names.is_empty() {
                return None;
            }
            let (kind, name) = self.names[self.rng.below(self.names.len())].clone();
            if let Some(obj) = self.get(kind, &name) {
                return Some((kind, name, obj));
            }
        }
        None
    }

    /// One random change; false when there was nothing to change.
    fn change(&mut self) -> bool {
        let roll = self.rng.below(100);
        if roll < 25 || self.names.len() < 4 {
            self.create();
            return true;
        }
        let Some((kind, name, mut obj)) = self.pick() else {
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
                    .delete(&self.api_version(kind), Self::kind_name(kind), NS, &name);
            }
            // Deleted and recreated under the same name: a new uid.
            _ => {
                self.api
                    .delete(&self.api_version(kind), Self::kind_name(kind), NS, &name);
                let obj = self.fresh(kind, &name);
                self.api.create(obj);
            }
        }
        true
    }
}

/// The replicas: the first started leads; a restart stops the leader (a graceful handover:
/// drained, checkpoints written, lease released) and starts a new standby.
struct Replicas {
    streams: Arc<Streams>,
    apps: Vec<(String, RunningApp)>,
    started: usize,
    peak: Arc<AtomicI64>,
    samplers: Vec<tokio::task::JoinHandle<()>>,
    stopping: Vec<tokio::task::JoinHandle<kube_event_bridge::app::Report>>,
}

impl Replicas {
    async fn start_one(&mut self, api: &ApiServer) {
        let identity = format!("r{}", self.started);
        self.started += 1;
        let app = RunningApp::start(config(&self.streams, &identity), api).await;
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
        self.apps.push((identity, app));
    }

    fn leader(&self) -> Option<usize> {
        self.apps
            .iter()
            .position(|(_, a)| a.metrics.leader.get() == 1)
    }

    /// Stops the leader in the background (changes go on while it drains and hands over)
    /// and starts a new standby.
    async fn restart(&mut self, api: &ApiServer) {
        let i = self.leader().unwrap_or(0);
        let (_, app) = self.apps.remove(i);
        self.stopping.push(tokio::spawn(app.stop()));
        self.start_one(api).await;
    }

    async fn stop(mut self) {
        for s in &self.samplers {
            s.abort();
        }
        for (_, app) in self.apps.drain(..) {
            let report = app.stop().await;
            assert!(report.undelivered.is_empty(), "{report:?}");
        }
        for stop in self.stopping.drain(..) {
            let report = stop.await.unwrap();
            assert!(report.undelivered.is_empty(), "{report:?}");
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
    replicas.start_one(&model.api).await;
    super::wait::until("a leader", Duration::from_secs(10), async || {
        replicas.leader().is_some()
    })
    .await;
    replicas.start_one(&model.api).await;
    let mut outcome = Outcome::default();
    for _ in 0..settings.ops {
        outcome.ops += 1;
        match model.rng.below(100) {
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
    // Quiescence: the leader has published everything and written its checkpoints.
    let check = || check(&model, &streams);
    let mut last = check();
    for _ in 0..120 {
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
    let live_widgets = model
        .api
        .objects(&format!("{GROUP}/{}", model.widget_version), "Widget");
    let is_member = |key: &str| {
        let (ns, name) = key.split_once('/').unwrap();
        model
            .api
            .get("v1", "ConfigMap", ns, name)
            .is_some_and(|o| o["metadata"]["labels"]["team"] == "a")
    };
    let members: BTreeMap<String, (String, String)> = live_cms
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{NS}/")) && is_member(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let all_cms: BTreeMap<String, (String, String)> = live_cms
        .into_iter()
        .filter(|(k, _)| k.starts_with(&format!("{NS}/")))
        .collect();
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
