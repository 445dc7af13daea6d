//! A local Kubernetes API test server: axum on 127.0.0.1:0, speaking the real HTTP protocol
//! (CLIENT-GO-SEMANTICS.md §6) over real Kubernetes JSON objects, with fault injection.
//!
//! Served: `/version`, discovery (`/api`, `/apis`, `/api/v1`, `/apis/{g}/{v}`), and for every
//! registered resource, list (limit/continue with one snapshot per paged list, resourceVersion
//! semantics, 410 for expired RVs and continue tokens, 504 "too large") and watch (chunked JSON
//! lines, history replay from an RV, synthetic ADDEDs for RV ""/"0", `sendInitialEvents` with
//! the initial-events-end bookmark, bookmarks, ERROR 410 for compacted RVs, `timeoutSeconds`,
//! selectors with ADDED/DELETED when an object starts/stops matching).
//!
//! Faults: `drop_watches` (connections cut mid-stream), `block_watches` (429 with Retry-After),
//! `inject_watch_lines` (bad input on the wire),
//! `fail_next_lists` and `throttle_every` (429), `compact` and `trim_history` (history gone: old RVs get 410), `expire_continue_tokens`,
//! `backup` and `restore` (etcd restored: resourceVersions go back, a watch from a newer one
//! gets 504 "Too large resource version"), `serve_stale_cache` (reads at resourceVersion "0"
//! served from an older state, as a lagging watch cache does).
//! Test code only; never shipped.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Query, State},
    http::{Response, StatusCode, Uri},
};
use futures::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

/// A kind the server serves.
#[derive(Clone, Debug)]
pub struct ResourceDef {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    pub namespaced: bool,
    pub verbs: &'static [&'static str],
    /// Custom resources carry kind/apiVersion on list items; built-ins do not.
    pub custom: bool,
    /// Discovery lists it and its paths answer (a deleted CRD's kind is not served).
    pub served: bool,
}

impl ResourceDef {
    fn group_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

const RW: &[&str] = &[
    "create", "delete", "get", "list", "patch", "update", "watch",
];

/// The kinds every server serves.
pub fn default_resources() -> Vec<ResourceDef> {
    let d = |group, version, kind, plural, namespaced, custom| ResourceDef {
        group,
        version,
        kind,
        plural,
        namespaced,
        verbs: RW,
        custom,
        served: true,
    };
    vec![
        d("", "v1", "ConfigMap", "configmaps", true, false),
        d("", "v1", "Secret", "secrets", true, false),
        d("", "v1", "Namespace", "namespaces", false, false),
        d("apps", "v1", "Deployment", "deployments", true, false),
        d("example.com", "v1", "Widget", "widgets", true, true),
        d("coordination.k8s.io", "v1", "Lease", "leases", true, false),
        d(
            "apiextensions.k8s.io",
            "v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
            false,
            false,
        ),
        ResourceDef {
            verbs: &["create"],
            ..d("", "v1", "Binding", "bindings", true, false)
        },
    ]
}

#[derive(Clone, Debug)]
struct HistoryEvent {
    rv: u64,
    resource: usize,
    ty: &'static str,
    old: Option<Value>,
    obj: Value,
}

/// A paged list's objects, as of its first page.
type Snapshot = Arc<Vec<Arc<Value>>>;

#[derive(Default)]
struct Store {
    rv: u64,
    compacted: u64,
    next_uid: u64,
    // (resource index, namespace, name) → object (shared, so that a list's snapshot costs a
    // pointer per object, not a copy)
    objects: BTreeMap<(usize, String, String), Arc<Value>>,
    history: Vec<HistoryEvent>,
    // Shared, so that each continue page costs its own size, not the whole list's.
    snapshots: HashMap<u64, (u64, Snapshot)>,
    next_snapshot: u64,
}

#[derive(Default)]
struct Faults {
    /// Plurals whose list and watch get 403 Forbidden.
    forbidden: std::collections::HashSet<String>,
    /// Bookmarks on open watches this often (the real server: about every minute).
    bookmark_interval: Option<Duration>,
    block_watches: bool,
    fail_next_lists: u32,
    // Each list request (every page) is answered this much later.
    list_delay: Option<Duration>,
    // Every n-th list or watch request gets 429 with Retry-After; with the count so far.
    throttle_every: Option<u32>,
    throttle_seen: u32,
    // Lease writes (create or replace) naming this holder get 503: a leader whose renewals
    // no longer reach the API server.
    refuse_lease_holder: Option<String>,
    // Groups whose discovery (`/apis/{g}/{v}`) answers 500: an aggregated API that is down.
    failing_discovery: std::collections::HashSet<String>,
    // Groups left out of discovery (as right after an API server's start) while their
    // objects are still served.
    hidden_groups: std::collections::HashSet<String>,
    // (group, plural) → versions a CRD serves besides its preferred one (a migration).
    also_served: HashMap<(String, String), Vec<String>>,
    // What reads at resourceVersion "0" (any cached state) are served: a watch cache that
    // lags behind etcd (as another API server's can).
    stale_cache: Option<Backup>,
    // The kube-system namespace's uid (one fixed value unless a test sets another).
    cluster_uid: String,
    // Whether `shardSelector` is applied (the ShardedListAndWatch gate); on unless a test
    // turns it off.
    shard_selectors: bool,
}

/// The objects and resourceVersion at one moment (see [`ApiServer::backup`]).
#[derive(Clone)]
pub struct Backup {
    rv: u64,
    objects: BTreeMap<(usize, String, String), Arc<Value>>,
}

/// Requests seen per collection path.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts {
    /// List requests, each page one.
    pub lists: u32,
    /// Lists begun: requests without a `continue` token (a paged list's first page).
    pub lists_begun: u32,
    pub watches: u32,
}

struct Shared {
    resources: std::sync::RwLock<Vec<ResourceDef>>,
    // Bumped to make every open watch go silent (connection kept, nothing sent).
    stall: watch::Sender<u64>,
    store: Mutex<Store>,
    events: broadcast::Sender<HistoryEvent>,
    kill: watch::Sender<u64>,
    // Raw lines every open watch sends next (bad input on the wire).
    inject: watch::Sender<Vec<Bytes>>,
    faults: Mutex<Faults>,
    counts: Mutex<HashMap<String, Counts>>,
    // The `limit` of every list request, per collection path, in order.
    list_limits: Mutex<HashMap<String, Vec<Option<usize>>>>,
    addr: Mutex<Option<SocketAddr>>,
    // Bytes of list and watch responses sent.
    bytes_sent: std::sync::atomic::AtomicU64,
    // List requests being answered now, and the most at any moment.
    lists_in_flight: std::sync::atomic::AtomicU32,
    most_lists_in_flight: std::sync::atomic::AtomicU32,
}

/// A running test server; stops when dropped.
pub struct ApiServer {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn json_response(code: StatusCode, body: &impl serde::Serialize) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

fn too_many_requests() -> Response<Body> {
    let mut body = status(
        429,
        "TooManyRequests",
        "too many requests, please try again later",
    );
    body["details"] = json!({"retryAfterSeconds": 1});
    let mut r = json_response(StatusCode::TOO_MANY_REQUESTS, &body);
    r.headers_mut().insert("retry-after", "1".parse().unwrap());
    r
}

impl ApiServer {
    /// Starts a server with [`default_resources`].
    pub async fn start() -> Self {
        Self::with_resources(default_resources()).await
    }

    pub async fn with_resources(resources: Vec<ResourceDef>) -> Self {
        let shared = Arc::new(Shared {
            resources: std::sync::RwLock::new(resources),
            stall: watch::channel(0).0,
            store: Mutex::new(Store {
                rv: 100,
                next_uid: 1,
                ..Default::default()
            }),
            events: broadcast::channel(100_000).0,
            kill: watch::channel(0).0,
            inject: watch::channel(Vec::new()).0,
            faults: Mutex::new(Faults {
                bookmark_interval: Some(Duration::from_secs(60)),
                cluster_uid: "0b5e2f9c-test-cluster".into(),
                shard_selectors: true,
                ..Default::default()
            }),
            counts: Mutex::default(),
            list_limits: Mutex::default(),
            addr: Mutex::default(),
            bytes_sent: Default::default(),
            lists_in_flight: Default::default(),
            most_lists_in_flight: Default::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        *shared.addr.lock().unwrap() = Some(addr);
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { addr, shared, task }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server.
    pub fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url().parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    /// Writes a kubeconfig pointing at this server into `dir`; returns its path.
    pub fn write_kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\nusers:\n- name: test\n  user:\n    token: not-a-secret\n",
            self.url()
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    fn resource_of(&self, api_version: &str, kind: &str) -> usize {
        self.shared
            .resources
            .read()
            .unwrap()
            .iter()
            .position(|r| r.group_version() == api_version && r.kind == kind)
            .unwrap_or_else(|| panic!("test server does not serve {api_version} {kind}"))
    }

    fn write(&self, ty: &'static str, obj: impl Serialize) -> Value {
        self.shared
            .apply(ty, serde_json::to_value(obj).unwrap(), false)
            .unwrap_or_else(|(_, reason, msg)| panic!("{reason}: {msg}"))
    }

    /// Creates an object (any serializable object with apiVersion, kind, metadata.name).
    pub fn create(&self, obj: impl Serialize) -> Value {
        self.write("ADDED", obj)
    }

    /// Replaces an existing object; it gets a new resourceVersion.
    pub fn update(&self, obj: impl Serialize) -> Value {
        self.write("MODIFIED", obj)
    }

    /// Deletes an object; watchers get its last state with the deletion's resourceVersion.
    pub fn delete(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Value {
        let res = self.resource_of(api_version, kind);
        self.shared
            .remove(res, namespace, name, None)
            .unwrap_or_else(|(_, reason, msg)| panic!("{reason}: {msg}"))
    }

    /// Forgets all history: watches from any earlier resourceVersion get ERROR 410.
    pub fn compact(&self) {
        let mut store = self.shared.store.lock().unwrap();
        store.compacted = store.rv;
        store.history.clear();
    }

    /// The objects and resourceVersion as they are now (etcd's snapshot).
    pub fn backup(&self) -> Backup {
        let store = self.shared.store.lock().unwrap();
        Backup {
            rv: store.rv,
            objects: store.objects.clone(),
        }
    }

    /// etcd restored from `backup`: objects and resourceVersion go back to it, the history is
    /// gone (a watch from an older resourceVersion gets 410, from a newer one "Too large
    /// resource version") and every open watch connection is cut.
    pub fn restore(&self, backup: &Backup) {
        {
            let mut store = self.shared.store.lock().unwrap();
            store.rv = backup.rv;
            store.compacted = backup.rv;
            store.objects = backup.objects.clone();
            store.history.clear();
            store.snapshots.clear();
        }
        self.drop_watches();
    }

    /// While set, reads at resourceVersion "0" (lists, watches and watch-lists that accept
    /// any cached state) are served from `backup` (a lagging watch cache); watches from it then
    /// replay what changed after it. Consistent reads (resourceVersion unset) are not.
    pub fn serve_stale_cache(&self, backup: Option<Backup>) {
        self.shared.faults.lock().unwrap().stale_cache = backup;
    }

    /// Every object of `kind` (`api_version`) the server holds, by `namespace/name` (or name):
    /// its uid and resourceVersion.
    pub fn objects(&self, api_version: &str, kind: &str) -> BTreeMap<String, (String, String)> {
        let res = self.resource_of(api_version, kind);
        let store = self.shared.store.lock().unwrap();
        store
            .objects
            .iter()
            .filter(|((r, _, _), _)| *r == res)
            .map(|((_, ns, name), obj)| {
                let key = if ns.is_empty() {
                    name.clone()
                } else {
                    format!("{ns}/{name}")
                };
                let meta = &obj["metadata"];
                (
                    key,
                    (
                        meta["uid"].as_str().unwrap_or_default().to_owned(),
                        meta["resourceVersion"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                    ),
                )
            })
            .collect()
    }

    /// The uid of namespace kube-system: what identifies the cluster.
    pub fn cluster_uid(&self) -> String {
        self.shared.faults.lock().unwrap().cluster_uid.clone()
    }

    /// Makes this server another cluster: namespace kube-system gets uid `uid`.
    pub fn set_cluster_uid(&self, uid: &str) {
        self.shared.faults.lock().unwrap().cluster_uid = uid.to_owned();
    }

    /// Cuts every open watch connection mid-stream (no clean end).
    pub fn drop_watches(&self) {
        self.shared.kill.send_modify(|g| *g += 1);
    }

    /// Every open watch sends these raw lines next, as they are (malformed JSON, truncated
    /// objects, unknown event types: what a broken proxy or server might send).
    pub fn inject_watch_lines(&self, lines: &[&str]) {
        let lines = lines
            .iter()
            .map(|l| Bytes::from(format!("{l}\n")))
            .collect();
        self.shared.inject.send_replace(lines);
    }

    /// While set, new watch requests get 429 with Retry-After.
    pub fn block_watches(&self, blocked: bool) {
        self.shared.faults.lock().unwrap().block_watches = blocked;
    }

    /// List and watch of `plural` get 403 Forbidden while `forbidden` is set (RBAC that
    /// does not grant them).
    pub fn forbid(&self, plural: &str, forbidden: bool) {
        let mut f = self.shared.faults.lock().unwrap();
        if forbidden {
            f.forbidden.insert(plural.to_owned());
        } else {
            f.forbidden.remove(plural);
        }
    }

    /// List and watch of `plural` in namespace `namespace` get 403 Forbidden while
    /// `forbidden` is set (a Role granted in some namespaces only).
    pub fn forbid_in_namespace(&self, plural: &str, namespace: &str, forbidden: bool) {
        self.forbid(&format!("{plural}/{namespace}"), forbidden);
    }

    /// Watches opened from now on send a bookmark this often when idle (default: a minute,
    /// as the real server; `None`: only when they time out).
    pub fn set_bookmark_interval(&self, every: Option<Duration>) {
        self.shared.faults.lock().unwrap().bookmark_interval = every;
    }

    /// Every open watch goes silent: the connection stays open, nothing more is sent (no
    /// event, no bookmark), as behind a proxy that lost the stream. New watches are normal.
    pub fn stall_watches(&self) {
        self.shared.stall.send_modify(|g| *g += 1);
    }

    /// Installs a CRD: its kind is served from now on (discovery, list, watch, writes) and its
    /// CustomResourceDefinition object is created (watchers of CRDs see it).
    pub fn install_crd(
        &self,
        group: &str,
        version: &str,
        kind: &str,
        plural: &str,
        namespaced: bool,
    ) -> Value {
        let leak = |s: &str| -> &'static str { Box::leak(s.to_owned().into_boxed_str()) };
        {
            let mut resources = self.shared.resources.write().unwrap();
            match resources
                .iter_mut()
                .find(|r| r.group == group && r.version == version && r.plural == plural)
            {
                Some(r) => r.served = true,
                None => resources.push(ResourceDef {
                    group: leak(group),
                    version: leak(version),
                    kind: leak(kind),
                    plural: leak(plural),
                    namespaced,
                    verbs: RW,
                    custom: true,
                    served: true,
                }),
            }
        }
        self.create(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": format!("{plural}.{group}")},
            "spec": {
                "group": group,
                "names": {"kind": kind, "plural": plural},
                "scope": if namespaced { "Namespaced" } else { "Cluster" },
                "versions": [{"name": version, "served": true, "storage": true}],
            },
            "status": {"conditions": [{"type": "Established", "status": "True"}]},
        }))
    }

    /// Deletes a CRD as the real server does: every object of its kind is deleted (watchers
    /// see each DELETED), the kind is no longer served, then the CRD object goes.
    pub fn delete_crd(&self, group: &str, plural: &str) {
        let (res, def) = {
            let resources = self.shared.resources.read().unwrap();
            let res = resources
                .iter()
                .position(|r| r.group == group && r.plural == plural && r.served)
                .unwrap_or_else(|| panic!("no served CRD {plural}.{group}"));
            (res, resources[res].clone())
        };
        let objects: Vec<(String, String)> = self
            .shared
            .store
            .lock()
            .unwrap()
            .objects
            .keys()
            .filter(|(r, _, _)| *r == res)
            .map(|(_, ns, name)| (ns.clone(), name.clone()))
            .collect();
        for (ns, name) in objects {
            self.delete(&def.group_version(), def.kind, &ns, &name);
        }
        self.shared.resources.write().unwrap()[res].served = false;
        self.delete(
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "",
            &format!("{plural}.{group}"),
        );
    }

    /// While `failing`, discovery of `group`'s versions answers 500 (an aggregated API that is
    /// down, a timeout); list, watch and the group list still work.
    pub fn fail_discovery(&self, group: &str, failing: bool) {
        let mut f = self.shared.faults.lock().unwrap();
        if failing {
            f.failing_discovery.insert(group.to_owned());
        } else {
            f.failing_discovery.remove(group);
        }
    }

    /// While `hidden`, `group` is missing from discovery (the group list, and 404 for its
    /// versions), as in the first moments of an API server's start; its objects stay served.
    pub fn hide_from_discovery(&self, group: &str, hidden: bool) {
        let mut f = self.shared.faults.lock().unwrap();
        if hidden {
            f.hidden_groups.insert(group.to_owned());
        } else {
            f.hidden_groups.remove(group);
        }
    }

    /// A CRD's served version changes to `version` (a storage migration: v1beta1 → v1): the
    /// same objects (uid and resourceVersion kept) are served at the new version only, and
    /// discovery names only it. Watches already open go on.
    pub fn serve_crd_at(&self, group: &str, plural: &str, version: &str) {
        let version: &'static str = Box::leak(version.to_owned().into_boxed_str());
        let res = {
            let mut resources = self.shared.resources.write().unwrap();
            let res = resources
                .iter()
                .position(|r| r.group == group && r.plural == plural && r.served)
                .unwrap_or_else(|| panic!("no served CRD {plural}.{group}"));
            resources[res].version = version;
            res
        };
        let api_version = format!("{group}/{version}");
        let mut store = self.shared.store.lock().unwrap();
        for ((r, _, _), obj) in store.objects.iter_mut() {
            if *r == res {
                Arc::make_mut(obj)["apiVersion"] = json!(api_version);
            }
        }
    }

    /// A CRD serves its objects at `version` too, besides its preferred version (a storage
    /// migration's overlap: both versions listed in discovery, the preferred one first). The
    /// objects are not converted: they keep the preferred version's apiVersion.
    pub fn serve_crd_also_at(&self, group: &str, plural: &str, version: &str) {
        self.shared
            .faults
            .lock()
            .unwrap()
            .also_served
            .entry((group.to_owned(), plural.to_owned()))
            .or_default()
            .push(version.to_owned());
    }

    /// Lease writes naming `holder` get 503 from now on (`None` lifts it).
    /// Bytes of list and watch responses sent so far.
    pub fn bytes_sent(&self) -> u64 {
        self.shared
            .bytes_sent
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns the `ShardedListAndWatch` gate on or off (on by default): off, `shardSelector`
    /// is ignored and lists echo no `shardInfo`, as on a server without the gate.
    pub fn set_shard_selectors(&self, on: bool) {
        self.shared.faults.lock().unwrap().shard_selectors = on;
    }

    pub fn refuse_lease_writes_from(&self, holder: Option<&str>) {
        self.shared.faults.lock().unwrap().refuse_lease_holder = holder.map(str::to_owned);
    }

    /// The object at `api_version`/`kind` `namespace/name`, if any.
    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let res = self.resource_of(api_version, kind);
        let ns = if self.shared.def(res).namespaced {
            namespace
        } else {
            ""
        };
        self.shared
            .store
            .lock()
            .unwrap()
            .objects
            .get(&(res, ns.to_owned(), name.to_owned()))
            .map(|o| Value::clone(o))
    }

    /// The holder of the Lease `kube-system/kube-event-bridge` (the default leader election
    /// lease), if it is held.
    pub fn lease_holder(&self) -> Option<String> {
        self.lease_holder_of("kube-event-bridge")
    }

    /// The holder of the Lease `kube-system/{name}`, if it is held.
    pub fn lease_holder_of(&self, name: &str) -> Option<String> {
        self.get("coordination.k8s.io/v1", "Lease", "kube-system", name)?["spec"]["holderIdentity"]
            .as_str()
            .filter(|h| !h.is_empty())
            .map(str::to_owned)
    }

    /// Every list request (each page) is answered `delay` later; `None`: at once.
    pub fn delay_lists(&self, delay: Option<Duration>) {
        self.shared.faults.lock().unwrap().list_delay = delay;
    }

    /// The most list requests (pages) that were being answered at one moment.
    pub fn most_lists_in_flight(&self) -> u32 {
        self.shared
            .most_lists_in_flight
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The next `n` list requests get 429 with Retry-After.
    pub fn fail_next_lists(&self, n: u32) {
        self.shared.faults.lock().unwrap().fail_next_lists = n;
    }

    /// From now on every `n`-th list or watch request gets 429 with Retry-After (`n = 3`: a
    /// third of them); `None` stops it.
    pub fn throttle_every(&self, n: Option<u32>) {
        let mut f = self.shared.faults.lock().unwrap();
        f.throttle_every = n.filter(|n| *n > 0);
        f.throttle_seen = 0;
    }

    /// Keeps only the newest `keep` events of the watch history, as etcd compaction does: a
    /// watch from an older resourceVersion gets ERROR 410. Long runs call it to bound memory.
    pub fn trim_history(&self, keep: usize) {
        let mut store = self.shared.store.lock().unwrap();
        let drop = store.history.len().saturating_sub(keep);
        if drop > 0 {
            let last = store.history[drop - 1].rv;
            store.history.drain(..drop);
            store.compacted = store.compacted.max(last);
        }
    }

    /// Continue tokens handed out so far become invalid (410 Expired).
    pub fn expire_continue_tokens(&self) {
        self.shared.store.lock().unwrap().snapshots.clear();
    }

    /// Lists and watches seen on a collection path such as `/api/v1/configmaps`.
    pub fn counts(&self, path: &str) -> Counts {
        self.shared
            .counts
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or_default()
    }

    /// The `limit` of each list request on a collection path, in order (`None`: unpaged).
    pub fn list_limits(&self, path: &str) -> Vec<Option<usize>> {
        (self.shared.list_limits.lock().unwrap())
            .get(path)
            .cloned()
            .unwrap_or_default()
    }

    /// Every collection path with its counts.
    pub fn all_counts(&self) -> HashMap<String, Counts> {
        self.shared.counts.lock().unwrap().clone()
    }
}

impl Shared {
    /// The definition of resource `i`.
    fn def(&self, i: usize) -> ResourceDef {
        self.resources.read().unwrap()[i].clone()
    }

    /// Creates (`ADDED`) or replaces (`MODIFIED`) an object and records the watch event. With
    /// `check_rv`, a replace must carry the current resourceVersion (optimistic concurrency).
    /// Errors are (HTTP code, reason, message).
    /// Removes object `namespace/name` of resource `res` (if its resourceVersion is
    /// `precondition`, when given, as the real server checks a DeleteOptions' preconditions):
    /// watchers get its last state with the deletion's resourceVersion.
    fn remove(
        &self,
        res: usize,
        namespace: &str,
        name: &str,
        precondition: Option<&str>,
    ) -> Result<Value, (u16, &'static str, String)> {
        let ns = if self.def(res).namespaced {
            namespace
        } else {
            ""
        };
        let mut store = self.store.lock().unwrap();
        let key = (res, ns.to_owned(), name.to_owned());
        let Some(current) = store.objects.get(&key) else {
            return Err((
                404,
                "NotFound",
                format!("{namespace}/{name} does not exist"),
            ));
        };
        if let Some(rv) = precondition
            && current["metadata"]["resourceVersion"].as_str() != Some(rv)
        {
            return Err((
                409,
                "Conflict",
                format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    current["metadata"]["resourceVersion"]
                ),
            ));
        }
        let mut obj = Arc::unwrap_or_clone(store.objects.remove(&key).expect("present"));
        store.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(store.rv.to_string());
        let ev = HistoryEvent {
            rv: store.rv,
            resource: res,
            ty: "DELETED",
            old: None,
            obj: obj.clone(),
        };
        store.history.push(ev.clone());
        let _ = self.events.send(ev);
        Ok(obj)
    }

    fn apply(
        &self,
        ty: &'static str,
        mut obj: Value,
        check_rv: bool,
    ) -> Result<Value, (u16, &'static str, String)> {
        let (api_version, kind) = (
            obj["apiVersion"].as_str().unwrap_or(""),
            obj["kind"].as_str().unwrap_or(""),
        );
        let res = self
            .resources
            .read()
            .unwrap()
            .iter()
            .position(|r| r.group_version() == api_version && r.kind == kind && r.served)
            .ok_or((
                404,
                "NotFound",
                format!("no resource for {api_version} {kind}"),
            ))?;
        let def = &self.def(res);
        let ns = if def.namespaced {
            obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_owned()
        } else {
            String::new()
        };
        let name = obj["metadata"]["name"]
            .as_str()
            .ok_or((422, "Invalid", "metadata.name: Required value".into()))?
            .to_owned();
        let mut store = self.store.lock().unwrap();
        let key = (res, ns.clone(), name.clone());
        let old = store.objects.get(&key).map(|o| Value::clone(o));
        match (ty, &old) {
            ("ADDED", Some(_)) => {
                return Err((
                    409,
                    "AlreadyExists",
                    format!("{} \"{name}\" already exists", def.plural),
                ));
            }
            ("MODIFIED", None) => {
                return Err((
                    404,
                    "NotFound",
                    format!("{} \"{name}\" not found", def.plural),
                ));
            }
            ("MODIFIED", Some(o))
                if check_rv
                    && obj["metadata"]["resourceVersion"] != o["metadata"]["resourceVersion"] =>
            {
                return Err((
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                        def.plural
                    ),
                ));
            }
            _ => {}
        }
        store.rv += 1;
        let rv = store.rv;
        let uid = match &old {
            Some(o) => o["metadata"]["uid"].clone(),
            None => {
                store.next_uid += 1;
                json!(format!("00000000-0000-0000-0000-{:012}", store.next_uid))
            }
        };
        let meta = obj["metadata"].as_object_mut().unwrap();
        if def.namespaced {
            meta.insert("namespace".into(), json!(ns));
        }
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        meta.insert("uid".into(), uid);
        meta.entry("creationTimestamp")
            .or_insert(json!("2026-01-01T00:00:00Z"));
        store.objects.insert(key, Arc::new(obj.clone()));
        let ev = HistoryEvent {
            rv,
            resource: res,
            ty,
            old,
            obj: obj.clone(),
        };
        store.history.push(ev.clone());
        let _ = self.events.send(ev);
        Ok(obj)
    }
}

struct Collection {
    resource: usize,
    namespace: Option<String>,
    // Set for a single object's path.
    name: Option<String>,
}

/// Whether `r` is served at group/version `gv`: its preferred version, or one it is also
/// served at.
fn serves_at(r: &ResourceDef, gv: &str, also: &HashMap<(String, String), Vec<String>>) -> bool {
    r.group_version() == gv
        || gv.split_once('/').is_some_and(|(g, v)| {
            g == r.group
                && also
                    .get(&(r.group.to_owned(), r.plural.to_owned()))
                    .is_some_and(|vs| vs.iter().any(|x| x == v))
        })
}

fn parse_collection(shared: &Shared, path: &str) -> Option<Collection> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (gv, rest): (String, &[&str]) = match segs.as_slice() {
        ["api", v, rest @ ..] => (v.to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return None,
    };
    let (namespace, plural, name) = match rest {
        ["namespaces", ns, plural, name] => (Some(ns.to_string()), *plural, Some(name.to_string())),
        ["namespaces", ns, plural] => (Some(ns.to_string()), *plural, None),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(name.to_string())),
        _ => return None,
    };
    let also = shared.faults.lock().unwrap().also_served.clone();
    let resource = shared
        .resources
        .read()
        .unwrap()
        .iter()
        .position(|r| serves_at(r, &gv, &also) && r.plural == plural && r.served)?;
    if namespace.is_some() && !shared.def(resource).namespaced {
        return None;
    }
    Some(Collection {
        resource,
        namespace,
        name,
    })
}

/// Whether `obj` matches the label and field selectors, read by the service's own selector
/// reader (kube's `Selector`); field selectors support `metadata.name` and
/// `metadata.namespace` with `=`, `==` and `!=`.
fn selector_matches(obj: &Value, labels: Option<&String>, fields: Option<&String>) -> bool {
    use kube::core::{Expression, SelectorExt};
    let read = |s: Option<&String>| {
        kube_event_bridge::selector::parse(s.map_or("", |s| s.as_str()))
            .expect("the test server reads the selectors kubectl takes")
    };
    let obj_labels: std::collections::BTreeMap<String, String> =
        serde_json::from_value(obj["metadata"]["labels"].clone()).unwrap_or_default();
    let labels_ok = read(labels).matches(&obj_labels);
    let fields_ok = read(fields).into_iter().all(|e| {
        let field = |k: &str| match k {
            "metadata.name" => obj["metadata"]["name"].as_str(),
            "metadata.namespace" => obj["metadata"]["namespace"].as_str(),
            other => panic!("test server does not support field selector {other}"),
        };
        match e {
            Expression::Equal(k, v) => field(&k) == Some(v.as_str()),
            Expression::NotEqual(k, v) => field(&k) != Some(v.as_str()),
            other => {
                panic!("test server supports k=v, k==v and k!=v field selectors only: {other}")
            }
        }
    });
    labels_ok && fields_ok
}

struct Filter {
    resource: usize,
    namespace: Option<String>,
    labels: Option<String>,
    fields: Option<String>,
    /// KEP-5866's `shardRange(object.metadata.<field>, start, end)`: field, [start, end).
    shard: Option<(String, u128, u128)>,
}

/// 64-bit FNV-1a, as KEP-5866 hashes the shard field.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// Parses a `shardRange(object.metadata.uid|namespace, '0x..', '0x..')` selector.
fn parse_shard_selector(selector: &str) -> Result<(String, u128, u128), String> {
    let bad = || format!("invalid shardSelector {selector:?}");
    let inner = selector
        .trim()
        .strip_prefix("shardRange(")
        .and_then(|s| s.strip_suffix(')'))
        .ok_or_else(bad)?;
    let parts: Vec<&str> = inner.split(',').map(str::trim).collect();
    let [field, start, end] = parts[..] else {
        return Err(bad());
    };
    let field = match field {
        "object.metadata.uid" => "uid",
        "object.metadata.namespace" => "namespace",
        _ => {
            return Err(format!(
                "{}: only object.metadata.uid and object.metadata.namespace can be sharded on",
                bad()
            ));
        }
    };
    // As kube-apiserver v1.36.3 parses them: 16 lowercase hex digits (or 2⁶⁴ written
    // `0x10000000000000000`), start below end; anything else is a 400.
    let bound = |b: &str| {
        b.strip_prefix('\'')
            .and_then(|b| b.strip_suffix('\''))
            .and_then(|b| b.strip_prefix("0x"))
            .filter(|h| {
                (h.len() == 16 || *h == "10000000000000000")
                    && h.bytes()
                        .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
            })
            .and_then(|h| u128::from_str_radix(h, 16).ok())
            .ok_or_else(bad)
    };
    let (start, end) = (bound(start)?, bound(end)?);
    if start >= end {
        return Err(format!("{}: start must be below end", bad()));
    }
    Ok((field.to_owned(), start, end))
}

impl Filter {
    fn matches(&self, res: usize, obj: &Value) -> bool {
        res == self.resource
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| obj["metadata"]["namespace"].as_str() == Some(ns))
            && selector_matches(obj, self.labels.as_ref(), self.fields.as_ref())
            && self.shard.as_ref().is_none_or(|(field, start, end)| {
                let value = obj["metadata"][field.as_str()].as_str().unwrap_or("");
                let h = u128::from(fnv1a64(value.as_bytes()));
                *start <= h && h < *end
            })
    }

    /// The event a watcher with this filter sees, if any.
    fn translate(&self, ev: &HistoryEvent) -> Option<(&'static str, Value)> {
        if ev.resource != self.resource {
            return None;
        }
        let now = self.matches(ev.resource, &ev.obj);
        match ev.ty {
            "MODIFIED" => {
                let before = ev
                    .old
                    .as_ref()
                    .is_some_and(|o| self.matches(ev.resource, o));
                match (before, now) {
                    (true, true) => Some(("MODIFIED", ev.obj.clone())),
                    (false, true) => Some(("ADDED", ev.obj.clone())),
                    (true, false) => Some(("DELETED", ev.obj.clone())),
                    (false, false) => None,
                }
            }
            ty => now.then(|| (ty, ev.obj.clone())),
        }
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: axum::http::Method,
    uri: Uri,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response<Body> {
    let path = uri.path();
    match path {
        // The cluster's identity (the kube-system namespace's uid), served without being an
        // object of the store, so that kinds listing namespaces do not see it.
        "/api/v1/namespaces/kube-system" if method == axum::http::Method::GET => {
            let uid = shared.faults.lock().unwrap().cluster_uid.clone();
            return json_response(
                StatusCode::OK,
                &json!({"apiVersion": "v1", "kind": "Namespace",
                        "metadata": {"name": "kube-system", "uid": uid, "resourceVersion": "1"}}),
            );
        }
        "/version" => {
            return json_response(
                StatusCode::OK,
                &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-test"}),
            );
        }
        "/api" => {
            let addr = shared.addr.lock().unwrap().unwrap();
            return json_response(
                StatusCode::OK,
                &json!({"kind": "APIVersions", "versions": ["v1"],
                        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr.to_string()}]}),
            );
        }
        "/apis" => {
            // Counted as lists of "/apis": how often discovery looked.
            shared
                .counts
                .lock()
                .unwrap()
                .entry("/apis".into())
                .or_default()
                .lists += 1;
            let (hidden, also) = {
                let f = shared.faults.lock().unwrap();
                (f.hidden_groups.clone(), f.also_served.clone())
            };
            let mut groups: BTreeMap<&str, (&str, Vec<String>)> = BTreeMap::new();
            for r in shared
                .resources
                .read()
                .unwrap()
                .iter()
                .filter(|r| !r.group.is_empty() && r.served && !hidden.contains(r.group))
            {
                let extra = also
                    .get(&(r.group.to_owned(), r.plural.to_owned()))
                    .cloned()
                    .unwrap_or_default();
                let entry = groups.entry(r.group).or_insert((r.version, Vec::new()));
                entry.1.extend(extra.into_iter().filter(|v| v != r.version));
            }
            let groups: Vec<Value> = groups
                .iter()
                .map(|(g, (v, extra))| {
                    let gv = |v: &str| json!({"groupVersion": format!("{g}/{v}"), "version": v});
                    let mut versions = vec![gv(v)];
                    versions.extend(extra.iter().map(|v| gv(v)));
                    json!({"name": g, "versions": versions, "preferredVersion": gv(v)})
                })
                .collect();
            return json_response(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}),
            );
        }
        _ => {}
    }
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let discovery_gv = match segs.as_slice() {
        ["api", v] => Some(v.to_string()),
        ["apis", g, v] => Some(format!("{g}/{v}")),
        _ => None,
    };
    if let Some(gv) = discovery_gv {
        let group = gv.split_once('/').map_or("", |(g, _)| g);
        let (failing, hidden, also) = {
            let f = shared.faults.lock().unwrap();
            (
                f.failing_discovery.contains(group),
                f.hidden_groups.contains(group),
                f.also_served.clone(),
            )
        };
        if failing {
            return json_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                &status(500, "InternalError", "the aggregated API is unavailable"),
            );
        }
        let resources: Vec<Value> = shared
            .resources
            .read()
            .unwrap()
            .iter()
            .filter(|r| serves_at(r, &gv, &also) && r.served && !hidden)
            .map(|r| {
                json!({"name": r.plural, "singularName": r.kind.to_lowercase(), "namespaced": r.namespaced,
                       "kind": r.kind, "verbs": r.verbs})
            })
            .collect();
        if resources.is_empty() {
            return json_response(
                StatusCode::NOT_FOUND,
                &status(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                ),
            );
        }
        return json_response(
            StatusCode::OK,
            &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
        );
    }
    let Some(collection) = parse_collection(&shared, path) else {
        return json_response(
            StatusCode::NOT_FOUND,
            &status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    if collection.name.is_some() || method != axum::http::Method::GET {
        return write_or_get(&shared, &collection, &method, &body);
    }
    let is_watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let def = shared.def(collection.resource);
    let forbidden_here = {
        let f = shared.faults.lock().unwrap();
        f.forbidden.contains(def.plural)
            || collection
                .namespace
                .as_ref()
                .is_some_and(|ns| f.forbidden.contains(&format!("{}/{ns}", def.plural)))
    };
    if forbidden_here {
        let verb = if is_watch { "watch" } else { "list" };
        let scope = collection
            .namespace
            .as_ref()
            .map_or("at the cluster scope".to_owned(), |ns| {
                format!("in the namespace \"{ns}\"")
            });
        let message = format!(
            "{} is forbidden: User \"system:serviceaccount:test:kube-event-bridge\" cannot {verb} resource \"{}\" in API group \"{}\" {scope}",
            def.plural, def.plural, def.group
        );
        return json_response(StatusCode::FORBIDDEN, &status(403, "Forbidden", &message));
    }
    {
        let mut f = shared.faults.lock().unwrap();
        if let Some(n) = f.throttle_every {
            f.throttle_seen += 1;
            if f.throttle_seen % n == 0 {
                return too_many_requests();
            }
        }
    }
    {
        let mut counts = shared.counts.lock().unwrap();
        let c = counts.entry(path.to_owned()).or_default();
        if is_watch {
            c.watches += 1
        } else {
            c.lists += 1;
            if q.get("continue").is_none_or(|c| c.is_empty()) {
                c.lists_begun += 1;
            }
            let limit = q.get("limit").and_then(|l| l.parse().ok());
            (shared.list_limits.lock().unwrap())
                .entry(path.to_owned())
                .or_default()
                .push(limit);
        }
    }
    // Without the ShardedListAndWatch gate the parameter is ignored (and nothing echoed).
    let shard = match q.get("shardSelector") {
        Some(sel) if shared.faults.lock().unwrap().shard_selectors => {
            match parse_shard_selector(sel) {
                Ok(range) => Some(range),
                Err(msg) => {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        &status(400, "BadRequest", &msg),
                    );
                }
            }
        }
        _ => None,
    };
    let filter = Filter {
        resource: collection.resource,
        namespace: collection.namespace,
        labels: q.get("labelSelector").cloned(),
        fields: q.get("fieldSelector").cloned(),
        shard,
    };
    let response = if is_watch {
        watch(shared.clone(), filter, &q).await
    } else {
        list(shared.clone(), filter, &q).await
    };
    counted(shared, response)
}

/// `response` with its body's bytes counted into [`ApiServer::bytes_sent`].
fn counted(shared: Arc<Shared>, response: Response<Body>) -> Response<Body> {
    use futures::StreamExt;
    let (parts, body) = response.into_parts();
    let stream = body.into_data_stream().inspect(move |chunk| {
        if let Ok(bytes) = chunk {
            shared
                .bytes_sent
                .fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// GET of one object, POST (create) on a collection, PUT (replace) of one object, DELETE of
/// one object (with a resourceVersion precondition, if the body's DeleteOptions has one).
fn write_or_get(
    shared: &Shared,
    c: &Collection,
    method: &axum::http::Method,
    body: &[u8],
) -> Response<Body> {
    let def = &shared.def(c.resource);
    let failure = |(code, reason, msg): (u16, &str, String)| {
        json_response(
            StatusCode::from_u16(code).unwrap(),
            &status(code, reason, &msg),
        )
    };
    let ns = c.namespace.clone().unwrap_or_default();
    match (method.as_str(), &c.name) {
        ("GET", Some(name)) => {
            let store = shared.store.lock().unwrap();
            match store.objects.get(&(c.resource, ns, name.clone())) {
                Some(obj) => json_response(StatusCode::OK, obj),
                None => failure((
                    404,
                    "NotFound",
                    format!("{} \"{name}\" not found", def.plural),
                )),
            }
        }
        ("POST", None) | ("PUT", Some(_)) => {
            let Ok(mut obj) = serde_json::from_slice::<Value>(body) else {
                return failure((400, "BadRequest", "the body is not JSON".into()));
            };
            if def.namespaced {
                obj["metadata"]["namespace"] = json!(ns);
            }
            if let Some(name) = &c.name
                && obj["metadata"]["name"].as_str() != Some(name)
            {
                return failure((
                    400,
                    "BadRequest",
                    "the name in the body does not match the URL".into(),
                ));
            }
            let holder = obj["spec"]["holderIdentity"].as_str().map(str::to_owned);
            if def.kind == "Lease"
                && holder.is_some()
                && shared.faults.lock().unwrap().refuse_lease_holder == holder
            {
                return failure((
                    503,
                    "ServiceUnavailable",
                    "lease writes from this holder are refused by the test".into(),
                ));
            }
            let ty = if c.name.is_some() {
                "MODIFIED"
            } else {
                "ADDED"
            };
            match shared.apply(ty, obj, true) {
                Ok(obj) => json_response(
                    if ty == "ADDED" {
                        StatusCode::CREATED
                    } else {
                        StatusCode::OK
                    },
                    &obj,
                ),
                Err(e) => failure(e),
            }
        }
        ("DELETE", Some(name)) => {
            let options: Value = serde_json::from_slice(body).unwrap_or_default();
            let precondition = options["preconditions"]["resourceVersion"].as_str();
            match shared.remove(c.resource, &ns, name, precondition) {
                Ok(obj) => json_response(StatusCode::OK, &obj),
                Err(e) => failure(e),
            }
        }
        _ => failure((
            405,
            "MethodNotAllowed",
            format!("{method} is not supported here"),
        )),
    }
}

/// An object as a list's item: a built-in kind's without its `kind` and `apiVersion` (as
/// kube-apiserver writes them). Written from the stored object, not a copy of it: a list
/// of tens of thousands would otherwise clone and drop every object's tree.
struct ListItem<'a> {
    obj: &'a Value,
    custom: bool,
}

impl serde::Serialize for ListItem<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let Some(fields) = self.obj.as_object().filter(|_| !self.custom) else {
            return self.obj.serialize(serializer);
        };
        let kept = fields
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "kind" | "apiVersion"));
        let mut map = serializer.serialize_map(None)?;
        for (k, v) in kept {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// A list's response, its items written as [`ListItem`]s.
#[derive(serde::Serialize)]
struct ListBody<'a> {
    kind: String,
    #[serde(rename = "apiVersion")]
    api_version: String,
    metadata: Value,
    items: Vec<ListItem<'a>>,
}

async fn list(shared: Arc<Shared>, filter: Filter, q: &HashMap<String, String>) -> Response<Body> {
    use std::sync::atomic::Ordering::SeqCst;
    struct InFlight<'a>(&'a Shared);
    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            self.0.lists_in_flight.fetch_sub(1, SeqCst);
        }
    }
    let now = shared.lists_in_flight.fetch_add(1, SeqCst) + 1;
    shared.most_lists_in_flight.fetch_max(now, SeqCst);
    let _in_flight = InFlight(&shared);
    let delay = shared.faults.lock().unwrap().list_delay;
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    {
        let mut faults = shared.faults.lock().unwrap();
        if faults.fail_next_lists > 0 {
            faults.fail_next_lists -= 1;
            return too_many_requests();
        }
    }
    let def = shared.def(filter.resource);
    let rv_param = q.get("resourceVersion").map(String::as_str).unwrap_or("");
    let version_match = q.get("resourceVersionMatch").map(String::as_str);
    let limit: Option<usize> = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0);
    let cont = q.get("continue").filter(|c| !c.is_empty());
    let invalid = |msg: &str| {
        json_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            &status(422, "Invalid", msg),
        )
    };
    if version_match.is_some() && rv_param.is_empty() {
        return invalid("resourceVersionMatch is forbidden unless resourceVersion is provided");
    }
    if version_match.is_some() && cont.is_some() {
        return invalid("resourceVersionMatch is forbidden for continue");
    }
    if version_match == Some("Exact") && rv_param == "0" {
        return invalid("resourceVersionMatch \"Exact\" is forbidden for resourceVersion \"0\"");
    }
    let (snapshot_rv, items, offset) = if let Some(token) = cont {
        if !(rv_param.is_empty() || rv_param == "0") {
            return json_response(
                StatusCode::BAD_REQUEST,
                &status(
                    400,
                    "BadRequest",
                    "specifying resource version is not allowed when using continue",
                ),
            );
        }
        let (id, offset) = token
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<usize>().ok()?)))
            .unwrap_or((u64::MAX, 0));
        let store = shared.store.lock().unwrap();
        match store.snapshots.get(&id) {
            Some((rv, items)) => (*rv, Arc::clone(items), offset),
            None => {
                return json_response(
                    StatusCode::GONE,
                    &status(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    ),
                );
            }
        }
    } else {
        let store = shared.store.lock().unwrap();
        if let Ok(n) = rv_param.parse::<u64>()
            && n != 0
        {
            if n > store.rv {
                let mut body = status(504, "Timeout", "Too large resource version");
                body["details"] = json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1});
                return json_response(StatusCode::GATEWAY_TIMEOUT, &body);
            }
            let exact =
                version_match == Some("Exact") || (limit.is_some() && version_match.is_none());
            // Only the current state is kept, so an exact read of an older RV is "too old".
            if exact && n != store.rv {
                return json_response(
                    StatusCode::GONE,
                    &status(
                        410,
                        "Expired",
                        "The resourceVersion for the provided list is too old.",
                    ),
                );
            }
        }
        let stale = (rv_param == "0")
            .then(|| shared.faults.lock().unwrap().stale_cache.clone())
            .flatten();
        let (rv, objects) = match &stale {
            Some(b) => (b.rv, &b.objects),
            None => (store.rv, &store.objects),
        };
        let items: Vec<Arc<Value>> = objects
            .iter()
            .filter(|((res, _, _), obj)| filter.matches(*res, obj))
            .map(|(_, obj)| Arc::clone(obj))
            .collect();
        (rv, Arc::new(items), 0)
    };
    let end = limit.map_or(items.len(), |l| (offset + l).min(items.len()));
    let page: Vec<ListItem> = items[offset.min(items.len())..end]
        .iter()
        .map(|obj| ListItem {
            obj,
            custom: def.custom,
        })
        .collect();
    let mut metadata = json!({"resourceVersion": snapshot_rv.to_string()});
    // As kube-apiserver v1.36.3: the selector is applied to every kind, but only built-in
    // kinds' lists echo it (a custom resource's list, an UnstructuredList, has no
    // `shardInfo` to set).
    if filter.shard.is_some() && !def.custom {
        metadata["shardInfo"] = json!({"selector": q.get("shardSelector")});
    }
    if end < items.len() {
        let mut store = shared.store.lock().unwrap();
        let id = match cont
            .and_then(|t| t.split_once(':'))
            .and_then(|(a, _)| a.parse::<u64>().ok())
        {
            Some(id) => id,
            None => {
                store.next_snapshot += 1;
                let id = store.next_snapshot;
                store
                    .snapshots
                    .insert(id, (snapshot_rv, Arc::clone(&items)));
                id
            }
        };
        metadata["continue"] = json!(format!("{id}:{end}"));
        if filter.labels.is_none() && filter.fields.is_none() {
            metadata["remainingItemCount"] = json!(items.len() - end);
        }
    }
    let body = ListBody {
        kind: format!("{}List", def.kind),
        api_version: def.group_version(),
        metadata,
        items: page,
    };
    json_response(StatusCode::OK, &body)
}

fn line(ty: &str, obj: &Value) -> Bytes {
    let mut s = json!({"type": ty, "object": obj}).to_string();
    s.push('\n');
    Bytes::from(s)
}

fn bookmark(def: &ResourceDef, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        &json!({"kind": def.kind, "apiVersion": def.group_version(), "metadata": meta}),
    )
}

async fn watch(shared: Arc<Shared>, filter: Filter, q: &HashMap<String, String>) -> Response<Body> {
    if shared.faults.lock().unwrap().block_watches {
        return too_many_requests();
    }
    let def = shared.def(filter.resource);
    let bookmark_every = shared.faults.lock().unwrap().bookmark_interval;
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let send_initial = q.get("sendInitialEvents").is_some_and(|v| v == "true");
    if send_initial && q.get("resourceVersionMatch").map(String::as_str) != Some("NotOlderThan") {
        return json_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            &status(
                422,
                "Invalid",
                "sendInitialEvents is forbidden unless resourceVersionMatch=NotOlderThan",
            ),
        );
    }
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    let rv_param = q.get("resourceVersion").cloned().unwrap_or_default();
    let mut kill = shared.kill.subscribe();
    kill.borrow_and_update();
    let mut stall = shared.stall.subscribe();
    stall.borrow_and_update();
    let mut inject = shared.inject.subscribe();
    inject.borrow_and_update();
    // Subscribe and read the state under one lock, so no event falls between the two.
    let (mut live, mut first, mut last_rv) = {
        let store = shared.store.lock().unwrap();
        let live = shared.events.subscribe();
        let mut first: Vec<Bytes> = Vec::new();
        let from = rv_param
            .parse::<u64>()
            .ok()
            .filter(|n| *n != 0 && !send_initial);
        let stale = (rv_param == "0")
            .then(|| shared.faults.lock().unwrap().stale_cache.clone())
            .flatten();
        match from {
            None if stale.is_some() => {
                let b = stale.expect("matched");
                for ((res, _, _), obj) in &b.objects {
                    if filter.matches(*res, obj) {
                        first.push(line("ADDED", obj));
                    }
                }
                if send_initial {
                    first.push(bookmark(&def, b.rv, true));
                }
                // The lagging cache catches up afterwards.
                for ev in store.history.iter().filter(|e| e.rv > b.rv) {
                    if let Some((ty, obj)) = filter.translate(ev) {
                        first.push(line(ty, &obj));
                    }
                }
            }
            None => {
                for ((res, _, _), obj) in &store.objects {
                    if filter.matches(*res, obj) {
                        first.push(line("ADDED", obj));
                    }
                }
                if send_initial {
                    first.push(bookmark(&def, store.rv, true));
                }
            }
            Some(n) if n > store.rv => {
                // The real server waits up to 3 s for its cache to reach `n`, then gives up.
                let mut body = status(504, "Timeout", "Too large resource version");
                body["details"] = json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1});
                return json_response(StatusCode::GATEWAY_TIMEOUT, &body);
            }
            Some(n) if n < store.compacted => {
                let msg = format!("too old resource version: {n} ({})", store.compacted);
                let body = line("ERROR", &status(410, "Expired", &msg));
                return Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap();
            }
            Some(n) => {
                for ev in store.history.iter().filter(|e| e.rv > n) {
                    if let Some((ty, obj)) = filter.translate(ev) {
                        first.push(line(ty, &obj));
                    }
                }
            }
        }
        (live, first, store.rv)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    let stream = async_stream_lines(move |tx| async move {
        for b in first.drain(..) {
            if tx.send(Ok(b)).await.is_err() {
                return;
            }
        }
        let mut tick = tokio::time::interval(bookmark_every.unwrap_or(Duration::from_secs(3600)));
        tick.tick().await;
        loop {
            tokio::select! {
                // A stall applies to everything after it, even what is already waiting.
                biased;
                _ = stall.changed() => {
                    // Silent from here on, until the client gives up on the connection.
                    tokio::select! {
                        _ = tokio::time::sleep_until(deadline) => {}
                        _ = tx.closed() => {}
                    }
                    return;
                }
                _ = tick.tick(), if bookmarks && bookmark_every.is_some() => {
                    if tx.send(Ok(bookmark(&def, last_rv, false))).await.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    if bookmarks {
                        let _ = tx.send(Ok(bookmark(&def, last_rv, false))).await;
                    }
                    return; // clean end, like a server-side timeout
                }
                _ = inject.changed() => {
                    let lines = inject.borrow_and_update().clone();
                    for l in lines {
                        if tx.send(Ok(l)).await.is_err() {
                            return;
                        }
                    }
                }
                _ = kill.changed() => {
                    let _ = tx.send(Err(std::io::Error::other("connection dropped by test"))).await;
                    return;
                }
                ev = live.recv() => match ev {
                    Ok(ev) => {
                        if ev.rv <= last_rv { continue; }
                        last_rv = ev.rv;
                        if let Some((ty, obj)) = filter.translate(&ev)
                            && tx.send(Ok(line(ty, &obj))).await.is_err() {
                            return;
                        }
                    }
                    Err(_) => {
                        let _ = tx.send(Err(std::io::Error::other("watch fell behind"))).await;
                        return;
                    }
                }
            }
        }
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// A body stream fed by a task through a small channel.
fn async_stream_lines<F, Fut>(f: F) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    tokio_stream_from(rx)
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).fuse()
}
