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
use kube_event_bridge::{
    app::{App, Report},
    config::Config,
    metrics::Metrics,
};
use serde_json::{Value, json};

const MAX_PENDING: usize = 100_000;

fn config(dir: &Path, identity: &str, fast: bool) -> Config {
    let mut le = json!({"enabled": true, "identity": identity, "namespace": "kube-system"});
    if fast {
        le["lease_duration"] = "3s".into();
        le["renew_deadline"] = "2s".into();
        le["retry_period"] = "100ms".into();
    }
    Config::from_value(json!({
        "cluster": "bench",
        "admin": {"address": "127.0.0.1:0"},
        "resources": [{"api_version": "v1", "kind": "ConfigMap"}],
        "sinks": [{"name": "out", "type": "stdout", "max_pending": MAX_PENDING,
                   "stdout": {"path": dir.join(format!("{identity}.jsonl"))}}],
        "routes": [{"resource": "configmap", "sinks": ["out"]}],
        "leader_election": le,
    }))
    .expect("bench config")
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
        let app = App::build(config(dir, identity, fast), api.client())
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
            out: dir.join(format!("{identity}.jsonl")),
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

    async fn stop(self, label: &str) {
        let _ = self.stop.send(());
        let report = self.task.await.expect("app task");
        self.sampler.abort();
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
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
        let undelivered: usize = report.undelivered.values().sum();
        println!(
            "{label} {}: messages {messages}, distinct ids {}, distinct objects {}, most copies of one object {}, \
             peak buffered {} (max_pending {MAX_PENDING}), undelivered at shutdown {undelivered}",
            self.identity,
            ids.len(),
            objects.len(),
            objects.values().max().copied().unwrap_or(0),
            self.peak_buffered.load(Ordering::Relaxed),
        );
    }
}

async fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "{what} did not happen within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
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
            let mut data = serde_json::Map::new();
            // ~960 bytes of JSON per object, as in the report of the bug.
            data.insert("payload".into(), "x".repeat(700).into());
            api.create(json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("config-{i:06}"), "namespace": format!("team-{}", i % 50),
                             "labels": {"app": "bench"}},
                "data": data,
            }));
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
        wait_for("a leader", Duration::from_secs(10), || a.leading()).await;
        let b = Replica::start(&api, dir.path(), "b", true).await;
        tokio::time::sleep(Duration::from_secs(seconds / 3)).await;
        api.refuse_lease_writes_from(Some(a.identity));
        wait_for("the failover", Duration::from_secs(10), || {
            b.leading() && !a.leading()
        })
        .await;
        tokio::time::sleep(Duration::from_secs(seconds - seconds / 3)).await;
        b.stop("two replicas, failover a -> b:").await;
        a.stop("two replicas, failover a -> b:").await;
    });
}
