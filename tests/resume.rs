//! Resume after a restart, with the file sink (its checkpoint is a file beside the output):
//! changes made while the bridge was down are published, exactly those, and unchanged objects
//! are not, also at 10,000 objects.

mod support;

use std::{collections::BTreeMap, path::Path, time::Duration};

use serde_json::{Value, json};
use support::{
    ApiServer, RunningApp,
    config::ConfigBuilder,
    event_type,
    objects::{configmap, typed},
    wait::{self, PATIENCE, Patience},
};

fn messages(out: &Path) -> Vec<Value> {
    support::cloudevent_lines(out)
}

/// `type subject` of a message, with its flags: `deleted ns/a final-state-unknown resumed`.
fn describe(m: &Value) -> String {
    let mut d = format!("{} {}", event_type(m), m["subject"].as_str().unwrap());
    for flag in ["k8sinitial", "k8sfinalstateunknown", "k8sresumed"] {
        if m[flag] == true {
            d.push(' ');
            d.push_str(flag.trim_start_matches("k8s"));
        }
    }
    if m["data"].get("oldObject").is_some() {
        d.push_str(" with-old");
    }
    d
}

/// ConfigMaps to the file sink `out` (its checkpoint beside it).
fn to_file(out: &Path) -> ConfigBuilder {
    ConfigBuilder::new()
        .configmaps()
        .stdout("out", out)
        .route("configmap", &["out"])
}

async fn run_until(api: &ApiServer, out: &Path, total: usize) {
    let app = RunningApp::start(to_file(out).build(), api).await;
    app.synced().await;
    wait::until("the messages", PATIENCE, async || {
        messages(out).len() >= total
    })
    .await;
    // Nothing more arrives.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let report = app.stop().await;
    assert!(report.undelivered.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_publishes_exactly_what_changed_while_down() {
    let api = ApiServer::start().await;
    for i in 0..300 {
        api.create(typed(&configmap("ns", &format!("cm-{i:03}"), "1")));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    run_until(&api, &out, 300).await;
    let first = messages(&out);
    assert_eq!(first.len(), 300);
    assert!(
        first.iter().all(|m| m["k8sinitial"] == true),
        "first start: initial adds"
    );
    assert!(
        dir.path().join("events.jsonl.checkpoint").exists(),
        "the checkpoint is written beside the output"
    );

    // While down: 20 deletes, 20 updates, 20 creates, 5 deleted and recreated.
    let mut want = BTreeMap::new();
    for i in 0..20 {
        let name = format!("cm-{i:03}");
        api.delete("v1", "ConfigMap", "ns", &name);
        want.insert(
            format!("ns/{name}"),
            vec![format!("deleted ns/{name} finalstateunknown resumed")],
        );
    }
    for i in 20..40 {
        let name = format!("cm-{i:03}");
        api.update(typed(&configmap("ns", &name, "2")));
        want.insert(
            format!("ns/{name}"),
            vec![format!("updated ns/{name} resumed")],
        );
    }
    for i in 300..320 {
        let name = format!("cm-{i:03}");
        api.create(typed(&configmap("ns", &name, "1")));
        want.insert(
            format!("ns/{name}"),
            vec![format!("added ns/{name} resumed")],
        );
    }
    for i in 40..45 {
        let name = format!("cm-{i:03}");
        api.delete("v1", "ConfigMap", "ns", &name);
        api.create(typed(&configmap("ns", &name, "3")));
        want.insert(
            format!("ns/{name}"),
            vec![
                format!("deleted ns/{name} finalstateunknown resumed"),
                format!("added ns/{name} resumed"),
            ],
        );
    }
    let expected: usize = want.values().map(Vec::len).sum();
    run_until(&api, &out, 300 + expected).await;
    let after = &messages(&out)[300..];
    let mut got: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in after {
        got.entry(m["subject"].as_str().unwrap().to_owned())
            .or_default()
            .push(describe(m));
    }
    assert_eq!(
        got, want,
        "exactly the changes made while down, in order per object"
    );
    // A deleted object's message is a stub: identity only, from the checkpoint.
    let deleted = after.iter().find(|m| m["subject"] == "ns/cm-000").unwrap();
    let stub = &deleted["data"]["object"];
    assert_eq!(stub["kind"], "ConfigMap");
    assert_eq!(stub["metadata"]["name"], "cm-000");
    assert!(stub["metadata"]["uid"].is_string() && stub.get("data").is_none());

    // And a third start with nothing changed publishes nothing.
    run_until(&api, &out, 300 + expected).await;
    assert_eq!(messages(&out).len(), 300 + expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_unchanged_objects_publish_nothing_after_a_restart() {
    let api = ApiServer::start().await;
    for i in 0..10_000 {
        api.create(typed(&configmap(
            &format!("ns-{}", i % 10),
            &format!("cm-{i:05}"),
            "1",
        )));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    run_until(&api, &out, 10_000).await;
    let config = to_file(&out).build();
    let app = RunningApp::start(config, &api).await;
    app.synced().await;
    let unchanged = || app.unchanged_on_resume("configmap/out");
    wait::until("every object compared", PATIENCE, async || {
        unchanged() == 10_000
    })
    .await;
    api.update(typed(&configmap("ns-3", "cm-00003", "2")));
    wait::until("the live change", PATIENCE, async || {
        messages(&out).len() == 10_001
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    app.stop().await;
    let all = messages(&out);
    assert_eq!(
        all.len(),
        10_001,
        "0 messages for 10,000 unchanged objects, then the change"
    );
    assert_eq!(describe(&all[10_000]), "updated ns-3/cm-00003 with-old");
}

/// Failover with a shared checkpoint (two replicas writing the same file, as two pods share
/// a broker): objects deleted after the leader stopped, before the standby took over, are
/// deleted by the new leader, and unchanged objects are not replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_delivers_the_deletes_made_while_no_replica_led() {
    let api = ApiServer::start().await;
    for i in 0..100 {
        api.create(typed(&configmap("ns", &format!("cm-{i:03}"), "1")));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("events.jsonl");
    let replica = |identity: &str| {
        to_file(&out)
            .fast_leader_election(identity, "100ms")
            .build()
    };
    let one = RunningApp::start(replica("one"), &api).await;
    wait::until("one leads", PATIENCE, async || {
        one.metrics.leader.get() == 1
    })
    .await;
    let two = RunningApp::start(replica("two"), &api).await;
    two.synced().await;
    wait::until("100 published", PATIENCE, async || {
        messages(&out).len() == 100
    })
    .await;
    // Written within a checkpoint interval.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    api.refuse_lease_writes_from(Some("one"));
    wait::until("one steps down", PATIENCE, async || {
        one.metrics.leader.get() == 0
    })
    .await;
    for i in 0..7 {
        api.delete("v1", "ConfigMap", "ns", &format!("cm-{i:03}"));
    }
    api.update(typed(&configmap("ns", "cm-050", "2")));
    wait::until("two leads", PATIENCE, async || {
        two.metrics.leader.get() == 1
    })
    .await;
    wait::until("the gap delivered", PATIENCE, async || {
        messages(&out).len() == 108
    })
    .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    two.stop().await;
    one.stop().await;
    let after: Vec<String> = messages(&out)[100..].iter().map(describe).collect();
    let mut want: Vec<String> = (0..7)
        .map(|i| format!("deleted ns/cm-{i:03} finalstateunknown resumed"))
        .collect();
    want.push("updated ns/cm-050 resumed".into());
    let mut got = after.clone();
    got.sort();
    assert_eq!(
        got, want,
        "only the gap, no replay of the 92 unchanged objects"
    );
}

/// The real binary (as a pod runs it) exporting ConfigMaps from an API test server to a file
/// sink `out`, its checkpoint beside it, written every `checkpoint_interval`.
struct FileBridge {
    _dir: tempfile::TempDir,
    out: std::path::PathBuf,
    cfg: std::path::PathBuf,
    kubeconfig: std::path::PathBuf,
}

impl FileBridge {
    fn new(api: &ApiServer, checkpoint_interval: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("events.jsonl");
        let kubeconfig = api.write_kubeconfig(dir.path());
        let cfg = dir.path().join("config.yaml");
        let config = ConfigBuilder::new()
            .configmaps()
            .sink(json!({"name": "out", "type": "stdout",
                         "checkpoint_interval": checkpoint_interval, "stdout": {"path": out}}))
            .route("configmap", &["out"])
            .value();
        std::fs::write(&cfg, config.to_string()).unwrap();
        Self {
            _dir: dir,
            out,
            cfg,
            kubeconfig,
        }
    }

    /// Starts a process (stop it with SIGKILL, or [`terminate`]).
    fn start(&self) -> std::process::Child {
        std::process::Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"))
            .args(["run", "--config", self.cfg.to_str().unwrap()])
            .env("KUBECONFIG", &self.kubeconfig)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    }
}

/// Stops `child` with SIGTERM (a graceful stop); its exit code.
fn terminate(mut child: std::process::Child) -> Option<i32> {
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap().code()
}

/// SIGKILL under load, then a restart of the real binary: nothing is lost (every object's
/// current state, or its delete, is the last thing published about it) and what the crash
/// re-sends (acknowledged but not yet checkpointed) is counted and printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_then_restart_loses_nothing() {
    let api = std::sync::Arc::new(ApiServer::start().await);
    for i in 0..500 {
        api.create(typed(&configmap("ns", &format!("cm-{i:03}"), "0")));
    }
    let bridge = FileBridge::new(&api, "200ms");
    let (out, start) = (bridge.out.clone(), || bridge.start());
    // Changes all along: updates, deletes, creates, a few recreates.
    let stop_writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = tokio::spawn({
        let (api, stop) = (api.clone(), stop_writing.clone());
        async move {
            let mut round = 1;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for i in (round % 7..500).step_by(7) {
                    let name = format!("cm-{i:03}");
                    match (round + i) % 11 {
                        0 if api.get("v1", "ConfigMap", "ns", &name).is_some() => {
                            api.delete("v1", "ConfigMap", "ns", &name);
                        }
                        _ if api.get("v1", "ConfigMap", "ns", &name).is_none() => {
                            api.create(typed(&configmap("ns", &name, &round.to_string())));
                        }
                        _ => {
                            api.update(typed(&configmap("ns", &name, &round.to_string())));
                        }
                    }
                }
                round += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let mut first = start();
    wait::until("the initial list published", PATIENCE, async || {
        messages(&out).len() >= 500
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    let before_restart = std::fs::read_to_string(&out).unwrap().lines().count();
    tokio::time::sleep(Duration::from_millis(500)).await; // changes while down
    stop_writing.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await.unwrap();

    let second = start();
    // The end state: for every key ever seen, its last message matches the API server.
    let last_by_key = || {
        let mut last: BTreeMap<String, Value> = BTreeMap::new();
        for line in std::fs::read_to_string(&out).unwrap().lines() {
            if let Ok(m) = serde_json::from_str::<Value>(line) {
                last.insert(m["subject"].as_str().unwrap().to_owned(), m);
            }
        }
        last
    };
    let lost = || {
        let mut lost = Vec::new();
        for (key, m) in last_by_key() {
            let name = key.trim_start_matches("ns/");
            let deleted = m["type"].as_str().unwrap().ends_with(".deleted");
            match api.get("v1", "ConfigMap", "ns", name) {
                Some(o) => {
                    let rv = o["metadata"]["resourceVersion"].as_str().unwrap();
                    if deleted || m["k8sresourceversion"] != rv {
                        lost.push(format!(
                            "{key}: last published {} at {}, now at {rv}",
                            m["type"], m["k8sresourceversion"]
                        ));
                    }
                }
                None if !deleted => {
                    lost.push(format!("{key}: deleted, but last published {}", m["type"]))
                }
                None => {}
            }
        }
        lost
    };
    // Checked after the shutdown below.
    let patience = Patience::of(PATIENCE).polling(Duration::from_millis(100));
    wait::within(patience, async || lost().is_empty()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(terminate(second), Some(0));
    let lost = lost();
    assert!(lost.is_empty(), "lost: {lost:#?}");
    let lines: Vec<String> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let mut ids = std::collections::HashMap::<String, usize>::new();
    let mut cut = 0;
    for l in &lines {
        match serde_json::from_str::<Value>(l) {
            Ok(m) => *ids.entry(m["id"].as_str().unwrap().to_owned()).or_default() += 1,
            Err(_) => cut += 1,
        }
    }
    let duplicates: usize = ids.values().map(|n| n - 1).sum();
    println!(
        "SIGKILL under load: {} messages before the restart, {} after; lost 0; \
         duplicates (same id re-sent) {duplicates}; lines cut by the kill {cut}",
        before_restart,
        lines.len() - before_restart
    );
    assert!(cut <= 1, "at most the line being written when killed");
}

/// Objects added and acknowledged less than a checkpoint interval before a SIGKILL, then
/// deleted while no replica runs: their deletes are published after the restart. The
/// checkpoint interval is an hour, so no periodic write happens at all: the keys are known to
/// the restart only because each was written as an intent before its first message was handed
/// over (without that, the restart finds no checkpoint and publishes no delete).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_added_just_before_a_sigkill_and_deleted_while_down_get_their_deletes() {
    let api = ApiServer::start().await;
    for i in 0..20 {
        api.create(typed(&configmap("ns", &format!("old-{i:02}"), "0")));
    }
    let bridge = FileBridge::new(&api, "1h");
    let (out, start) = (bridge.out.clone(), || bridge.start());
    let mut first = start();
    wait::until("the initial list published", PATIENCE, async || {
        messages(&out).len() >= 20
    })
    .await;
    for i in 0..50 {
        api.create(typed(&configmap("ns", &format!("new-{i:02}"), "1")));
    }
    wait::until("the adds published", PATIENCE, async || {
        messages(&out).len() >= 70
    })
    .await;
    first.kill().unwrap(); // SIGKILL, well within the checkpoint interval
    first.wait().unwrap();
    let before = messages(&out).len();
    for i in 0..50 {
        api.delete("v1", "ConfigMap", "ns", &format!("new-{i:02}"));
    }
    api.delete("v1", "ConfigMap", "ns", "old-00");
    let second = start();
    let deleted_last = || {
        let folded = support::fold_in_order(&messages(&out));
        (0..50)
            .map(|i| format!("ns/new-{i:02}"))
            .chain(["ns/old-00".to_owned()])
            .filter(|k| folded.get(k).is_some_and(Option::is_none))
            .count()
    };
    let patience = Patience::of(PATIENCE).polling(Duration::from_millis(100));
    wait::within(patience, async || deleted_last() == 51).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(terminate(second), Some(0));
    let all = messages(&out);
    let after: Vec<String> = all[before..].iter().map(describe).collect();
    assert_eq!(deleted_last(), 51, "after the restart: {after:#?}");
    support::assert_matches_cluster("after the restart", &all, &api.objects("v1", "ConfigMap"));
    // Besides the deletes, at most re-sends of old objects: an intent batch writes only the
    // keys new to the checkpoint, so with no periodic write the old objects are there as the
    // intents of the first sync, acknowledged but not written (re-sent as `synced`: the same
    // version; `updated` where one changed).
    let resent = after
        .iter()
        .filter(|d| {
            (d.starts_with("updated ns/old-") || d.starts_with("synced ns/old-"))
                && d.ends_with(" resumed")
        })
        .count();
    assert_eq!(after.len(), 51 + resent, "{after:#?}");
    println!("after the restart: 51 deletes, {resent} re-sent");
}

/// A bridge pointed at another cluster (a wrong kubeconfig, or two clusters sharing one
/// broker and checkpoint) must not resume from the first cluster's checkpoint: that would
/// delete every object of the first cluster and re-add the second's. The start fails, naming
/// both clusters; the same cluster resumes as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_another_cluster_is_refused_naming_both() {
    let api = ApiServer::start().await;
    for i in 0..3 {
        api.create(typed(&configmap("ns", &format!("cm-{i}"), "1")));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    run_until(&api, &out, 3).await;
    let first = api.cluster_uid();
    api.set_cluster_uid("5d1c-another-cluster");
    let config = to_file(&out).build();
    let client = kube_event_bridge::cluster::client(
        kube::Config::new(api.url().parse().unwrap()),
        &config.kubernetes,
        &Default::default(),
    )
    .unwrap();
    let err = kube_event_bridge::app::App::build(config, client)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(&first)
            && err.contains("5d1c-another-cluster")
            && err.contains("configmap/out"),
        "{err}"
    );
    assert_eq!(messages(&out).len(), 3, "nothing published");
    // Back on the first cluster: a change made meanwhile, and only it, is published.
    api.set_cluster_uid(&first);
    api.update(typed(&configmap("ns", "cm-1", "2")));
    run_until(&api, &out, 4).await;
    let all = messages(&out);
    assert_eq!(all.len(), 4);
    assert_eq!(describe(&all[3]), "updated ns/cm-1 resumed");
}

/// A route over several namespaces resumes each one on its own: while one namespace is
/// forbidden (its informer cannot list), the deletes made while down in the others are
/// published at once, and the forbidden namespace's follow once it may be listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_namespace_holds_back_only_its_own_deletes() {
    let api = ApiServer::start().await;
    for ns in ["a", "b"] {
        for name in ["keep", "gone"] {
            api.create(typed(&configmap(ns, name, "1")));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let config = || {
        ConfigBuilder::new()
            .resource(json!({"name": "configmap", "api_version": "v1", "kind": "ConfigMap", "namespaces": ["a", "b"]}))
            .stdout("out", &out)
            .route("configmap", &["out"])
            .build()
    };
    let first = RunningApp::start(config(), &api).await;
    first.synced().await;
    wait::until("4 published", PATIENCE, async || messages(&out).len() >= 4).await;
    first.stop().await;
    // While down: one object deleted in each namespace, and b becomes forbidden.
    api.delete("v1", "ConfigMap", "a", "gone");
    api.delete("v1", "ConfigMap", "b", "gone");
    api.forbid_in_namespace("configmaps", "b", true);
    let second = RunningApp::start(config(), &api).await;
    wait::until("a's delete", PATIENCE, async || messages(&out).len() >= 5).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got: Vec<String> = messages(&out)[4..].iter().map(describe).collect();
    assert_eq!(
        got,
        ["deleted a/gone finalstateunknown resumed"],
        "a resumed while b waits"
    );
    api.forbid_in_namespace("configmaps", "b", false);
    wait::until("b's delete", Duration::from_secs(40), async || {
        messages(&out).len() >= 6
    })
    .await;
    let all = messages(&out);
    assert_eq!(
        describe(&all[5]),
        "deleted b/gone finalstateunknown resumed"
    );
    second.stop().await;
    support::assert_matches_cluster("after the restart", &all, &api.objects("v1", "ConfigMap"));
}

/// A checkpoint that cannot be read at start is never replaced by a replay without deletes:
/// the route publishes nothing and `/readyz` names it until the checkpoint loads (retried with
/// backoff); then exactly what changed while down is published, deletes included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_checkpoint_holds_the_route_until_it_loads() {
    let api = ApiServer::start().await;
    for i in 0..3 {
        api.create(typed(&configmap("ns", &format!("cm-{i}"), "1")));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    run_until(&api, &out, 3).await;
    api.delete("v1", "ConfigMap", "ns", "cm-0");
    // The checkpoint file cannot be read: a directory stands where it was.
    let checkpoint = dir.path().join("out.jsonl.checkpoint");
    let saved = support::block_checkpoint(&checkpoint);
    let config = to_file(&out).build();
    let app = RunningApp::start(config, &api).await;
    app.synced().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(messages(&out).len(), 3, "nothing published while it waits");
    let (code, body) = support::http_get(app.admin, "/readyz").await;
    assert!(
        code != 200 && body.contains("configmap/out") && body.contains("checkpoint"),
        "{code} {body}"
    );
    let waiting = app
        .metrics
        .checkpoint_waiting
        .with_label_values(&["configmap/out"]);
    assert_eq!(waiting.get(), 1);
    std::fs::rename(&saved, &checkpoint).unwrap();
    wait::until("the delete", Duration::from_secs(40), async || {
        messages(&out).len() >= 4
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let all = messages(&out);
    app.stop().await;
    assert_eq!(waiting.get(), 0);
    let got: Vec<String> = all[3..].iter().map(describe).collect();
    assert_eq!(got, ["deleted ns/cm-0 finalstateunknown resumed"]);
    support::assert_matches_cluster("after the restart", &all, &api.objects("v1", "ConfigMap"));
}
