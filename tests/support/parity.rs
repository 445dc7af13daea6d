//! Comparing the bridge's stream with client-go's (tests/support/cluster.rs's
//! [`ReferenceInformer`]): both reduced to the same notifications, folded per key, and set
//! against each other and the API server; plus the seeded workload and the bridge replica
//! the parity scenarios and the real-cluster bench share.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::Path,
    time::Duration,
};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use super::{
    Differences,
    cluster::{Cluster, ReferenceInformer},
    config::ConfigBuilder,
    event_type, json_lines,
    objects::{configmap, configmaps},
    replica::Replica,
    wait::{self, Patience},
};

/// A small deterministic generator (xorshift64*), so that a workload can be replayed from
/// its printed seed.
pub struct Rng(pub u64);

impl Rng {
    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// The seed of a workload: `KEB_SEED`, else the time.
pub fn seed() -> u64 {
    std::env::var("KEB_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        })
}

/// One random change to ConfigMap `cm-NNN` (`NNN` below `names`) of `ns`: a create where it
/// is absent, else an update (three in four) or a delete.
pub async fn change(api: &Api<ConfigMap>, ns: &str, rng: &mut Rng, names: u64) {
    let name = format!("cm-{:03}", rng.below(names));
    let value = rng.below(1_000_000_000).to_string();
    let existing = api.get_opt(&name).await.unwrap();
    let result = match existing {
        None => api
            .create(&PostParams::default(), &configmap(ns, &name, &value))
            .await
            .map(drop),
        Some(_) if rng.below(4) == 0 => api.delete(&name, &DeleteParams::default()).await.map(drop),
        Some(_) => api
            .replace(&name, &PostParams::default(), &configmap(ns, &name, &value))
            .await
            .map(drop),
    };
    result.unwrap_or_else(|e| panic!("change of {name}: {e}"));
}

/// `ops` random changes ([`change`]), one after the other.
pub async fn workload(api: &Api<ConfigMap>, ns: &str, rng: &mut Rng, names: u64, ops: usize) {
    for _ in 0..ops {
        change(api, ns, rng, names).await;
    }
}

/// A replica of the bridge watching ConfigMaps in `ns`, printing to `dir/bridge.jsonl`
/// with no checkpoint (client-go keeps none) and `max_pending` (large enough that nothing
/// coalesces, for a notification-by-notification comparison).
pub fn bridge(
    dir: &Path,
    ns: &str,
    kubeconfig: &Path,
    streaming_list: bool,
    max_pending: usize,
) -> Replica {
    let config = ConfigBuilder::new()
        .kubernetes(json!({"streaming_list": streaming_list}))
        .resource(json!({"api_version": "v1", "kind": "ConfigMap", "namespaces": [ns]}))
        .sink(json!({
            "name": "out", "type": "stdout", "stdout": {"path": dir.join("bridge.jsonl")},
            "max_pending": max_pending, "resume": false,
        }))
        .route("configmap", &["out"])
        .value();
    Replica::start(dir, "bridge", &config, kubeconfig)
}

/// Waits until the replica's `/readyz` answers 200.
pub async fn ready(replica: &Replica) {
    wait::until(
        "the bridge is ready",
        Patience::of(Duration::from_secs(120)),
        async || match replica.admin() {
            Some(addr) => super::http_get(addr, "/readyz").await.0 == 200,
            None => false,
        },
    )
    .await;
}

/// One notification, as both streams are reduced for comparison: key, type (`added`,
/// `updated`, `deleted`, `synced`), resourceVersion, final state unknown.
pub type Seen = (String, &'static str, String, bool);

fn known_type(ty: &str) -> &'static str {
    ["added", "updated", "deleted", "synced"]
        .into_iter()
        .find(|t| *t == ty)
        .unwrap_or_else(|| panic!("unknown type {ty}"))
}

/// The bridge's CloudEvents, reduced.
pub fn bridge_seen(events: &[Value]) -> Vec<Seen> {
    events
        .iter()
        .map(|e| {
            (
                e["subject"].as_str().unwrap().to_owned(),
                known_type(event_type(e)),
                e["data"]["object"]["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
                e["k8sfinalstateunknown"] == true,
            )
        })
        .collect()
}

/// client-go's lines (`realk8s informer`), reduced; `synced` markers left out.
pub fn client_go_seen(lines: &[Value]) -> Vec<Seen> {
    lines
        .iter()
        .filter(|l| l["type"] != "synced")
        .map(|l| {
            let ty = match l["type"].as_str().unwrap() {
                "add" => "added",
                "update" => "updated",
                "delete" => "deleted",
                "sync" => "synced",
                other => panic!("unknown type {other}"),
            };
            (
                l["key"].as_str().unwrap().to_owned(),
                ty,
                l["resource_version"].as_str().unwrap().to_owned(),
                l["final_state_unknown"] == true,
            )
        })
        .collect()
}

/// Folds a reduced stream per key: the last resourceVersion, `None` after a delete.
pub fn fold_seen(seen: &[Seen]) -> BTreeMap<String, Option<String>> {
    seen.iter()
        .map(|(k, ty, rv, _)| (k.clone(), (*ty != "deleted").then(|| rv.clone())))
        .collect()
}

fn per_key(seen: &[Seen]) -> BTreeMap<&str, Vec<(&'static str, &str, bool)>> {
    let mut out: BTreeMap<&str, Vec<_>> = BTreeMap::new();
    for (k, ty, rv, fsu) in seen {
        out.entry(k.as_str())
            .or_default()
            .push((*ty, rv.as_str(), *fsu));
    }
    out
}

/// The keys of deletes marked final state unknown.
pub fn fsu(seen: &[Seen]) -> BTreeSet<String> {
    seen.iter()
        .filter(|(_, ty, _, fsu)| *ty == "deleted" && *fsu)
        .map(|(k, ..)| k.clone())
        .collect()
}

/// Waits until both streams end with the API server's ConfigMaps in `ns` (client-go's in
/// `reference`, the bridge's in `dir/bridge.jsonl`); returns them.
pub async fn settle(
    cluster: &Cluster,
    ns: &str,
    reference: &ReferenceInformer,
    dir: &Path,
    patience: Duration,
) -> BTreeMap<String, (String, String)> {
    let want = cluster.objects(&configmaps(), Some(ns)).await;
    let want_rv: BTreeMap<String, Option<String>> = want
        .iter()
        .map(|(k, (_, rv))| (k.clone(), Some(rv.clone())))
        .collect();
    let settled = |seen: &[Seen]| {
        let folded = fold_seen(seen);
        folded.values().filter(|v| v.is_some()).count() == want.len()
            && want_rv.iter().all(|(k, v)| folded.get(k) == Some(v))
    };
    wait::until(
        "both streams end with the API server's objects",
        Patience::of(patience).polling(Duration::from_millis(500)),
        async || {
            settled(&client_go_seen(&reference.lines()))
                && settled(&bridge_seen(&json_lines(&dir.join("bridge.jsonl"))))
        },
    )
    .await;
    want
}

/// The bridge's stream set against client-go's and the API server's objects.
pub struct Comparison {
    /// client-go's notifications, without its relist re-deliveries.
    pub client_go: usize,
    /// The bridge's notifications.
    pub bridge: usize,
    /// client-go's updates with an unchanged resourceVersion, left out of the comparison:
    /// with resync off its listeners still count as resyncing (the flag starts on and only
    /// a resync recomputes it), so each relist re-delivers every unchanged object; the
    /// bridge's start with resync off and deliver nothing for them (docs/src/concepts.md,
    /// "on purpose").
    pub relist_syncs: usize,
    /// Of the versions (key, type, resourceVersion) client-go saw, the share the bridge saw.
    pub ratio: f64,
    /// Keys whose notifications differ (type, version, final state unknown, order).
    pub keys_differing: usize,
    /// Both end with the same state per key.
    pub same_finals: bool,
    /// Keys deleted with final state unknown, by each.
    pub fsu_client_go: BTreeSet<String>,
    pub fsu_bridge: BTreeSet<String>,
    /// The bridge's stream folded in order, against the API server.
    pub differences: Differences,
    /// Message ids the bridge published more than once.
    pub duplicates: usize,
    ours: Vec<Seen>,
    theirs: Vec<Seen>,
}

impl Comparison {
    /// Compares the bridge's `events` with client-go's `lines` and the server's `live`
    /// objects.
    pub fn of(
        events: &[Value],
        lines: &[Value],
        live: &BTreeMap<String, (String, String)>,
    ) -> Self {
        let ours = bridge_seen(events);
        let all_theirs = client_go_seen(lines);
        let relist_syncs = all_theirs.iter().filter(|s| s.1 == "synced").count();
        let theirs: Vec<Seen> = all_theirs.into_iter().filter(|s| s.1 != "synced").collect();
        let versions = |s: &[Seen]| {
            s.iter()
                .map(|(k, ty, rv, _)| (k.clone(), *ty, rv.clone()))
                .collect::<BTreeSet<_>>()
        };
        let (v_ours, v_theirs) = (versions(&ours), versions(&theirs));
        let ratio = v_ours.intersection(&v_theirs).count() as f64 / v_theirs.len().max(1) as f64;
        let (ours_by_key, theirs_by_key) = (per_key(&ours), per_key(&theirs));
        let keys_differing = theirs_by_key
            .keys()
            .chain(ours_by_key.keys())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter(|k| ours_by_key.get(**k) != theirs_by_key.get(**k))
            .count();
        let ids: Vec<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
        Self {
            client_go: theirs.len(),
            bridge: ours.len(),
            relist_syncs,
            ratio,
            keys_differing,
            same_finals: fold_seen(&ours) == fold_seen(&theirs),
            fsu_client_go: fsu(&theirs),
            fsu_bridge: fsu(&ours),
            differences: super::compare(events, live),
            duplicates: ids.len() - ids.iter().collect::<BTreeSet<_>>().len(),
            ours,
            theirs,
        }
    }

    /// Prints the notifications of up to `n` keys on which the two differ.
    pub fn print_differing_keys(&self, n: usize) {
        let (ours, theirs) = (per_key(&self.ours), per_key(&self.theirs));
        let keys: BTreeSet<&&str> = ours.keys().chain(theirs.keys()).collect();
        for k in keys
            .into_iter()
            .filter(|k| ours.get(**k) != theirs.get(**k))
            .take(n)
        {
            eprintln!(
                "  {k}: client-go {:?}\n  {k}: bridge    {:?}",
                theirs.get(*k),
                ours.get(*k)
            );
        }
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.differences;
        write!(
            f,
            "client-go {} notifications, bridge {}, versions seen bridge/client-go {:.4}, \
             keys whose notifications differ {} (client-go's relist re-deliveries left out: {}), \
             identical finals {}, final-state-unknown deletes client-go {} bridge {}, \
             lost deletes {}, phantom deletes {}, stale {}, missing {}, duplicates {}",
            self.client_go,
            self.bridge,
            self.ratio,
            self.keys_differing,
            self.relist_syncs,
            self.same_finals,
            self.fsu_client_go.len(),
            self.fsu_bridge.len(),
            d.lost_deletes.len(),
            d.phantom_deletes.len(),
            d.stale.len(),
            d.missing.len(),
            self.duplicates,
        )
    }
}
