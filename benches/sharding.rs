//! Sharding at scale: per-replica memory and the bytes the API server sends, for 1, 2 and 4
//! replicas sharing SHARDS shards of the same OBJECTS ConfigMaps (~1 KB each, over 120
//! namespaces), with the API server applying `shardSelector` (server-side) and ignoring it
//! (client-side filtering). Each replica is the release binary with a stdout sink to its own
//! file; a run ends once the replicas have published every object (each once) and hold
//! every shard.
//!
//! Prints, per configuration: each replica's shards, objects published and RSS (current and
//! peak), the mean RSS, the list+watch bytes the API server sent (total and per replica), and
//! the lists begun (first pages) and watches it was asked for: a shard's term lists once.
//!
//! `cargo bench --bench sharding [-- OBJECTS SHARDS] [--namespaced] [--client-side]` (defaults
//! 30000 12; `--client-side`: only the runs where the API server ignores the selector;
//! BENCH_KUBERNETES='{"page_size": 500}' sets the replicas' `kubernetes` section,
//! BENCH_SINK='{"resume": false}' replaces fields of their sink);
//! `--namespaced` lists the 120 namespaces in the resource (`namespaces`): an informer per
//! namespace in every shard, of which only those whose namespace hashes into the shard ask
//! the API server anything.

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::json;
use support::{
    ApiServer,
    config::ConfigBuilder,
    objects::{configmap, typed},
};

const NAMESPACES: usize = 120;

struct Replica {
    child: Child,
    out: PathBuf,
}

impl Replica {
    fn start(dir: &Path, identity: &str, shards: u32, namespaced: bool, kubeconfig: &Path) -> Self {
        let out = dir.join(format!("{identity}.jsonl"));
        let mut resource = json!({"api_version": "v1", "kind": "ConfigMap", "name": "configmap"});
        if namespaced {
            resource["namespaces"] = (0..NAMESPACES).map(namespace).collect();
        }
        let mut sink = json!({"name": "out", "type": "stdout", "stdout": {"path": &out}});
        // BENCH_SINK: JSON whose fields replace the sink's (e.g. `{"resume": false}`).
        if let Ok(j) = std::env::var("BENCH_SINK") {
            let fields: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&j).expect("BENCH_SINK is a JSON object");
            fields.into_iter().for_each(|(k, v)| sink[k] = v);
        }
        let mut config = ConfigBuilder::new();
        // BENCH_KUBERNETES: JSON for the `kubernetes` section (e.g. `{"page_size": 500}`).
        if let Ok(j) = std::env::var("BENCH_KUBERNETES") {
            config = config.kubernetes(serde_json::from_str(&j).expect("BENCH_KUBERNETES is JSON"));
        }
        let config = config
            .resource(resource)
            .sink(sink)
            .route("configmap", &["out"])
            .set(
                "leader_election",
                json!({
                    "enabled": true, "identity": identity, "namespace": "kube-system",
                    "lease_duration": "4s", "renew_deadline": "3s", "retry_period": "250ms",
                }),
            )
            .set("sharding", json!({"shards": shards}))
            .set("admin", json!({"address": "127.0.0.1:0"}))
            .value();
        let cfg = dir.join(format!("{identity}.yaml"));
        std::fs::write(&cfg, config.to_string()).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"))
            .args(["run", "--config", cfg.to_str().unwrap()])
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Self { child, out }
    }

    fn published(&self) -> usize {
        std::fs::read(&self.out)
            .map(|b| b.iter().filter(|&&c| c == b'\n').count())
            .unwrap_or(0)
    }

    /// (current, peak) RSS in MiB.
    fn rss(&self) -> (f64, f64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                .map_or(0.0, |kb| kb / 1024.0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Who holds each shard's lease. One shard is the whole keyspace, led under the base lease
/// name (`kube-event-bridge`, as without sharding); more are `kube-event-bridge-shard-3-of-12`.
fn holders(api: &ApiServer, shards: u32) -> Vec<Option<String>> {
    if shards == 1 {
        return vec![api.lease_holder_of("kube-event-bridge")];
    }
    (0..shards)
        .map(|s| api.lease_holder_of(&format!("kube-event-bridge-shard-{s}-of-{shards}")))
        .collect()
}

/// Namespace `i` (of [`NAMESPACES`]).
fn namespace(i: usize) -> String {
    format!("{:03}-team", i % NAMESPACES)
}

async fn run(objects: usize, shards: u32, replicas: usize, server_side: bool, namespaced: bool) {
    let api = ApiServer::start().await;
    api.set_shard_selectors(server_side);
    let value = "x".repeat(900);
    for i in 0..objects {
        let ns = namespace(i);
        api.create(typed(&configmap(&ns, &format!("cm-{i:06}"), &value)));
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.write_kubeconfig(dir.path());
    let before = api.bytes_sent();
    let started = Instant::now();
    let running: Vec<Replica> = (0..replicas)
        .map(|r| {
            Replica::start(
                dir.path(),
                &format!("replica-{r}"),
                shards,
                namespaced,
                &kubeconfig,
            )
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let published: usize = running.iter().map(Replica::published).sum();
        let held = holders(&api, shards);
        if published >= objects && held.iter().all(Option::is_some) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{published} of {objects} published"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let took = started.elapsed();
    // Let the caches settle (a shard handed on at the start stops its informers).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let bytes = api.bytes_sent() - before;
    let requests = api
        .all_counts()
        .into_iter()
        .filter(|(path, _)| path.ends_with("/configmaps"))
        .fold((0, 0), |(lists, watches), (_, c)| {
            (lists + c.lists_begun, watches + c.watches)
        });
    let held = holders(&api, shards);
    let mode = if server_side {
        "server-side"
    } else {
        "client-side"
    };
    println!(
        "{replicas} replica(s), {mode}: all {objects} published and every shard held after {took:.1?}"
    );
    let mut total_rss = 0.0;
    for (r, replica) in running.iter().enumerate() {
        let id = format!("replica-{r}");
        let owned = held.iter().filter(|h| h.as_deref() == Some(&id)).count();
        let (rss, peak) = replica.rss();
        total_rss += rss;
        println!(
            "  {id}: {owned} shards, {} published, RSS {rss:.0} MiB (peak {peak:.0} MiB)",
            replica.published()
        );
    }
    println!(
        "  mean RSS {:.0} MiB per replica; the API server sent {:.1} MiB of lists and watches ({:.1} MiB per replica): {} lists begun, {} watches",
        total_rss / replicas as f64,
        bytes as f64 / 1048576.0,
        bytes as f64 / 1048576.0 / replicas as f64,
        requests.0,
        requests.1
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let namespaced = std::env::args().any(|a| a == "--namespaced");
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let objects = args.first().and_then(|a| a.parse().ok()).unwrap_or(30_000);
    let shards = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(12);
    println!(
        "sharding bench: {objects} ConfigMaps (~1 KB) over {NAMESPACES} namespaces, {shards} shards{}",
        if namespaced {
            ", the namespaces listed in the resource"
        } else {
            ""
        }
    );
    let modes: &[bool] = if std::env::args().any(|a| a == "--client-side") {
        &[false]
    } else {
        &[true, false]
    };
    for &server_side in modes {
        for replicas in [1, 2, 4] {
            run(objects, shards, replicas, server_side, namespaced).await;
        }
    }
}
