//! Sharding and RBAC against a real kube-apiserver v1.36 and etcd 3.6 (tests/support/
//! cluster.rs), each scenario on its own cluster, checked as a consumer sees it: what the
//! JetStream stream (a real nats-server) holds, folded per key in stream order, compared with
//! the API server's objects (lost deletes, phantom deletes, stale finals, missing).
//!
//! - Sharding with the `ShardedListAndWatch` gate on (the server applies `shardSelector` and
//!   echoes `shardInfo`) and off (the replicas filter on the client): three replicas share
//!   six shards of ConfigMaps spread over sixty namespaces and of a cluster-scoped custom
//!   kind; every object's first state is published by exactly one replica; while objects
//!   change, the replica owning the cluster-scoped shard is SIGKILLed and the others take
//!   its shards over.
//! - RBAC: the bridge runs with the token of a ServiceAccount bound to exactly the roles
//!   `deploy/overlays/nats` installs (its config watching what that overlay's config
//!   watches), and then with `watch` taken away on one of its two kinds.

mod support;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::StreamExt;
use k8s_openapi::api::{
    apps::v1::Deployment,
    authentication::v1::{TokenRequest, TokenRequestSpec},
    authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
    coordination::v1::Lease,
    core::v1::{ConfigMap, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};
use support::{
    Differences,
    cluster::{Cluster, ClusterOptions},
    config::{ConfigBuilder, NATS_STREAM, nats_sink},
    differences, fold_in_order,
    nats::{NatsServer, read_stream, stream_len},
    objects::{configmap, configmaps, custom_resource, deployment, named, spread_namespaces},
    replica::{Replica, dump, shards_spread},
    wait::{self, Patience},
};

/// Shards the replicas share: two each among three, three each among two.
const SHARDS: u32 = 6;
/// ConfigMaps, spread over [`spread_namespaces`].
const CONFIGMAPS: usize = 600;
/// Cluster-scoped Widgets: all of them hash the empty namespace and fall into one shard.
const WIDGETS: usize = 40;
/// The group of the cluster-scoped custom kind.
const GROUP: &str = "shards.example.org";
/// Where the replicas keep their Leases.
const LEASE_NAMESPACE: &str = "kube-system";

fn widgets() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", "Widget"), "widgets")
}

fn deployments() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("apps", "v1", "Deployment"),
        "deployments",
    )
}

/// ConfigMap `i`: its namespace and name.
fn configmap_name(i: usize) -> (String, String) {
    thread_local! {
        static NAMESPACES: Vec<String> = spread_namespaces();
    }
    let ns = NAMESPACES.with(|n| n[i % n.len()].clone());
    (ns, format!("cm-{i:04}"))
}

fn widget(name: &str, value: &str) -> DynamicObject {
    let mut obj = custom_resource(&format!("{GROUP}/v1"), "Widget", None, name);
    obj["spec"] = json!({"v": value});
    serde_json::from_value(obj).unwrap()
}

/// The objects the sharding scenario changes: ConfigMaps `0..CONFIGMAPS`, then Widgets.
#[derive(Clone)]
struct Workload {
    client: kube::Client,
}

impl Workload {
    fn configmaps(&self, ns: &str) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), ns)
    }

    fn widgets(&self) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &widgets())
    }

    /// Creates object `i` with `value`.
    async fn create(&self, i: usize, value: &str) {
        let pp = PostParams::default();
        let done = if i < CONFIGMAPS {
            let (ns, name) = configmap_name(i);
            self.configmaps(&ns)
                .create(&pp, &configmap(&ns, &name, value))
                .await
                .map(drop)
        } else {
            let name = format!("widget-{:03}", i - CONFIGMAPS);
            self.widgets()
                .create(&pp, &widget(&name, value))
                .await
                .map(drop)
        };
        done.unwrap_or_else(|e| panic!("create object {i}: {e}"));
    }

    /// Sets object `i`'s value (a merge patch: no resourceVersion needed).
    async fn update(&self, i: usize, value: &str) {
        let pp = PatchParams::default();
        let done = if i < CONFIGMAPS {
            let (ns, name) = configmap_name(i);
            self.configmaps(&ns)
                .patch(&name, &pp, &Patch::Merge(json!({"data": {"v": value}})))
                .await
                .map(drop)
        } else {
            let name = format!("widget-{:03}", i - CONFIGMAPS);
            self.widgets()
                .patch(&name, &pp, &Patch::Merge(json!({"spec": {"v": value}})))
                .await
                .map(drop)
        };
        done.unwrap_or_else(|e| panic!("update object {i}: {e}"));
    }

    async fn delete(&self, i: usize) {
        let dp = DeleteParams::default();
        let done = if i < CONFIGMAPS {
            let (ns, name) = configmap_name(i);
            self.configmaps(&ns).delete(&name, &dp).await.map(drop)
        } else {
            let name = format!("widget-{:03}", i - CONFIGMAPS);
            self.widgets().delete(&name, &dp).await.map(drop)
        };
        done.unwrap_or_else(|e| panic!("delete object {i}: {e}"));
    }

    /// Changes objects at about `per_second` until `stop`: updates mostly, every seventh a
    /// delete, and a deleted one is created again when its turn comes. Returns the count.
    async fn run(self, per_second: u64, stop: Arc<AtomicBool>) -> u64 {
        let total = (CONFIGMAPS + WIDGETS) as u64;
        let mut gone = HashSet::new();
        let mut changes = 0u64;
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / per_second));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            // Widgets (1 in 16 of the objects) every fourth change, so that the
            // cluster-scoped shard changes too.
            let i = if changes.is_multiple_of(4) {
                CONFIGMAPS + (changes / 4 * 13 % WIDGETS as u64) as usize
            } else {
                (changes * 7919 % total) as usize % CONFIGMAPS
            };
            let value = format!("v{changes}");
            if gone.remove(&i) {
                self.create(i, &value).await;
            } else if changes.is_multiple_of(7) {
                self.delete(i).await;
                gone.insert(i);
            } else {
                self.update(i, &value).await;
            }
            changes += 1;
        }
        changes
    }
}

/// The holder of every shard's Lease (`None` for a shard nobody holds).
async fn shard_holders(leases: &Api<Lease>) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for s in 0..SHARDS {
        let lease = leases
            .get_opt(&format!("kube-event-bridge-shard-{s}-of-{SHARDS}"))
            .await
            .unwrap();
        out.push(
            lease
                .and_then(|l| l.spec?.holder_identity)
                .filter(|h| !h.is_empty()),
        );
    }
    out
}

/// Waits until every shard is held by one of `replicas` live replicas (none of `gone`),
/// none holding more than ⌈shards / replicas⌉.
async fn settled(leases: &Api<Lease>, gone: &[String], replicas: usize, patience: Patience) {
    wait::until(
        format!("the shards spread over {replicas} replicas"),
        patience,
        async || {
            let holders = shard_holders(leases).await;
            shards_spread(&holders, gone, replicas)
        },
    )
    .await;
}

/// A sharded replica's config: ConfigMaps and Widgets to `sink`, fast Leases in
/// [`LEASE_NAMESPACE`].
fn sharded_config(identity: &str, sink: &Value) -> Value {
    ConfigBuilder::new()
        .resource(json!({"name": "configmap", "api_version": "v1", "kind": "ConfigMap"}))
        .resource(json!({"name": "widget", "api_version": format!("{GROUP}/v1"), "kind": "Widget"}))
        .sink(sink.clone())
        .route_each_resource_to(&[sink["name"].as_str().unwrap()])
        .set(
            "leader_election",
            json!({
                "enabled": true, "identity": identity, "namespace": LEASE_NAMESPACE,
                "lease_duration": "4s", "renew_deadline": "3s", "retry_period": "250ms",
            }),
        )
        .set("sharding", json!({"shards": SHARDS}))
        .value()
}

/// Every message of the stream, decoded.
async fn read(url: &str) -> Vec<Value> {
    read_stream(url, NATS_STREAM)
        .await
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect()
}

/// How the stream's events of `kind` differ from the API server's objects of `resource`.
async fn compare(
    cluster: &Cluster,
    events: &[Value],
    kind: &str,
    resource: &ApiResource,
) -> Differences {
    let of_kind = events.iter().filter(|e| e["k8skind"] == kind);
    differences(
        &fold_in_order(of_kind),
        &cluster.objects(resource, None).await,
    )
}

fn counts(d: &Differences) -> String {
    format!(
        "{} lost deletes, {} phantom deletes, {} stale, {} missing",
        d.lost_deletes.len(),
        d.phantom_deletes.len(),
        d.stale.len(),
        d.missing.len()
    )
}

/// A metric's samples in a Prometheus text exposition: labels → value.
fn samples(text: &str, metric: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(metric))
        .filter(|rest| rest.starts_with('{') || rest.starts_with(' '))
        .filter_map(|rest| {
            let (labels, value) = rest.rsplit_once(' ')?;
            Some((labels.trim().to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn replica_metrics(replica: &Replica) -> String {
    match replica.admin() {
        Some(addr) => support::http_get(addr, "/metrics").await.1,
        None => String::new(),
    }
}

async fn apiserver_metrics(cluster: &Cluster) -> String {
    cluster
        .client()
        .await
        .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
        .await
        .unwrap()
}

async fn sharded(server_side: bool) {
    let started = tokio::time::Instant::now();
    let options = ClusterOptions {
        feature_gates: if server_side {
            vec!["ShardedListAndWatch=true".into()]
        } else {
            vec![]
        },
        ..Default::default()
    };
    let cluster = Cluster::start_with(options).await;
    eprintln!("kube-apiserver ready in {:?}", cluster.last_start);
    let client = cluster.client().await;
    cluster
        .install_crd(GROUP, "Widget", "widgets", false, &[("v1", true)])
        .await;
    for ns in spread_namespaces() {
        cluster.create_namespace(&ns).await;
    }
    let workload = Workload {
        client: client.clone(),
    };
    futures::stream::iter(0..CONFIGMAPS + WIDGETS)
        .for_each_concurrent(8, |i| {
            let w = workload.clone();
            async move { w.create(i, "0").await }
        })
        .await;
    // What the stream must start with: these, and the ConfigMaps the API server keeps in
    // kube-system.
    let first_states = cluster.objects(&configmaps(), None).await.len()
        + cluster.objects(&widgets(), None).await.len();
    eprintln!(
        "{CONFIGMAPS} ConfigMaps in 60 namespaces and {WIDGETS} Widgets created after {:?} \
         ({first_states} objects in all)",
        started.elapsed()
    );

    let nats = NatsServer::start();
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let sink = nats_sink("nats", &url, json!({}));
    let mut replicas: Vec<Replica> = ["replica-a", "replica-b", "replica-c"]
        .iter()
        .map(|id| Replica::start(dir.path(), id, &sharded_config(id, &sink), &kubeconfig))
        .collect();
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    let patience = Patience::of(Duration::from_secs(90)).polling(Duration::from_millis(250));
    let replicas_started = tokio::time::Instant::now();
    settled(&leases, &[], 3, patience).await;
    let took = wait::within(patience, async || {
        stream_len(&url, NATS_STREAM).await >= first_states as u64
    })
    .await;
    if !took {
        dump(&replicas);
        panic!(
            "not every object's first state was published: {} of {first_states}",
            stream_len(&url, NATS_STREAM).await
        );
    }
    let first_published = replicas_started.elapsed();
    // A window for a second publisher of any object to show (none should).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = read(&url).await;
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for e in &first {
        let key = (
            e["subject"].as_str().unwrap().to_owned(),
            e["k8sresourceversion"].as_str().unwrap_or("").to_owned(),
        );
        *seen.entry(key).or_default() += 1;
    }
    let twice = seen.values().filter(|&&c| c > 1).count();
    let mut published = Vec::new();
    for r in &replicas {
        published.push(r.published().await);
    }
    let holders = shard_holders(&leases).await;
    let mut per_replica: BTreeMap<String, usize> = BTreeMap::new();
    holders
        .iter()
        .flatten()
        .for_each(|h| *per_replica.entry(h.clone()).or_default() += 1);
    eprintln!(
        "first states: {} messages for {first_states} objects after {first_published:?}, \
         {twice} in the stream twice; published per replica {published:?}; shards per \
         replica {per_replica:?}",
        first.len()
    );
    assert_eq!(first.len(), first_states, "each object's first state once");
    assert_eq!(twice, 0);
    assert_eq!(
        published.iter().sum::<u64>(),
        first_states as u64,
        "the replicas' sinks acknowledged each object once: {published:?}"
    );

    // Where the shards are selected. The replicas tell it from the list's `shardInfo` echo
    // (gauge, `/readyz` note, log), which kube-apiserver v1.36.3 sends for built-in kinds
    // only: a custom resource's list is filtered but echoes nothing, so the replicas report
    // the Widgets' shards as client-side either way (printed, not asserted: the mode they
    // report is checked on the ConfigMaps). What the API server applied, for both kinds, is
    // read from its own metrics once objects have changed (below).
    let (mode_line, other_line) = (
        "The API server applies the shard selector",
        "The API server ignored the shard selector",
    );
    let (mode_line, other_line) = if server_side {
        (mode_line, other_line)
    } else {
        (other_line, mode_line)
    };
    let mut gauges = BTreeMap::new();
    for r in &replicas {
        let log = r.log();
        assert!(
            log.contains(mode_line),
            "{}: {mode_line:?} not logged",
            r.identity
        );
        if !server_side {
            assert!(!log.contains(other_line), "{}: {other_line:?}", r.identity);
        }
        // The informers of the shards it owns (those of the others exist, not running).
        let owned: Vec<String> = holders
            .iter()
            .enumerate()
            .filter(|(_, h)| h.as_deref() == Some(r.identity.as_str()))
            .map(|(i, _)| format!("#{i}-of-{SHARDS}\""))
            .collect();
        for (labels, value) in samples(&replica_metrics(r).await, "keb_informer_shard_server_side")
        {
            if owned.iter().any(|o| labels.ends_with(&format!("{o}}}"))) {
                gauges.insert(format!("{} {labels}", r.identity), value);
            }
        }
        let (_, ready) = support::http_get(r.admin().unwrap(), "/readyz").await;
        let noted = |kind: &str| {
            ready
                .lines()
                .filter(|l| l.contains("ignores its shard selector") && l.contains(kind))
                .count()
        };
        eprintln!(
            "{}: /readyz notes as client-side {} ConfigMap and {} Widget informers",
            r.identity,
            noted("configmaps"),
            noted("widgets")
        );
        assert_eq!(
            noted("configmaps"),
            if server_side { 0 } else { 2 },
            "{ready}"
        );
    }
    eprintln!("keb_informer_shard_server_side of the owned shards' informers: {gauges:?}");
    let configmap_gauges: Vec<f64> = gauges
        .iter()
        .filter(|(k, _)| k.contains("configmaps"))
        .map(|(_, v)| *v)
        .collect();
    // One informer per kind for each shard each replica owns.
    assert_eq!(gauges.len(), 2 * SHARDS as usize, "{gauges:?}");
    assert_eq!(
        configmap_gauges,
        vec![if server_side { 1.0 } else { 0.0 }; SHARDS as usize],
        "{gauges:?}"
    );

    // Changes under way; the replica owning the Widgets' shard (the empty namespace's) is
    // SIGKILLed.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(workload.clone().run(100, stop.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cluster_scoped = kube_event_bridge::shard::ShardingConfig { shards: SHARDS }
        .all()
        .into_iter()
        .position(|s| s.holds_namespace(""))
        .unwrap();
    let victim_id = holders[cluster_scoped].clone().unwrap();
    let victim = replicas.remove(
        replicas
            .iter()
            .position(|r| r.identity == victim_id)
            .unwrap(),
    );
    let killed_at = tokio::time::Instant::now();
    drop(victim);
    settled(&leases, std::slice::from_ref(&victim_id), 2, patience).await;
    let takeover = killed_at.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let changes = writer.await.unwrap();
    // The API server's count of watch events it held back by shard selector (registered
    // only with the gate on): the changes of other shards' objects, for both kinds. (Its
    // gauge of open sharded watches, apiserver_watch_shards_total, is printed only: it read
    // 2 or 3 per kind with 6 open.)
    let text = apiserver_metrics(&cluster).await;
    let filtered = samples(&text, "apiserver_watch_filtered_events_total");
    eprintln!(
        "kube-apiserver: apiserver_watch_filtered_events_total {filtered:?}, \
         apiserver_watch_shards_total {:?}",
        samples(&text, "apiserver_watch_shards_total")
    );
    for (group, resource) in [("", "configmaps"), (GROUP, "widgets")] {
        let labels = format!("{{group=\"{group}\",resource=\"{resource}\"}}");
        let held_back = filtered.get(&labels).copied().unwrap_or(0.0);
        assert_eq!(
            held_back > 0.0,
            server_side,
            "{resource}: {held_back} watch events held back by shard selector"
        );
    }

    // The fold of the stream ends with the API server's objects of both kinds.
    let mut found = (Differences::default(), Differences::default());
    let quiet = wait::within(
        Patience::of(Duration::from_secs(60)).polling(Duration::from_secs(1)),
        async || {
            let events = read(&url).await;
            found = (
                compare(&cluster, &events, "ConfigMap", &configmaps()).await,
                compare(&cluster, &events, "Widget", &widgets()).await,
            );
            found.0.is_empty() && found.1.is_empty()
        },
    )
    .await;
    if !quiet {
        dump(&replicas);
    }
    // Every replica stopped before the last read, so that nothing late escapes it; then
    // both consumer models: last message wins, and deduplicate by id first.
    for r in &mut replicas {
        r.terminate();
    }
    let events = read(&url).await;
    let mut ids = std::collections::HashSet::new();
    let deduplicated: Vec<Value> = events
        .iter()
        .filter(|e| ids.insert(e["id"].as_str().unwrap().to_owned()))
        .cloned()
        .collect();
    let repeated = events.len() - deduplicated.len();
    found = (
        compare(&cluster, &events, "ConfigMap", &configmaps()).await,
        compare(&cluster, &events, "Widget", &widgets()).await,
    );
    let found_deduplicated = (
        compare(&cluster, &deduplicated, "ConfigMap", &configmaps()).await,
        compare(&cluster, &deduplicated, "Widget", &widgets()).await,
    );
    eprintln!(
        "{} ({}): {changes} changes; shard {cluster_scoped} (the cluster-scoped one) and the \
         rest of {victim_id}'s taken over {takeover:?} after its SIGKILL; {} messages \
         ({repeated} repeated ids); ConfigMaps: {}; Widgets: {}; test took {:?}",
        if server_side {
            "server-side"
        } else {
            "client-side"
        },
        mode_line,
        events.len(),
        counts(&found.0),
        counts(&found.1),
        started.elapsed()
    );
    assert!(found.0.is_empty(), "ConfigMaps: {:?}", found.0);
    assert!(found.1.is_empty(), "Widgets: {:?}", found.1);
    assert!(
        found_deduplicated.0.is_empty() && found_deduplicated.1.is_empty(),
        "deduplicated by id: {found_deduplicated:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_with_the_gate_on_the_server_selects_and_a_killed_replicas_shards_move() {
    sharded(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_with_the_gate_off_the_replicas_filter_and_a_killed_replicas_shards_move() {
    sharded(false).await;
}

// ---------------------------------------------------------------------------------------
// RBAC

/// The namespace deploy/ installs into (its kustomization's `namespace`).
const DEPLOY_NAMESPACE: &str = "kube-event-bridge";
/// The overlay whose RBAC and config the test runs with: two watched kinds and a sink with a
/// checkpoint.
const OVERLAY: &str = "deploy/overlays/nats";

/// The YAML documents of a file, as JSON.
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    text.split("\n---")
        .filter(|doc| {
            doc.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|doc| {
            config::Config::builder()
                .add_source(config::File::from_str(doc, config::FileFormat::Yaml))
                .build()
                .and_then(|c| c.try_deserialize::<Value>())
                .unwrap_or_else(|e| panic!("{path:?}: {e}"))
        })
        .collect()
}

/// Strategic merge as far as deploy/ uses it (as scripts/check-deploy.py renders it): maps
/// merge recursively, lists of maps with a `name` merge by name, other lists are replaced.
fn merge(base: &Value, patch: &Value) -> Value {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            let mut out = b.clone();
            for (k, v) in p {
                let merged = match b.get(k) {
                    Some(old) => merge(old, v),
                    None => v.clone(),
                };
                out.insert(k.clone(), merged);
            }
            Value::Object(out)
        }
        (Value::Array(b), Value::Array(p))
            if b.iter().chain(p).all(|i| i.get("name").is_some()) =>
        {
            let mut out = b.clone();
            for item in p {
                match out.iter_mut().find(|o| o["name"] == item["name"]) {
                    Some(o) => *o = merge(o, item),
                    None => out.push(item.clone()),
                }
            }
            Value::Array(out)
        }
        _ => patch.clone(),
    }
}

/// The RBAC objects a kustomization directory installs (its own resources and its bases'
/// `rbac.yaml`, patched by its patches of RBAC kinds), namespaced ones in its namespace.
fn rbac_of(dir: &Path) -> Vec<Value> {
    let rbac_kinds = ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"];
    let k = &yaml_docs(&dir.join("kustomization.yaml"))[0];
    let mut objects = Vec::new();
    for r in k["resources"].as_array().into_iter().flatten() {
        let path = dir.join(r.as_str().unwrap());
        if path.is_dir() {
            objects.extend(rbac_of(&path));
        } else {
            objects.extend(
                yaml_docs(&path)
                    .into_iter()
                    .filter(|o| rbac_kinds.contains(&o["kind"].as_str().unwrap())),
            );
        }
    }
    for p in k["patches"].as_array().into_iter().flatten() {
        let patch = &yaml_docs(&dir.join(p["path"].as_str().unwrap()))[0];
        if !rbac_kinds.contains(&patch["kind"].as_str().unwrap()) {
            continue;
        }
        let target = objects
            .iter_mut()
            .find(|o| {
                o["kind"] == patch["kind"] && o["metadata"]["name"] == patch["metadata"]["name"]
            })
            .unwrap_or_else(|| panic!("patch {p} matches nothing"));
        *target = merge(target, patch);
    }
    if let Some(ns) = k["namespace"].as_str() {
        for o in &mut objects {
            if o["kind"] == "Role" || o["kind"] == "RoleBinding" {
                o["metadata"]["namespace"] = json!(ns);
            }
        }
    }
    objects
}

/// Creates or replaces each RBAC object.
async fn apply_rbac(client: &kube::Client, objects: &[Value]) {
    async fn put<K>(api: Api<K>, obj: &Value)
    where
        K: kube::Resource
            + Clone
            + serde::de::DeserializeOwned
            + serde::Serialize
            + std::fmt::Debug,
    {
        let name = obj["metadata"]["name"].as_str().unwrap();
        let mut typed: K = serde_json::from_value(obj.clone()).unwrap();
        let pp = PostParams::default();
        match api.get_opt(name).await.unwrap() {
            None => drop(api.create(&pp, &typed).await.unwrap()),
            Some(existing) => {
                typed.meta_mut().resource_version = existing.meta().resource_version.clone();
                drop(api.replace(name, &pp, &typed).await.unwrap());
            }
        }
    }
    for o in objects {
        let ns = o["metadata"]["namespace"]
            .as_str()
            .unwrap_or(DEPLOY_NAMESPACE);
        match o["kind"].as_str().unwrap() {
            "ClusterRole" => put::<ClusterRole>(Api::all(client.clone()), o).await,
            "ClusterRoleBinding" => put::<ClusterRoleBinding>(Api::all(client.clone()), o).await,
            "Role" => put::<Role>(Api::namespaced(client.clone(), ns), o).await,
            "RoleBinding" => put::<RoleBinding>(Api::namespaced(client.clone(), ns), o).await,
            other => panic!("not an RBAC kind: {other}"),
        }
    }
}

/// Whether the ServiceAccount may `verb` `group/resource` (all namespaces), as the API
/// server's authorizer answers now.
async fn allowed(client: &kube::Client, verb: &str, group: &str, resource: &str) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!(
                "system:serviceaccount:{DEPLOY_NAMESPACE}:kube-event-bridge"
            )),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{DEPLOY_NAMESPACE}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .is_some_and(|s| s.allowed)
}

/// The overlay's config with this test's NATS server, a loopback admin address, and a
/// replica identity (a pod gets it and the Lease namespace from `POD_NAME` and
/// `POD_NAMESPACE`).
fn overlay_config(overlay: &str, url: &str, identity: &str) -> Value {
    let mut config = yaml_docs(&Path::new(overlay).join("config.yaml")).remove(0);
    config["admin"] = json!({"address": "127.0.0.1:0"});
    let sinks = config["sinks"].as_array_mut().unwrap();
    assert_eq!(sinks.len(), 1, "{sinks:?}");
    sinks[0]["nats"] = nats_sink("nats", url, json!({}))["nats"].clone();
    let le = &mut config["leader_election"];
    le["identity"] = json!(identity);
    le["namespace"] = json!(DEPLOY_NAMESPACE);
    le["lease_duration"] = json!("4s");
    le["renew_deadline"] = json!("3s");
    le["retry_period"] = json!("250ms");
    config
}

/// Waits until the stream's fold ends with the API server's objects of `kind`.
async fn caught_up(
    cluster: &Cluster,
    url: &str,
    kind: &str,
    resource: &ApiResource,
    replica: &Replica,
) {
    let mut found = Differences::default();
    let ok = wait::within(
        Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(500)),
        async || {
            found = compare(cluster, &read(url).await, kind, resource).await;
            found.is_empty()
        },
    )
    .await;
    eprintln!("{kind}: {}", counts(&found));
    if !ok {
        dump(std::slice::from_ref(replica));
    }
    assert!(ok, "{kind}: {found:?}");
}

/// What the replica's `/readyz` answers: status and body (0 before it serves).
async fn ready(replica: &Replica) -> (u16, String) {
    match replica.admin() {
        Some(a) => support::http_get(a, "/readyz").await,
        None => (0, String::new()),
    }
}

/// Waits until the replica's `/readyz` answers 200 and `also` holds; fails at once if the
/// replica could not start.
async fn wait_ready(replica: &Replica, mut also: impl AsyncFnMut() -> bool) {
    let failed = || replica.log().contains("cannot start");
    let ok = wait::within(Patience::of(Duration::from_secs(60)), async || {
        failed() || (ready(replica).await.0 == 200 && also().await)
    })
    .await;
    if !ok || failed() {
        dump(std::slice::from_ref(replica));
        panic!(
            "{} not ready: /readyz {:?}\n{}",
            replica.identity,
            ready(replica).await,
            replica.log()
        );
    }
}

/// `keb_informer_forbidden` of each informer (`v1/configmaps`, `apps/v1/deployments`).
async fn forbidden_gauges(replica: &Replica) -> BTreeMap<String, f64> {
    samples(&replica_metrics(replica).await, "keb_informer_forbidden")
}

/// Changes made while a replica runs: ConfigMaps and Deployments in `shop` updated, one of
/// each deleted, one of each created (names with `round`).
async fn change(client: &kube::Client, round: &str) {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "shop");
    let deps: Api<Deployment> = Api::namespaced(client.clone(), "shop");
    let (pp, patch) = (PatchParams::default(), PatchParams::default());
    for i in 0..5 {
        cms.patch(
            &format!("cm-{i}"),
            &patch,
            &Patch::Merge(json!({"data": {"v": round}})),
        )
        .await
        .unwrap();
    }
    deps.patch(
        "web-0",
        &pp,
        &Patch::Merge(json!({"metadata": {"annotations": {"round": round}}})),
    )
    .await
    .unwrap();
    cms.delete(&format!("cm-{round}-gone"), &DeleteParams::default())
        .await
        .unwrap();
    deps.delete(&format!("web-{round}-gone"), &DeleteParams::default())
        .await
        .unwrap();
    cms.create(
        &PostParams::default(),
        &configmap("shop", &format!("cm-{round}-new"), round),
    )
    .await
    .unwrap();
    deps.create(
        &PostParams::default(),
        &deployment("shop", &format!("web-{round}-new"), 1, 0, "nginx"),
    )
    .await
    .unwrap();
}

/// RBAC on a real API server: the bridge with the token of a ServiceAccount bound to exactly
/// the roles `deploy/overlays/nats` installs, running that overlay's config (Deployments and
/// ConfigMaps to NATS, leader election, checkpoints) does everything it needs: lists and
/// watches both kinds, identifies the cluster, holds the Lease, publishes, and nothing is
/// refused. Then with `watch` on Deployments taken away: the new replica reports Deployments
/// forbidden (`/readyz`, `keb_informer_forbidden`) while ConfigMaps keep running; granted
/// again, Deployments catch up without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deploy_rbac_is_enough_and_a_missing_verb_is_reported() {
    let started = tokio::time::Instant::now();
    let cluster = Cluster::start().await;
    let admin = cluster.client().await;
    cluster.create_namespace(DEPLOY_NAMESPACE).await;
    cluster.create_namespace("shop").await;
    let rbac = rbac_of(Path::new(OVERLAY));
    let kinds: Vec<String> = rbac
        .iter()
        .map(|o| {
            format!(
                "{} {}",
                o["kind"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    eprintln!("{OVERLAY} RBAC: {kinds:?}");
    apply_rbac(&admin, &rbac).await;
    let kubeconfig = service_account_kubeconfig(&cluster).await;

    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), "shop");
    let deps: Api<Deployment> = Api::namespaced(admin.clone(), "shop");
    let pp = PostParams::default();
    for name in [
        "cm-0",
        "cm-1",
        "cm-2",
        "cm-3",
        "cm-4",
        "cm-a-gone",
        "cm-b-gone",
    ] {
        cms.create(&pp, &configmap("shop", name, "0"))
            .await
            .unwrap();
    }
    for name in ["web-0", "web-a-gone", "web-b-gone"] {
        deps.create(&pp, &deployment("shop", name, 1, 0, "nginx"))
            .await
            .unwrap();
    }

    let nats = NatsServer::start();
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let mut first = Replica::start(
        dir.path(),
        "replica-1",
        &overlay_config(OVERLAY, &url, "replica-1"),
        &kubeconfig,
    );
    wait_ready(&first, async || true).await;
    change(&admin, "a").await;
    caught_up(&cluster, &url, "ConfigMap", &configmaps(), &first).await;
    caught_up(&cluster, &url, "Deployment", &deployments(), &first).await;
    let (code, body) = ready(&first).await;
    let refused = refusals(&first);
    let holder = Api::<Lease>::namespaced(admin.clone(), DEPLOY_NAMESPACE)
        .get("kube-event-bridge")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity);
    eprintln!(
        "with {OVERLAY}'s RBAC: /readyz {code} {body:?}, Lease held by {holder:?}, {} log \
         lines about refusals, forbidden gauges {:?}",
        refused.len(),
        forbidden_gauges(&first).await
    );
    assert!(refused.is_empty(), "{refused:#?}");
    assert_eq!((code, body.trim()), (200, "ok"));
    assert_eq!(holder.as_deref(), Some("replica-1"));
    assert!(
        forbidden_gauges(&first).await.values().all(|v| *v == 0.0),
        "{:?}",
        forbidden_gauges(&first).await
    );
    first.terminate();

    // One verb fewer: no watch on Deployments.
    let mut fewer = rbac.clone();
    let role = fewer
        .iter_mut()
        .find(|o| o["kind"] == "ClusterRole")
        .unwrap();
    let rule = role["rules"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|r| r["resources"] == json!(["deployments"]))
        .expect("a rule for Deployments");
    rule["verbs"] = json!(["list"]);
    apply_rbac(&admin, &fewer).await;
    wait::until("watch on Deployments refused", wait::PATIENCE, async || {
        !allowed(&admin, "watch", "apps", "deployments").await
    })
    .await;
    let second = Replica::start(
        dir.path(),
        "replica-2",
        &overlay_config(OVERLAY, &url, "replica-2"),
        &kubeconfig,
    );
    let deployments_forbidden = async || {
        forbidden_gauges(&second)
            .await
            .get("{resource=\"apps/v1/deployments\"}")
            == Some(&1.0)
    };
    wait_ready(&second, deployments_forbidden).await;
    let (code, body) = ready(&second).await;
    let gauges = forbidden_gauges(&second).await;
    eprintln!("without watch on Deployments: /readyz {code} {body:?}, forbidden gauges {gauges:?}");
    assert_eq!(gauges.get("{resource=\"v1/configmaps\"}"), Some(&0.0));
    assert!(
        body.contains(
            "informer apps/v1/deployments: forbidden to watch /apis/apps/v1/deployments (403"
        ),
        "/readyz names the refused verb and resource: {body:?}"
    );
    let log = second.log();
    assert!(
        log.lines()
            .any(|l| l.contains("forbidden to watch /apis/apps/v1/deployments")),
        "the log names it"
    );
    change(&admin, "b").await;
    caught_up(&cluster, &url, "ConfigMap", &configmaps(), &second).await;
    // The refused kind received none of those changes (it lists, but cannot watch).
    let behind = compare(&cluster, &read(&url).await, "Deployment", &deployments()).await;
    eprintln!("Deployment while refused: {}", counts(&behind));
    assert_eq!(
        behind,
        Differences {
            lost_deletes: vec!["shop/web-b-gone".into()],
            phantom_deletes: vec![],
            stale: vec!["shop/web-0".into()],
            missing: vec!["shop/web-b-new".into()],
        }
    );

    // Granted again: the Deployments' changes arrive without a restart.
    apply_rbac(&admin, &rbac).await;
    caught_up(&cluster, &url, "Deployment", &deployments(), &second).await;
    wait::until("the forbidden gauge cleared", wait::PATIENCE, async || {
        !deployments_forbidden().await
    })
    .await;
    let (code, body) = ready(&second).await;
    assert_eq!((code, body.trim()), (200, "ok"));
    eprintln!("test took {:?}", started.elapsed());
}

/// Creates the ServiceAccount `kube-event-bridge` in [`DEPLOY_NAMESPACE`] and writes a
/// kubeconfig with a token for it from the TokenRequest API (this cluster runs no token
/// controller); returns its path.
async fn service_account_kubeconfig(cluster: &Cluster) -> PathBuf {
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.client().await, DEPLOY_NAMESPACE);
    accounts
        .create(&PostParams::default(), &named(None, "kube-event-bridge"))
        .await
        .unwrap();
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let token = accounts
        .create_token_request("kube-event-bridge", &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token;
    cluster.kubeconfig_for("kube-event-bridge", &token)
}

/// Log lines of `replica` that speak of a refusal (403, forbidden).
fn refusals(replica: &Replica) -> Vec<String> {
    replica
        .log()
        .lines()
        .filter(|l| {
            ["(403", "code: 403", "refused"]
                .iter()
                .any(|w| l.contains(w))
                || l.to_lowercase().contains("forbidden")
        })
        .map(str::to_owned)
        .collect()
}

/// The sharded overlay's RBAC on a real API server (its Lease Role patched for the shard
/// Leases): two replicas with the token of a ServiceAccount bound to exactly what
/// `deploy/overlays/sharded` installs, running that overlay's config (12 shards of
/// Deployments and ConfigMaps), take every shard's Lease, publish both kinds, and nothing is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sharded_overlay_rbac_is_enough() {
    const SHARDED: &str = "deploy/overlays/sharded";
    const SHARDED_SHARDS: u32 = 12;
    let cluster = Cluster::start().await;
    let admin = cluster.client().await;
    cluster.create_namespace(DEPLOY_NAMESPACE).await;
    cluster.create_namespace("shop").await;
    apply_rbac(&admin, &rbac_of(Path::new(SHARDED))).await;
    let kubeconfig = service_account_kubeconfig(&cluster).await;
    let pp = PostParams::default();
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), "shop");
    let deps: Api<Deployment> = Api::namespaced(admin.clone(), "shop");
    for i in 0..10 {
        cms.create(&pp, &configmap("shop", &format!("cm-{i}"), "0"))
            .await
            .unwrap();
    }
    deps.create(&pp, &deployment("shop", "web-0", 1, 0, "nginx"))
        .await
        .unwrap();

    let nats = NatsServer::start();
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let replicas: Vec<Replica> = ["replica-1", "replica-2"]
        .into_iter()
        .map(|id| {
            Replica::start(
                dir.path(),
                id,
                &overlay_config(SHARDED, &url, id),
                &kubeconfig,
            )
        })
        .collect();
    let leases: Api<Lease> = Api::namespaced(admin.clone(), DEPLOY_NAMESPACE);
    let mut holders = Vec::new();
    let held = wait::within(Patience::of(Duration::from_secs(90)), async || {
        holders.clear();
        for s in 0..SHARDED_SHARDS {
            let lease = leases
                .get_opt(&format!("kube-event-bridge-shard-{s}-of-{SHARDED_SHARDS}"))
                .await
                .unwrap();
            holders.push(lease.and_then(|l| l.spec?.holder_identity));
        }
        holders.iter().all(Option::is_some)
    })
    .await;
    if !held {
        dump(&replicas);
    }
    assert!(held, "every shard Lease held: {holders:?}");
    caught_up(&cluster, &url, "ConfigMap", &configmaps(), &replicas[0]).await;
    caught_up(&cluster, &url, "Deployment", &deployments(), &replicas[0]).await;
    let refused: Vec<String> = replicas.iter().flat_map(refusals).collect();
    eprintln!(
        "with {SHARDED}'s RBAC: shard Leases held {holders:?}, {} log lines about refusals",
        refused.len()
    );
    assert!(refused.is_empty(), "{refused:#?}");
}
