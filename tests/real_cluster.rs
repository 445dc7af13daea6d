//! The service binary against a real kube-apiserver v1.36 and etcd 3.6 (tests/support/
//! cluster.rs), with client-go's own informer beside it as the reference: what each ends
//! with is folded per key in message order and compared with the API server (lost deletes,
//! phantom deletes, stale finals, missing, duplicates), and the stream is compared with
//! client-go's, notification by notification.

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    time::Duration,
};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DeleteParams, PostParams};
use serde_json::{Value, json};
use support::{
    Differences,
    cluster::{Cluster, ClusterOptions, ReferenceInformer},
    config::ConfigBuilder,
    delivered, event_type, json_lines,
    objects::{configmap, configmaps},
    parity::{
        Comparison, Rng, bridge, bridge_seen, client_go_seen, fsu, ready, seed, settle, workload,
    },
    replica::Replica,
    wait::{self, Patience},
};

/// The parity scenario: client-go's informer and the bridge watch one namespace of a real
/// cluster while a seeded workload creates, updates and deletes; then a gap (the API server
/// SIGKILLed, objects deleted straight in etcd, history compacted, so both watches get 410
/// and relist), then more changes. Per key they must see the same versions (ratio ≥ 0.99),
/// end with the same final state (the API server's), and both mark every gap delete final
/// state unknown.
async fn parity(options: ClusterOptions, streaming_list: bool) {
    let seed = seed();
    eprintln!(
        "seed {seed} (KEB_SEED replays it), options {options:?}, streaming list {streaming_list}"
    );
    let mut rng = Rng(seed);
    let mut cluster = Cluster::start_with(options.clone()).await;
    let version: Value = serde_json::from_str(
        &cluster
            .client()
            .await
            .request_text(http::Request::get("/version").body(Vec::new()).unwrap())
            .await
            .unwrap(),
    )
    .unwrap();
    eprintln!(
        "kube-apiserver {} (emulating {}.{}) ready in {:?}",
        version["gitVersion"],
        version["emulationMajor"].as_str().unwrap_or("-"),
        version["emulationMinor"].as_str().unwrap_or("-"),
        cluster.last_start
    );
    if let Some(emulated) = &options.emulated_version {
        let (major, minor) = emulated.split_once('.').unwrap();
        assert_eq!(
            (
                version["emulationMajor"].as_str(),
                version["emulationMinor"].as_str()
            ),
            (Some(major), Some(minor)),
            "the server emulates {emulated}"
        );
    }
    let ns = "parity";
    cluster.create_namespace(ns).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let reference =
        ReferenceInformer::start(&kubeconfig, dir.path(), ("", "v1", "configmaps"), Some(ns));
    let replica = bridge(dir.path(), ns, &kubeconfig, streaming_list, 1_000_000);
    reference.synced().await;
    ready(&replica).await;

    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    workload(&api, ns, &mut rng, 80, 400).await;

    // The gap: a quarter of the live objects deleted straight in etcd while the API server
    // is down, history compacted past everything both watches saw.
    let live = settle(
        &cluster,
        ns,
        &reference,
        dir.path(),
        Duration::from_secs(90),
    )
    .await;
    cluster.kill_apiserver();
    let gap_deletes: BTreeSet<String> =
        live.keys().filter(|_| rng.below(4) == 0).cloned().collect();
    for key in &gap_deletes {
        cluster.etcd_delete(&format!("/registry/configmaps/{key}"));
    }
    cluster.etcd_compact();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.start_apiserver().await;
    eprintln!(
        "gap: {} objects deleted in etcd; kube-apiserver ready again in {:?}",
        gap_deletes.len(),
        cluster.last_start
    );
    // Both relist (their watches get 410) before the next changes, so that what each lists
    // is the same state: a delete and re-create racing a relist is where the two differ on
    // purpose (client-go gives one `updated` across incarnations, the bridge `deleted` then
    // `added`; docs/src/concepts.md).
    wait::until(
        "both informers relisted and inferred the gap deletes",
        Patience::of(Duration::from_secs(90)).polling(Duration::from_millis(200)),
        async || {
            let bridge = bridge_seen(&json_lines(&dir.path().join("bridge.jsonl")));
            fsu(&client_go_seen(&reference.lines())).is_superset(&gap_deletes)
                && fsu(&bridge).is_superset(&gap_deletes)
        },
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    workload(&api, ns, &mut rng, 80, 400).await;

    let want = settle(
        &cluster,
        ns,
        &reference,
        dir.path(),
        Duration::from_secs(90),
    )
    .await;
    // Anything late would show in the next second.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let events = json_lines(&dir.path().join("bridge.jsonl"));
    let c = Comparison::of(&events, &reference.lines(), &want);
    eprintln!("parity: {c} (gap deletes {})", gap_deletes.len());
    c.print_differing_keys(5);
    assert!(
        c.differences.is_empty(),
        "the bridge's stream folds to the server's objects"
    );
    assert_eq!(c.duplicates, 0, "no message id twice");
    assert!(c.same_finals, "identical finals per key");
    assert!(
        c.ratio >= 0.99,
        "versions seen bridge/client-go {}",
        c.ratio
    );
    assert_eq!(
        c.keys_differing, 0,
        "per key, the same notifications in the same order"
    );
    assert_eq!(
        c.fsu_client_go, gap_deletes,
        "client-go marks the gap deletes"
    );
    assert_eq!(
        c.fsu_bridge, gap_deletes,
        "the bridge marks the gap deletes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_sees_what_client_go_sees_across_a_compacted_gap() {
    parity(ClusterOptions::default(), false).await;
}

/// The same with the bridge's initial state from a streaming watch-list
/// (`sendInitialEvents`), as client-go 0.36 lists by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_sees_what_client_go_sees_with_a_streaming_list() {
    parity(ClusterOptions::default(), true).await;
}

/// The same against the oldest Kubernetes release the docs support (1.33: the API the
/// service is built against), emulated by the same v1.36 binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_sees_what_client_go_sees_on_the_oldest_supported_release() {
    parity(
        ClusterOptions {
            emulated_version: Some("1.33".into()),
            ..Default::default()
        },
        false,
    )
    .await;
}

const GROUP: &str = "shop.example.org";

/// A replica of the bridge with `resources`, each routed to a stdout sink writing
/// `dir/out.jsonl` (no checkpoint), and the `kubernetes` section `kubernetes`.
fn file_bridge(dir: &Path, resources: Value, kubernetes: Value) -> Replica {
    let config = ConfigBuilder::new()
        .grace_period("5s")
        .kubernetes(kubernetes)
        .resources(resources)
        .sink(json!({
            "name": "out", "type": "stdout", "stdout": {"path": dir.join("out.jsonl")},
            "resume": false,
        }))
        .route_each_resource_to(&["out"])
        .value();
    Replica::start(dir, "bridge", &config, &dir.join("admin.kubeconfig"))
}

/// A Gadget of `GROUP` at `version`, `ns/name`, with `spec.size`.
fn gadget(version: &str, ns: &str, name: &str, size: u64) -> Value {
    json!({
        "apiVersion": format!("{GROUP}/{version}"), "kind": "Gadget",
        "metadata": {"namespace": ns, "name": name}, "spec": {"size": size},
    })
}

/// A GitOps rollout: the bridge starts before the CRD of a kind it exports, exports the
/// built-ins at once and waits for the kind; once the CRD is installed (on the real server:
/// established a moment after it is created, served a moment after that) its objects are
/// delivered, each once; when the CRD is deleted (the API server's finalizer deletes its
/// objects first), each object's delete is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_installed_after_the_start_is_followed_and_its_deletion_delivers_the_deletes() {
    let cluster = Cluster::start().await;
    cluster.create_namespace("crd-later").await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(cluster.kubeconfig(), dir.path().join("admin.kubeconfig")).unwrap();
    cluster
        .create(
            "configmaps",
            serde_json::to_value(configmap("crd-later", "cm", "1")).unwrap(),
        )
        .await;
    let replica = file_bridge(
        dir.path(),
        json!([
            {"name": "configmap", "api_version": "v1", "kind": "ConfigMap", "namespaces": ["crd-later"]},
            {"name": "gadget", "api_version": format!("{GROUP}/v1"), "kind": "Gadget"},
        ]),
        json!({"discovery_refresh": "1h", "discovery_grace": "1s"}),
    );
    wait::until(
        "the ConfigMap",
        Patience::of(Duration::from_secs(60)),
        async || delivered(&dir.path().join("out.jsonl")).contains_key("ConfigMap crd-later/cm"),
    )
    .await;
    let (code, body) = support::http_get(replica.admin().unwrap(), "/readyz").await;
    assert_eq!(code, 200, "a pending kind does not hold readiness: {body}");

    cluster
        .install_crd(GROUP, "Gadget", "gadgets", true, &[("v1", true)])
        .await;
    for i in 0..20 {
        cluster
            .create("gadgets", gadget("v1", "crd-later", &format!("g{i:02}"), i))
            .await;
    }
    // 90 s: once, under a CI run's load, 60 s passed without every Gadget (the log is dumped
    // if it happens again).
    let every_gadget = wait::within(Patience::of(Duration::from_secs(90)), async || {
        let d = delivered(&dir.path().join("out.jsonl"));
        (0..20).all(|i| d.contains_key(&format!("Gadget crd-later/g{i:02}")))
    })
    .await;
    if !every_gadget {
        support::replica::dump(std::slice::from_ref(&replica));
        panic!(
            "not every Gadget was delivered: {:?}",
            delivered(&dir.path().join("out.jsonl"))
                .keys()
                .collect::<Vec<_>>()
        );
    }

    cluster.delete_crd(GROUP, "gadgets").await;
    wait::until(
        "every Gadget's delete",
        Patience::of(Duration::from_secs(60)),
        async || {
            let d = delivered(&dir.path().join("out.jsonl"));
            (0..20).all(|i| {
                d[&format!("Gadget crd-later/g{i:02}")]
                    .last()
                    .map(String::as_str)
                    == Some("deleted")
            })
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let d = delivered(&dir.path().join("out.jsonl"));
    println!(
        "CRD after the start: {:?}",
        d.iter()
            .map(|(k, v)| format!("{k}: {}", v.join(",")))
            .collect::<Vec<_>>()
    );
    assert_eq!(d["ConfigMap crd-later/cm"], ["added"]);
    for i in 0..20 {
        assert_eq!(
            d[&format!("Gadget crd-later/g{i:02}")],
            ["added", "deleted"],
            "g{i:02}"
        );
    }
}

/// A CRD whose preferred version moves (v1beta1 → v1, both served, then v1beta1 no longer
/// served) under a group wildcard on the real server: the same objects are followed at the
/// new version; nothing is deleted or added again, and later changes come at v1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_version_change_under_a_wildcard_deletes_nothing() {
    let cluster = Cluster::start().await;
    cluster.create_namespace("versions").await;
    cluster
        .install_crd(GROUP, "Gadget", "gadgets", true, &[("v1beta1", true)])
        .await;
    const N: u64 = 50;
    for i in 0..N {
        cluster
            .create(
                "gadgets",
                gadget("v1beta1", "versions", &format!("g{i:02}"), i),
            )
            .await;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(cluster.kubeconfig(), dir.path().join("admin.kubeconfig")).unwrap();
    let mut replica = file_bridge(
        dir.path(),
        json!([{"name": "shop", "api_version": format!("{GROUP}/*"), "kind": "*"}]),
        json!({"discovery_refresh": "1s", "discovery_grace": "1s"}),
    );
    wait::until(
        "every Gadget",
        Patience::of(Duration::from_secs(60)),
        async || delivered(&dir.path().join("out.jsonl")).len() == N as usize,
    )
    .await;

    // v1 joins and, sorting before v1beta1, becomes the preferred version; then v1beta1 goes.
    cluster
        .install_crd(
            GROUP,
            "Gadget",
            "gadgets",
            true,
            &[("v1beta1", true), ("v1", true)],
        )
        .await;
    let gadgets = ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(GROUP, "v1", "Gadget"),
        "gadgets",
    );
    let api: Api<kube::api::DynamicObject> =
        Api::namespaced_with(cluster.client().await, "versions", &gadgets);
    api.delete("g05", &DeleteParams::default()).await.unwrap();
    wait::until(
        "the bridge follows the kind at v1",
        Patience::of(Duration::from_secs(60)),
        async || {
            replica.log().lines().any(|l| {
                l.contains("The kind is served at another version now") && l.contains("to=v1 ")
            })
        },
    )
    .await;
    cluster
        .install_crd(
            GROUP,
            "Gadget",
            "gadgets",
            true,
            &[("v1beta1", false), ("v1", true)],
        )
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut g0 = api.get("g00").await.unwrap();
    g0.data["spec"]["size"] = json!(100);
    api.replace("g00", &PostParams::default(), &g0)
        .await
        .unwrap();
    wait::until(
        "the update at v1",
        Patience::of(Duration::from_secs(60)),
        async || {
            delivered(&dir.path().join("out.jsonl"))
                .get("Gadget versions/g00")
                .is_some_and(|t| t.len() == 2)
        },
    )
    .await;
    // Stopped before the last read, so that nothing late escapes it.
    replica.terminate();
    let d = delivered(&dir.path().join("out.jsonl"));
    let messages: usize = d.values().map(Vec::len).sum();
    println!(
        "version change: {N} objects, {messages} messages (expected {})",
        N + 2
    );
    assert_eq!(d["Gadget versions/g00"], ["added", "updated"]);
    assert_eq!(d["Gadget versions/g05"], ["added", "deleted"]);
    for i in (1..N).filter(|&i| i != 5) {
        assert_eq!(
            d[&format!("Gadget versions/g{i:02}")],
            ["added"],
            "nothing deleted or added again"
        );
    }
    let last = json_lines(&dir.path().join("out.jsonl")).pop().unwrap();
    assert_eq!(last["data"]["object"]["apiVersion"], format!("{GROUP}/v1"));
}

/// Every namespaced kind of the cluster (`api_version: "*"`) while the API server is
/// SIGKILLed and started again three times, with changes between: discovery fails while it
/// is down and may be partial right after a start (aggregated discovery, CRDs served a moment
/// later), and none of that may delete a live object. Folded per object, the stream ends with
/// the server's objects; no delete of an object that is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_api_server_restarts_under_a_wildcard_delete_nothing_live() {
    let mut cluster = Cluster::start().await;
    let ns = "restarts";
    cluster.create_namespace(ns).await;
    cluster
        .install_crd(GROUP, "Gadget", "gadgets", true, &[("v1", true)])
        .await;
    for i in 0..20 {
        cluster
            .create(
                "configmaps",
                serde_json::to_value(configmap(ns, &format!("cm{i:02}"), "1")).unwrap(),
            )
            .await;
        cluster
            .create("gadgets", gadget("v1", ns, &format!("g{i:02}"), i))
            .await;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(cluster.kubeconfig(), dir.path().join("admin.kubeconfig")).unwrap();
    let mut replica = file_bridge(
        dir.path(),
        json!([{"name": "all", "api_version": "*", "kind": "*", "scope": "namespaced",
                "namespaces": [ns]}]),
        json!({"discovery_refresh": "1s", "discovery_grace": "2s"}),
    );
    wait::until(
        "every object",
        Patience::of(Duration::from_secs(60)),
        async || {
            let d = delivered(&dir.path().join("out.jsonl"));
            (0..20).all(|i| {
                d.contains_key(&format!("Gadget {ns}/g{i:02}"))
                    && d.contains_key(&format!("ConfigMap {ns}/cm{i:02}"))
            })
        },
    )
    .await;
    let cms: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    for round in 0..3u64 {
        cluster.kill_apiserver();
        tokio::time::sleep(Duration::from_secs(3)).await;
        cluster.start_apiserver().await;
        println!("restart {round}: ready in {:?}", cluster.last_start);
        let cms: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
        cms.replace(
            &format!("cm{round:02}"),
            &PostParams::default(),
            &configmap(ns, &format!("cm{round:02}"), "2"),
        )
        .await
        .unwrap();
        cms.delete(&format!("cm1{round}"), &DeleteParams::default())
            .await
            .unwrap();
        // Longer than discovery_grace, so that a kind judged gone would have been stopped.
        tokio::time::sleep(Duration::from_secs(4)).await;
    }
    drop(cms);
    // Settled: the stream folds to the server's objects of both kinds.
    let gadgets = ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(GROUP, "v1", "Gadget"),
        "gadgets",
    );
    let kinds = [("ConfigMap", configmaps()), ("Gadget", gadgets)];
    let mut want = Vec::new();
    for (kind, resource) in &kinds {
        want.push((*kind, cluster.objects(resource, Some(ns)).await));
    }
    // Each kind's messages folded in order, against its objects.
    let compare = |events: &[Value]| support::compare_kinds(events, &want);
    wait::until(
        "the stream folds to the server's objects",
        Patience::of(Duration::from_secs(60)),
        async || compare(&json_lines(&dir.path().join("out.jsonl"))).is_empty(),
    )
    .await;
    // Stopped before the last read, so that nothing late escapes it.
    replica.terminate();
    let events = json_lines(&dir.path().join("out.jsonl"));
    let d = compare(&events);
    let deletes = events.iter().filter(|e| event_type(e) == "deleted").count();
    let relisted_adds = delivered(&dir.path().join("out.jsonl"))
        .values()
        .filter(|t| t.iter().filter(|t| *t == "added").count() > 1)
        .count();
    println!(
        "3 restarts: {} messages, {deletes} deletes (3 made), objects added twice {relisted_adds}, {}",
        events.len(),
        d.counts()
    );
    assert!(d.is_empty(), "{d}");
    assert_eq!(deletes, 3, "only the deletes made");
    assert_eq!(relisted_adds, 0, "nothing added again");
    // Exactly the changes made, nothing re-published by a relist or a discovery blip.
    let d = delivered(&dir.path().join("out.jsonl"));
    for i in 0..20 {
        let want: &[&str] = match i {
            0..3 => &["added", "updated"],
            10..13 => &["added", "deleted"],
            _ => &["added"],
        };
        assert_eq!(d[&format!("ConfigMap {ns}/cm{i:02}")], want, "cm{i:02}");
        assert_eq!(d[&format!("Gadget {ns}/g{i:02}")], ["added"], "g{i:02}");
    }
}

/// Where a resume or failover scenario publishes, and how a consumer reads it back.
enum Destination {
    JetStream(support::nats::NatsServer),
    Kafka(&'static support::kafka::Kafka, String),
}

impl Destination {
    fn jetstream() -> Self {
        Self::JetStream(support::nats::NatsServer::start())
    }

    /// The shared Kafka node, with a topic of this scenario's own (`{cluster}` names it).
    fn kafka(cluster: &str) -> Self {
        let kafka = support::kafka::Kafka::shared();
        let topic = format!("k8s.{cluster}.core.configmaps");
        kafka.create_topic(&topic, 3);
        Self::Kafka(kafka, topic)
    }

    fn sink(&self) -> Value {
        match self {
            Self::JetStream(nats) => support::config::nats_sink("out", &nats.url(), json!({})),
            Self::Kafka(kafka, topic) => support::config::kafka_sink(
                "out",
                &kafka.brokers(),
                json!({"topic": topic, "checkpoint_topic": format!("{topic}.checkpoints")}),
            ),
        }
    }

    /// Every message the destination holds, in its order (per key: the order a consumer
    /// reads).
    async fn read(&self) -> Vec<Value> {
        match self {
            Self::JetStream(nats) => {
                support::nats::read_stream(&nats.url(), support::config::NATS_STREAM)
                    .await
                    .iter()
                    .map(|m| serde_json::from_slice(&m.payload).unwrap())
                    .collect()
            }
            Self::Kafka(kafka, topic) => {
                let (brokers, topic) = (kafka.brokers(), topic.clone());
                tokio::task::spawn_blocking(move || {
                    support::kafka::consume_all(&brokers, &topic, 3)
                        .iter()
                        .map(|r| r.json())
                        .collect()
                })
                .await
                .unwrap()
            }
        }
    }
}

/// A bridge replica `identity` of cluster `cluster_name` watching ConfigMaps in `ns`,
/// publishing to `sink`, with the tests' fast leader election when `leader`.
fn replica_to(
    dir: &Path,
    identity: &str,
    cluster_name: &str,
    ns: &str,
    sink: &Value,
    leader: bool,
    kubeconfig: &Path,
) -> Replica {
    let mut config = ConfigBuilder::new()
        .cluster(cluster_name)
        .grace_period("5s")
        .resource(json!({"api_version": "v1", "kind": "ConfigMap", "namespaces": [ns]}))
        .sink(sink.clone())
        .route("configmap", &[sink["name"].as_str().unwrap()]);
    if leader {
        config = config.fast_leader_election(identity, "200ms");
    }
    Replica::start(dir, identity, &config.value(), kubeconfig)
}

/// Restart with resume against the real API server: the bridge publishes 40 ConfigMaps, is
/// stopped (SIGTERM, or SIGKILL), and while it is down 10 are deleted, 10 updated, 10
/// created and 5 deleted and re-created; after the restart exactly those changes arrive
/// (marked resumed, the deletes final state unknown), the 15 unchanged objects are not
/// replayed, and the destination folds to the API server's objects.
async fn resume(destination: Destination, kill: bool, cluster_name: &str) {
    let cluster = Cluster::start().await;
    let ns = "resume";
    cluster.create_namespace(ns).await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    let name = |i: usize| format!("cm-{i:02}");
    for i in 0..40 {
        api.create(&PostParams::default(), &configmap(ns, &name(i), "1"))
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let sink = destination.sink();
    let mut first = replica_to(
        dir.path(),
        "first",
        cluster_name,
        ns,
        &sink,
        false,
        &kubeconfig,
    );
    ready(&first).await; // its sink opened: the stream or topic exists
    wait::until(
        "the 40 objects published",
        Patience::of(Duration::from_secs(60)),
        async || destination.read().await.len() >= 40,
    )
    .await;
    // Every acknowledged message in the checkpoint (`keb_checkpoint_lag` 0 after 40
    // acknowledgements), so that a SIGKILL finds the acknowledged state written.
    wait::until(
        "the 40 acknowledged objects checkpointed",
        Patience::of(Duration::from_secs(60)),
        async || {
            let Some(admin) = first.admin() else {
                return false;
            };
            let lag = support::metric_sum(admin, "keb_checkpoint_lag").await;
            first.published().await >= 40 && lag == 0.0
        },
    )
    .await;
    if kill {
        first.signal("KILL");
        let _ = first.child.wait();
    } else {
        first.terminate();
    }
    let before = destination.read().await;

    let mut want: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for i in 0..10 {
        api.delete(&name(i), &DeleteParams::default())
            .await
            .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["deleted"]);
    }
    for i in 10..20 {
        api.replace(
            &name(i),
            &PostParams::default(),
            &configmap(ns, &name(i), "2"),
        )
        .await
        .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["updated"]);
    }
    for i in 40..50 {
        api.create(&PostParams::default(), &configmap(ns, &name(i), "1"))
            .await
            .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["added"]);
    }
    for i in 20..25 {
        api.delete(&name(i), &DeleteParams::default())
            .await
            .unwrap();
        api.create(&PostParams::default(), &configmap(ns, &name(i), "3"))
            .await
            .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["deleted", "added"]);
    }
    let live = cluster.objects(&configmaps(), Some(ns)).await;

    let mut second = replica_to(
        dir.path(),
        "second",
        cluster_name,
        ns,
        &sink,
        false,
        &kubeconfig,
    );
    wait::until(
        "the stream folds to the server's objects",
        Patience::of(Duration::from_secs(60)),
        async || support::compare(&destination.read().await, &live).is_empty(),
    )
    .await;
    // Stopped before the last read, so that nothing late escapes it.
    second.terminate();
    let events = destination.read().await;
    // What arrived after the restart: the multiset difference by id (Kafka is read partition
    // by partition, so not a suffix), so that a replay of an unchanged object (same id as
    // its first message) still shows.
    let mut seen_before: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &before {
        *seen_before.entry(e["id"].as_str().unwrap()).or_default() += 1;
    }
    let after: Vec<Value> = events
        .iter()
        .filter(|e| match seen_before.get_mut(e["id"].as_str().unwrap()) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .cloned()
        .collect();
    let after = &after[..];
    let got = support::resumed_types(after);
    let unmarked: Vec<String> = after
        .iter()
        .filter(|e| e["k8sresumed"] != true)
        .map(|e| format!("{} {}", event_type(e), e["subject"]))
        .collect();
    let replayed = after
        .iter()
        .filter(|e| (25..40).any(|i| e["subject"] == format!("{ns}/{}", name(i))))
        .count();
    let fsu_deletes = after
        .iter()
        .filter(|e| event_type(e) == "deleted" && e["k8sfinalstateunknown"] == true)
        .count();
    let d = support::compare(&events, &live);
    println!(
        "resume ({}, {}): {} messages after the restart (40 expected), {} not marked resumed, \
         unchanged replayed {replayed}, final-state-unknown deletes {fsu_deletes} (15 expected), \
         {}",
        match destination {
            Destination::JetStream(_) => "JetStream",
            Destination::Kafka(..) => "Kafka",
        },
        if kill { "SIGKILL" } else { "SIGTERM" },
        after.len(),
        unmarked.len(),
        d.counts(),
    );
    assert!(d.is_empty(), "{d}");
    assert_eq!(replayed, 0, "unchanged objects are not replayed");
    // The checkpoint held every acknowledged message when the first replica stopped, so
    // after a SIGKILL as after a SIGTERM the changes are exactly those, each once, resumed.
    let got: BTreeMap<String, Vec<&str>> = got.into_iter().collect();
    assert_eq!(got, want);
    assert!(unmarked.is_empty(), "{unmarked:?}");
    assert_eq!(after.len(), 40, "each change once");
    assert_eq!(fsu_deletes, 15);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_jetstream_checkpoint() {
    resume(Destination::jetstream(), false, "resume-js").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_bridge_resumes_from_the_jetstream_checkpoint() {
    resume(Destination::jetstream(), true, "resume-js-kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_kafka_checkpoint() {
    resume(Destination::kafka("resume-kafka"), false, "resume-kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_bridge_resumes_from_the_kafka_checkpoint() {
    resume(
        Destination::kafka("resume-kafka-kill"),
        true,
        "resume-kafka-kill",
    )
    .await;
}

/// The holder of Lease `kube-system/{name}`, if any.
async fn lease_holder(cluster: &Cluster, name: &str) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(cluster.client().await, "kube-system");
    leases
        .get_opt(name)
        .await
        .unwrap()
        .and_then(|l| l.spec?.holder_identity)
}

/// Waits until `identity` holds the Lease `kube-system/kube-event-bridge`.
async fn leads(cluster: &Cluster, identity: &str, patience: Duration) {
    wait::until(
        &format!("{identity} leads"),
        Patience::of(patience),
        async || lease_holder(cluster, "kube-event-bridge").await.as_deref() == Some(identity),
    )
    .await;
}

/// Waits until some replica holds the Lease `kube-system/kube-event-bridge`; returns it.
async fn first_leader(cluster: &Cluster) -> String {
    let mut leader = None;
    wait::until(
        "a leader",
        Patience::of(Duration::from_secs(60)),
        async || {
            leader = lease_holder(cluster, "kube-event-bridge").await;
            leader.is_some()
        },
    )
    .await;
    leader.unwrap()
}

/// Changes the ConfigMaps of `ns` (the seeded workload over 100 objects), `batch` at a time
/// every `pause`, until `stop`; the task returns how many changes it made.
async fn spawn_writer(
    cluster: &Cluster,
    ns: &'static str,
    batch: usize,
    pause: Duration,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    let client = cluster.client().await;
    tokio::spawn(async move {
        let api: Api<ConfigMap> = Api::namespaced(client, ns);
        let mut rng = Rng(seed());
        let mut changes = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            workload(&api, ns, &mut rng, 100, batch).await;
            changes += batch;
            tokio::time::sleep(pause).await;
        }
        changes
    })
}

/// What a consumer that drops messages older than what it holds would lose, and whether
/// deletes are identified by what they delete: per key, in destination order, every message
/// whose `k8sresourceversion` is below one before it (the versions of a real kube-apiserver
/// are etcd revisions, so this consumer compares them as numbers); the deletes whose id is
/// not `uid:resourceVersion:deleted` of the state they delete (the stub's, for a resumed
/// one: the checkpoint's, not the version the taker's list found it gone at, so every
/// replica resuming from that checkpoint gives the same id); and how many objects' deletes
/// came twice, seen on a watch and resumed.
fn versions_and_delete_ids(events: &[Value]) -> (Vec<String>, Vec<String>, usize) {
    let mut newest: BTreeMap<&str, u64> = BTreeMap::new();
    let mut backwards = Vec::new();
    let mut wrong_ids = Vec::new();
    let mut delete_kinds: BTreeMap<&str, BTreeSet<bool>> = BTreeMap::new();
    for e in events {
        let key = e["subject"].as_str().unwrap();
        let rv: u64 = e["k8sresourceversion"].as_str().unwrap().parse().unwrap();
        let held = newest.entry(key).or_insert(rv);
        if rv < *held {
            backwards.push(format!(
                "{key}: {} at {rv} after {held}{}",
                event_type(e),
                if e["k8sresumed"] == true {
                    " (resumed)"
                } else {
                    ""
                }
            ));
        } else {
            *held = rv;
        }
        if event_type(e) == "deleted" {
            let uid = e["k8suid"].as_str().unwrap();
            let deleted = e["data"]["object"]["metadata"]["resourceVersion"]
                .as_str()
                .unwrap();
            let id = e["id"].as_str().unwrap();
            if id != format!("{uid}:{deleted}:deleted") {
                wrong_ids.push(format!("{key}: {id} deletes {deleted}"));
            }
            delete_kinds
                .entry(uid)
                .or_default()
                .insert(e["k8sresumed"] == true);
        }
    }
    let twice = delete_kinds.values().filter(|k| k.len() == 2).count();
    (backwards, wrong_ids, twice)
}

/// Leader failover between two replicas on the real API server: the leader (holding the
/// Lease in `kube-system`) is SIGKILLed while objects change at about 100 per second; the
/// standby takes the Lease over and publishes what changed since the last checkpoint.
/// Folded per key in the destination's order, in both consumer models, the stream ends with
/// the API server's objects. Checkpoints are written every 2 s, so that the taker resumes
/// from one older than what the killed leader published: no key's messages go back in
/// `k8sresourceversion` (a resumed delete reports the version its list found it gone at,
/// not the checkpoint's), and each delete's id names the state it deletes, not anything of
/// the replica that sent it.
async fn failover(destination: Destination, cluster_name: &str) {
    let cluster = Cluster::start().await;
    let ns = "failover";
    cluster.create_namespace(ns).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let mut sink = destination.sink();
    sink["checkpoint_interval"] = json!("2s");
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| {
            let r = replica_to(dir.path(), id, cluster_name, ns, &sink, true, &kubeconfig);
            (id.to_owned(), r)
        })
        .collect();
    let leader = first_leader(&cluster).await;
    ready(&replicas[&leader]).await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = spawn_writer(&cluster, ns, 10, Duration::from_millis(100), stop.clone()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let killed = replicas.remove(&leader).unwrap();
    killed.signal("KILL");
    drop(killed);
    let standby = replicas.keys().next().unwrap().clone();
    leads(&cluster, &standby, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = writer.await.unwrap();

    let live = cluster.objects(&configmaps(), Some(ns)).await;
    wait::until(
        "the stream folds to the server's objects",
        Patience::of(Duration::from_secs(60)),
        async || {
            let events = destination.read().await;
            support::compare_both(&events, &live)
                .iter()
                .all(Differences::is_empty)
        },
    )
    .await;
    // Every replica stopped before the last read, so that nothing late escapes it.
    for mut r in replicas.into_values() {
        r.terminate();
    }
    let events = destination.read().await;
    let [d, deduplicated] = support::compare_both(&events, &live);
    let ids: BTreeSet<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
    let (backwards, wrong_ids, twice) = versions_and_delete_ids(&events);
    let resumed = events.iter().filter(|e| e["k8sresumed"] == true).count();
    println!(
        "failover ({}): {changes} changes, {} messages, {} repeated ids, {} live objects, \
         {resumed} resumed; last message wins: {}; deduplicated by id: {}; {} messages back \
         in resourceVersion, {} deletes with another id, {twice} objects deleted both on a \
         watch and by the resume",
        match destination {
            Destination::JetStream(_) => "JetStream",
            Destination::Kafka(..) => "Kafka",
        },
        events.len(),
        events.len() - ids.len(),
        live.len(),
        d.counts(),
        deduplicated.counts(),
        backwards.len(),
        wrong_ids.len(),
    );
    assert!(d.is_empty(), "{d}");
    assert!(deduplicated.is_empty(), "{deduplicated}");
    assert!(backwards.is_empty(), "{backwards:?}");
    assert!(wrong_ids.is_empty(), "{wrong_ids:?}");
}

/// A leader frozen (SIGSTOP) while it publishes into Kafka with `exactly_once`, and thawed
/// after the standby took the Lease over and started its producer (which fences the frozen
/// one's): the thawed replica's `/healthz` fails, naming the fence, and
/// `keb_kafka_producer_fenced` is 1, whichever it learnt first (the commit or abort refused,
/// or the lease it lost seen held by the other), and they stay so while it stands by; once it leads again (the other
/// SIGKILLed) its new producer clears both. A `read_committed` consumer's fold equals the
/// API server's objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_replica_fails_healthz_until_it_leads_again() {
    let cluster = Cluster::start().await;
    let ns = "fenced";
    cluster.create_namespace(ns).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let destination = Destination::kafka("fenced");
    let mut sink = destination.sink();
    sink["kafka"]["exactly_once"] = json!(true);
    // Long transactions: the freeze lands in one that holds records (an empty one ends
    // without asking the broker, so its producer would never hear of the fence).
    sink["kafka"]["transaction_interval"] = json!("3s");
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| {
            let r = replica_to(dir.path(), id, "fenced", ns, &sink, true, &kubeconfig);
            (id.to_owned(), r)
        })
        .collect();
    let frozen = first_leader(&cluster).await;
    let other = replicas.keys().find(|k| **k != frozen).unwrap().clone();
    ready(&replicas[&frozen]).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = spawn_writer(&cluster, ns, 5, Duration::from_millis(50), stop.clone()).await;
    let health = async |r: &Replica| {
        let admin = r.admin().expect("its admin address");
        let (code, body) = support::http_get(admin, "/healthz").await;
        let fenced = support::metric_sum(admin, "keb_kafka_producer_fenced").await;
        (code, body, fenced)
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (code, _, fenced) = health(&replicas[&frozen]).await;
    assert_eq!((code, fenced), (200, 0.0), "the leader is healthy before");
    replicas[&frozen].signal("STOP");
    leads(&cluster, &other, Duration::from_secs(60)).await;
    wait::until(
        "the new leader's producer fenced the frozen one's",
        Patience::of(Duration::from_secs(90)),
        async || replicas[&other].log().contains("Transactions on"),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    replicas[&frozen].signal("CONT");
    // The thawed replica learns of the fence from the broker (a late commit or produce
    // refused, or its term's closing abort) or, when the broker tells it nothing (a Kafka 4
    // coordinator may accept the deposed producer's abort of a transaction the new producer
    // already aborted), from the Lease: it lost it while leading and another holds it.
    let mut seen = (0, String::new(), 0.0);
    let reported = wait::within(Patience::of(Duration::from_secs(30)), async || {
        seen = health(&replicas[&frozen]).await;
        seen.0 == 503
    })
    .await;
    if !reported {
        let log = replicas[&frozen].log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| {
                ["ransaction", "ead", "ease", "ence"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .collect();
        panic!(
            "the thawed replica does not report the fence ({seen:?}); its log:\n{}",
            lines[lines.len().saturating_sub(30)..].join("\n")
        );
    }
    let by_broker = replicas[&frozen].log().contains("fenced=true");
    println!(
        "thawed: /healthz {} {:?}, keb_kafka_producer_fenced {} (the broker refused its abort: {by_broker})",
        seen.0, seen.1, seen.2
    );
    assert!(seen.1.contains("fenced"), "{}", seen.1);
    assert_eq!(seen.2, 1.0);
    // It stays so while it stands by (the lease's end does not clear it).
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (code, _, fenced) = health(&replicas[&frozen]).await;
        assert_eq!((code, fenced), (503, 1.0), "while standing by");
        let (code, body, _) = health(&replicas[&other]).await;
        assert_eq!(code, 200, "the leader is healthy: {body}");
    }
    // It leads again: its new producer clears both.
    let killed = replicas.remove(&other).unwrap();
    killed.signal("KILL");
    drop(killed);
    leads(&cluster, &frozen, Duration::from_secs(60)).await;
    wait::until(
        "the replica leading again is healthy",
        Patience::of(Duration::from_secs(90)),
        async || {
            let (code, _, fenced) = health(&replicas[&frozen]).await;
            code == 200 && fenced == 0.0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = writer.await.unwrap();
    let live = cluster.objects(&configmaps(), Some(ns)).await;
    let read_committed = async || {
        let Destination::Kafka(kafka, topic) = &destination else {
            unreachable!()
        };
        let (brokers, topic) = (kafka.brokers(), topic.clone());
        tokio::task::spawn_blocking(move || {
            support::kafka::read_topic(&brokers, &topic, true)
                .iter()
                .map(|r| r.json())
                .collect::<Vec<Value>>()
        })
        .await
        .unwrap()
    };
    wait::until(
        "the committed stream folds to the server's objects",
        Patience::of(Duration::from_secs(60)),
        async || support::compare(&read_committed().await, &live).is_empty(),
    )
    .await;
    let events = read_committed().await;
    println!("{changes} changes, {} committed messages", events.len());
    for mut r in replicas.into_values() {
        r.terminate();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_leader_is_replaced_and_nothing_is_lost_on_jetstream() {
    failover(Destination::jetstream(), "failover-js").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_leader_is_replaced_and_nothing_is_lost_on_kafka() {
    failover(Destination::kafka("failover-kafka"), "failover-kafka").await;
}

/// Features combined on the real server: two replicas with leader election, a label filter
/// (`team == "shop"`) and resume into JetStream; objects are created, relabelled in and out
/// of the filter, updated and deleted while the leader is SIGKILLed and the standby takes
/// over. A consumer's fold (an object that left the filter ends with its `deleted` marked
/// `k8sfilteredout`) equals the API server's objects that match the filter, in both consumer
/// models, and no object outside the filter is ever published as present at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_with_resume_across_a_leader_failover_ends_with_the_matching_objects() {
    use support::objects::Meta as _;
    let cluster = Cluster::start().await;
    let ns = "combined";
    cluster.create_namespace(ns).await;
    let nats = support::nats::NatsServer::start();
    let sink = support::config::nats_sink("out", &nats.url(), json!({}));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let config = |identity: &str| {
        ConfigBuilder::new()
            .cluster("combined")
            .grace_period("5s")
            .resource(json!({
                "api_version": "v1", "kind": "ConfigMap", "namespaces": [ns],
                "filter": "has(object.metadata.labels.team) && object.metadata.labels.team == 'shop'",
            }))
            .sink(sink.clone())
            .route("configmap", &["out"])
            .fast_leader_election(identity, "200ms")
            .value()
    };
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| {
            (
                id.to_owned(),
                Replica::start(dir.path(), id, &config(id), &kubeconfig),
            )
        })
        .collect();
    let leader = first_leader(&cluster).await;
    ready(&replicas[&leader]).await;

    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    let mut rng = Rng(seed());
    let team = |rng: &mut Rng| if rng.below(2) == 0 { "shop" } else { "other" };
    let change = async |rng: &mut Rng, op: u64| {
        let name = format!("cm-{:02}", rng.below(60));
        let obj = configmap(ns, &name, &op.to_string()).label("team", team(rng));
        match api.get_opt(&name).await.unwrap() {
            None => drop(api.create(&PostParams::default(), &obj).await.unwrap()),
            Some(_) if rng.below(5) == 0 => {
                drop(api.delete(&name, &DeleteParams::default()).await.unwrap())
            }
            Some(_) => drop(
                api.replace(&name, &PostParams::default(), &obj)
                    .await
                    .unwrap(),
            ),
        }
    };
    for op in 0..200 {
        change(&mut rng, op).await;
    }
    let killed = replicas.remove(&leader).unwrap();
    killed.signal("KILL");
    drop(killed);
    // Changes while no replica leads, then under the new leader.
    for op in 200..500 {
        change(&mut rng, op).await;
        if op % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let standby = replicas.keys().next().unwrap().clone();
    leads(&cluster, &standby, Duration::from_secs(30)).await;

    let matching: BTreeMap<String, (String, String)> = {
        let all: Vec<ConfigMap> = api.list(&Default::default()).await.unwrap().items;
        all.into_iter()
            .filter(|c| {
                c.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("team"))
                    .map(String::as_str)
                    == Some("shop")
            })
            .map(|c| {
                let m = c.metadata;
                (
                    format!("{ns}/{}", m.name.unwrap()),
                    (m.uid.unwrap(), m.resource_version.unwrap()),
                )
            })
            .collect()
    };
    let read = async || -> Vec<Value> {
        support::nats::read_stream(&nats.url(), support::config::NATS_STREAM)
            .await
            .iter()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
            .collect()
    };
    wait::until(
        "the stream folds to the matching objects",
        Patience::of(Duration::from_secs(60)),
        async || {
            let events = read().await;
            support::compare_both(&events, &matching)
                .iter()
                .all(Differences::is_empty)
        },
    )
    .await;
    // Every replica stopped before the last read, so that nothing late escapes it.
    for mut r in replicas.into_values() {
        r.terminate();
    }
    let events = read().await;
    let [d, deduplicated] = support::compare_both(&events, &matching);
    let filtered_out = events
        .iter()
        .filter(|e| e["k8sfilteredout"] == true)
        .count();
    let resumed = events.iter().filter(|e| e["k8sresumed"] == true).count();
    println!(
        "filter + resume + failover: 500 changes, {} messages ({filtered_out} filtered out, \
         {resumed} resumed), {} matching objects; last message wins: {}; deduplicated by id: {}",
        events.len(),
        matching.len(),
        d.counts(),
        deduplicated.counts(),
    );
    assert!(d.is_empty(), "{d}");
    assert!(deduplicated.is_empty(), "{deduplicated}");
    assert!(filtered_out > 0 && resumed > 0, "the run exercised both");
}

/// A real cluster with the Gadget CRD (v1) and ten Gadgets in namespace `ns`.
async fn gadgets(ns: &str, n: usize) -> Cluster {
    use futures::StreamExt;
    let cluster = Cluster::start().await;
    cluster.create_namespace(ns).await;
    cluster
        .install_crd(GROUP, "Gadget", "gadgets", true, &[("v1", true)])
        .await;
    futures::stream::iter(0..n)
        .map(|i| cluster.create("gadgets", gadget("v1", ns, &format!("g{i:02}"), i as u64)))
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    cluster
}

/// Waits for the delete of each of [`gadgets`]' `n` in `destination`, and checks that each
/// was published once.
async fn every_delete(destination: &Destination, ns: &str, n: usize, what: &str) {
    wait::until(
        "every Gadget's delete",
        Patience::of(Duration::from_secs(60 + n as u64 / 100)),
        async || {
            let folded = support::fold_in_order(&destination.read().await);
            (0..n).all(|i| {
                folded
                    .get(&format!("{ns}/g{i:02}"))
                    .is_some_and(Option::is_none)
            })
        },
    )
    .await;
    let events = destination.read().await;
    let deletes = events.iter().filter(|e| event_type(e) == "deleted").count();
    println!("{what}: {} messages, {deletes} deletes", events.len());
    assert_eq!(deletes, n, "one delete per Gadget");
}

/// A CRD deleted while nobody leads: the leader publishes ten Gadgets (checkpointed in
/// JetStream KV) and is SIGKILLed, the CRD is deleted at once (the API server deletes the
/// Gadgets with it), and the standby sees the kind go (its informers stop) before it takes
/// the Lease over. Its resume begins on a kind known to be gone: it must complete as gone,
/// a delete for every checkpointed Gadget, not wait for informers that will never sync
/// (which published nothing: consumers kept ten Gadgets that no longer exist).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_deleted_while_nobody_leads_delivers_its_deletes_from_the_checkpoint() {
    let ns = "crd-gone";
    let cluster = gadgets(ns, 10).await;
    let destination = Destination::jetstream();
    let mut sink = destination.sink();
    sink["checkpoint_interval"] = json!("200ms");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let start = |identity: &str| {
        let config = ConfigBuilder::new()
            .cluster("crd-gone")
            .grace_period("5s")
            .kubernetes(json!({"discovery_refresh": "1s", "discovery_grace": "1s"}))
            .resource(
                json!({"name": "gadget", "api_version": format!("{GROUP}/v1"), "kind": "Gadget"}),
            )
            .sink(sink.clone())
            .route("gadget", &["out"])
            .fast_leader_election(identity, "200ms")
            .value();
        Replica::start(dir.path(), identity, &config, &kubeconfig)
    };
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| (id.to_owned(), start(id)))
        .collect();
    let read = async || destination.read().await;
    let mut leader = None;
    wait::until(
        "every Gadget published by a leader",
        Patience::of(Duration::from_secs(90)),
        async || {
            leader = lease_holder(&cluster, "kube-event-bridge").await;
            leader.is_some() && read().await.len() >= 10
        },
    )
    .await;
    // Checkpointed (every 200 ms), then the leader dies and the CRD goes with its objects.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leader = leader.unwrap();
    let killed = replicas.remove(&leader).unwrap();
    killed.signal("KILL");
    drop(killed);
    cluster.delete_crd(GROUP, "gadgets").await;
    let (standby, replica) = replicas.iter().next().unwrap();
    wait::until(
        "the standby sees the kind gone",
        Patience::of(Duration::from_secs(60)),
        async || replica.log().contains("No longer served"),
    )
    .await;
    leads(&cluster, standby, Duration::from_secs(60)).await;
    every_delete(
        &destination,
        ns,
        10,
        "CRD deleted while nobody led (deletes from the standby's resume)",
    )
    .await;
}

/// A CRD deleted while no replica runs at all: a replica publishes ten Gadgets (checkpointed
/// in JetStream KV) and stops, the CRD is deleted (the API server deletes the Gadgets with
/// it), and a replica started afterwards never sees the kind served. It learns the kind from
/// its route's checkpoint (recorded beside the cluster's identity) once `discovery_grace` is
/// over, and publishes a delete for every Gadget (before, none: consumers kept ten Gadgets
/// that no longer exist until the kind was served again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_deleted_while_no_replica_runs_delivers_its_deletes_from_the_checkpoint() {
    // `REAL_CLUSTER_GADGETS` runs it at scale (the CI run is small).
    let n: usize = std::env::var("REAL_CLUSTER_GADGETS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10);
    let ns = "crd-gone-down";
    let cluster = gadgets(ns, n).await;
    let destination = Destination::jetstream();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let config = ConfigBuilder::new()
        .cluster("crd-gone-down")
        .grace_period("5s")
        .kubernetes(json!({"discovery_refresh": "1s", "discovery_grace": "1s"}))
        .resource(json!({"name": "gadget", "api_version": format!("{GROUP}/v1"), "kind": "Gadget"}))
        .sink(destination.sink())
        .route("gadget", &["out"])
        .value();
    let read = async || destination.read().await;
    let mut first = Replica::start(dir.path(), "first", &config, &kubeconfig);
    wait::until(
        "every Gadget published",
        Patience::of(Duration::from_secs(90)),
        async || read().await.len() >= n,
    )
    .await;
    // A clean stop writes the checkpoint.
    first.terminate();
    cluster.delete_crd(GROUP, "gadgets").await;
    // Gone for good (its objects deleted, the CRD removed): a terminating CRD is still served.
    let crds: kube::Api<
        k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    > = kube::Api::all(cluster.client().await);
    wait::until(
        "the CRD gone",
        Patience::of(Duration::from_secs(60)),
        async || {
            crds.get_opt(&format!("gadgets.{GROUP}"))
                .await
                .unwrap()
                .is_none()
        },
    )
    .await;
    let second = Replica::start(dir.path(), "second", &config, &kubeconfig);
    // The peak of notifications it holds while it publishes the deletes.
    let mut admin = None;
    wait::until(
        "the second replica's admin address",
        Patience::of(Duration::from_secs(30)),
        async || {
            admin = second.admin();
            admin.is_some()
        },
    )
    .await;
    let admin = admin.unwrap();
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = tokio::spawn({
        let sampling = sampling.clone();
        async move {
            let mut peak = 0u64;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                let held = support::metric_sum(admin, "keb_listener_buffered_notifications").await;
                peak = peak.max(held as u64);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            peak
        }
    });
    every_delete(
        &destination,
        ns,
        n,
        "CRD deleted while no replica ran (deletes from the next replica)",
    )
    .await;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    println!("peak of held notifications: {}", sampler.await.unwrap());
    assert!(
        second.log().contains("still has checkpointed objects"),
        "{}",
        second.log()
    );
}
