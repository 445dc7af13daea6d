//! Discovery on the real server: CRDs installed, moved to another version, deleted (also
//! while nobody leads or no replica runs), and API server restarts under a wildcard.

use std::{collections::BTreeMap, path::Path, time::Duration};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::{
    GROUP,
    failover::{leads, lease_holder},
    gadget,
    support::{
        self,
        broker::Broker,
        cluster::Cluster,
        config::ConfigBuilder,
        delivered, event_type, json_lines,
        objects::{configmap, configmaps},
        replica::Replica,
        wait::{self, Patience},
    },
};

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
async fn every_delete(destination: &Broker, ns: &str, n: usize, what: &str) {
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
    let destination = Broker::jetstream();
    let mut sink = destination.sink("out");
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
    let n = support::scaled("REAL_CLUSTER_GADGETS", 10);
    let ns = "crd-gone-down";
    let cluster = gadgets(ns, n).await;
    let destination = Broker::jetstream();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let config = ConfigBuilder::new()
        .cluster("crd-gone-down")
        .grace_period("5s")
        .kubernetes(json!({"discovery_refresh": "1s", "discovery_grace": "1s"}))
        .resource(json!({"name": "gadget", "api_version": format!("{GROUP}/v1"), "kind": "Gadget"}))
        .sink(destination.sink("out"))
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
