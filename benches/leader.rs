//! Leader election at scale, the run of the leader-flood bug: the whole service (App) against
//! the local API test server holding OBJECTS ConfigMaps, stdout sink to a file,
//! `max_pending: 100000`.
//!
//! 1. `one replica`: leader election on with its default timings (renewal every 2 s), for
//!    SECONDS. Each object must be published once; the first release published up to 25
//!    copies of each (one replay per renewal).
//! 2. `two replicas`: fast timings (renewal every 100 ms, lease 3 s); after a third of SECONDS
//!    the leader's renewals are refused, so the other takes over. Each leader must publish each
//!    object once (one replay per leadership change), nothing more.
//!
//! Prints, per replica: messages, distinct ids, distinct objects, most copies of one object,
//! peak of `keb_listener_buffered_notifications` (sampled every 5 ms), undelivered at shutdown.
//!
//! `cargo bench --bench leader [-- OBJECTS SECONDS]` (defaults 50000 25)

#[path = "../tests/support/api_server.rs"]
#[allow(dead_code)]
mod api_server;
#[path = "../tests/support/config.rs"]
mod config;
#[path = "../tests/support/objects.rs"]
mod objects;
#[path = "../tests/support/wait.rs"]
mod wait;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::{Duration, Instant},
};

use api_server::ApiServer;
use config::ConfigBuilder;
use kube_event_bridge::{
    app::{App, Report},
    metrics::Metrics,
};
use objects::{Meta, configmap_with_data, typed};
use serde_json::{Value, json};

const MAX_PENDING: usize = 100_000;

/// ConfigMap `team-{i % 50}/config-{i}` labelled `app: bench`, with `payload` as its data.
fn configmap(i: usize, payload: String) -> Value {
    typed(
        &configmap_with_data(
            &format!("team-{}", i % 50),
            &format!("config-{i:06}"),
            [("payload", payload)],
        )
        .label("app", "bench"),
    )
}

struct Replica {
    identity: &'static str,
    out: PathBuf,
    metrics: Arc<Metrics>,
    peak_buffered: Arc<AtomicI64>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Report>,
    sampler: tokio::task::JoinHandle<()>,
}

impl Replica {
    async fn start(api: &ApiServer, dir: &Path, identity: &'static str, fast: bool) -> Self {
        Self::start_writing(api, &dir.join(format!("{identity}.jsonl")), identity, fast).await
    }

    /// A replica whose sink writes `out` (and its checkpoint beside it).
    async fn start_writing(
        api: &ApiServer,
        out: &Path,
        identity: &'static str,
        fast: bool,
    ) -> Self {
        let config = ConfigBuilder::new()
            .cluster("bench")
            .configmaps()
            .sink(
                json!({"name": "out", "type": "stdout", "max_pending": MAX_PENDING,
                         "stdout": {"path": out}}),
            )
            .route("configmap", &["out"]);
        let config = if fast {
            config.fast_leader_election(identity, "100ms")
        } else {
            config.leader_election(identity)
        };
        let app = App::build(config.build(), api.client())
            .await
            .expect("app builds");
        let metrics = app.metrics().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(app.run(async move {
            let _ = stopped.await;
        }));
        let peak_buffered = Arc::new(AtomicI64::new(0));
        let sampler = tokio::spawn({
            let (gauge, peak) = (
                metrics
                    .listener_buffered
                    .with_label_values(&["configmap", "out"]),
                peak_buffered.clone(),
            );
            async move {
                loop {
                    peak.fetch_max(gauge.get(), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
        Self {
            identity,
            out: out.to_owned(),
            metrics,
            peak_buffered,
            stop,
            task,
            sampler,
        }
    }

    fn leading(&self) -> bool {
        self.metrics.leader.get() == 1
    }

    fn published(&self) -> u64 {
        ["added", "updated", "deleted", "synced"]
            .iter()
            .map(|t| {
                self.metrics
                    .sink_published
                    .with_label_values(&["out", "configmap", t])
                    .get()
            })
            .sum()
    }

    /// Shuts the replica down; returns what it left undelivered.
    async fn shut_down(self) -> usize {
        let _ = self.stop.send(());
        let report = self.task.await.expect("app task");
        self.sampler.abort();
        report.undelivered.values().sum()
    }

    /// Shuts down and prints the figures of the replica's own output file.
    async fn stop(self, label: &str) {
        let (identity, out, peak) = (
            self.identity,
            self.out.clone(),
            self.peak_buffered.load(Ordering::Relaxed),
        );
        let undelivered = self.shut_down().await;
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let (mut ids, mut objects) = (HashMap::new(), HashMap::<String, usize>::new());
        let mut messages = 0;
        for line in text.lines() {
            let m: Value = serde_json::from_str(line).expect("a JSON line");
            messages += 1;
            *ids.entry(m["id"].as_str().unwrap_or_default().to_owned())
                .or_insert(0usize) += 1;
            *objects
                .entry(m["subject"].as_str().unwrap_or_default().to_owned())
                .or_default() += 1;
        }
        println!(
            "{label} {}: messages {messages}, distinct ids {}, distinct objects {}, most copies of one object {}, \
             peak buffered {} (max_pending {MAX_PENDING}), undelivered at shutdown {undelivered}",
            identity,
            ids.len(),
            objects.len(),
            objects.values().max().copied().unwrap_or(0),
            peak,
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let objects: usize = args.first().map_or(50_000, |a| a.parse().expect("OBJECTS"));
    let seconds: u64 = args.get(1).map_or(25, |a| a.parse().expect("SECONDS"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let api = ApiServer::start().await;
        let started = Instant::now();
        for i in 0..objects {
            // ~960 bytes of JSON per object, as in the report of the bug.
            api.create(configmap(i, "x".repeat(700)));
        }
        println!(
            "{objects} ConfigMaps created in the API test server in {:.1} s; each run lasts {seconds} s",
            started.elapsed().as_secs_f64()
        );

        let dir = tempfile::tempdir().expect("tempdir");
        let one = Replica::start(&api, dir.path(), "solo", false).await;
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        one.stop("one replica, default timings:").await;

        let dir = tempfile::tempdir().expect("tempdir");
        let a = Replica::start(&api, dir.path(), "a", true).await;
        wait::until("a leader", Duration::from_secs(10), async || a.leading()).await;
        let b = Replica::start(&api, dir.path(), "b", true).await;
        tokio::time::sleep(Duration::from_secs(seconds / 3)).await;
        api.refuse_lease_writes_from(Some(a.identity));
        wait::until("the failover", Duration::from_secs(10), async || {
            b.leading() && !a.leading()
        })
        .await;
        tokio::time::sleep(Duration::from_secs(seconds - seconds / 3)).await;
        b.stop("two replicas, failover a -> b:").await;
        a.stop("two replicas, failover a -> b:").await;

        // 3. Two replicas sharing one checkpoint (one output file and the checkpoint beside
        //    it, as two pods share a broker): changes made while no replica leads, and
        //    nothing else, come from the new leader.
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("shared.jsonl");
        let c = Replica::start_writing(&api, &out, "c", true).await;
        wait::until("c leads", Duration::from_secs(10), async || c.leading()).await;
        let d = Replica::start_writing(&api, &out, "d", true).await;
        wait::until("c published every object", Duration::from_secs(120), async || {
            c.published() >= objects as u64
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1500)).await; // a checkpoint interval
        let before = std::fs::read_to_string(&out).unwrap_or_default().lines().count();
        api.refuse_lease_writes_from(Some(c.identity));
        wait::until("c steps down", Duration::from_secs(10), async || !c.leading()).await;
        let changes = (objects / 50).max(2);
        for i in 0..changes / 2 {
            api.delete("v1", "ConfigMap", &format!("team-{}", i % 50), &format!("config-{i:06}"));
        }
        for i in changes / 2..changes {
            api.update(configmap(i, "changed".into()));
        }
        wait::until("d leads", Duration::from_secs(10), async || d.leading()).await;
        wait::until("the gap published", Duration::from_secs(60), async || {
            d.published() >= changes as u64
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let unchanged = d
            .metrics
            .resume_objects
            .with_label_values(&["configmap/out", "unchanged"])
            .get();
        let (d_published, d_peak) = (d.published(), d.peak_buffered.load(Ordering::Relaxed));
        let undelivered = d.shut_down().await + c.shut_down().await;
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let after: Vec<Value> = text
            .lines()
            .skip(before)
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        let mut ids = HashMap::<String, usize>::new();
        for m in &after {
            *ids.entry(m["id"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
        }
        let deletes = after
            .iter()
            .filter(|m| m["type"].as_str().is_some_and(|t| t.ends_with(".deleted")))
            .count();
        println!(
            "shared checkpoint, failover c -> d: {changes} changes while no replica led ({} deletes, {} updates); \
             the new leader published {d_published} messages ({deletes} deletes, {} repeated ids), compared {unchanged} \
             objects as unchanged, peak buffered {d_peak}, undelivered at shutdown {undelivered}",
            changes / 2,
            changes - changes / 2,
            ids.values().filter(|n| **n > 1).count(),
        );
    });
}
