//! What operators install, run against a real kube-apiserver (tests/support/cluster.rs):
//! RBAC objects of deploy/ and of the Helm chart applied as the API server receives them, a
//! ServiceAccount's token for the bridge, and how a consumer's stream (a real nats-server's
//! JetStream) ends compared with the API server.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use k8s_openapi::api::{
    apps::v1::Deployment,
    authentication::v1::{TokenRequest, TokenRequestSpec},
    authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
    core::v1::{ConfigMap, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
};
use kube::api::{Api, ApiResource, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::{
    Differences,
    cluster::Cluster,
    config::NATS_STREAM,
    nats::read_stream,
    objects::{configmap, deployment, named},
    replica::{Replica, dump},
    wait::{self, Patience},
};

/// Every message of the stream, decoded.
pub async fn read(url: &str) -> Vec<Value> {
    read_stream(url, NATS_STREAM)
        .await
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect()
}

/// How the stream's events of `kind` differ from the API server's objects of `resource`.
pub async fn compare(
    cluster: &Cluster,
    events: &[Value],
    kind: &str,
    resource: &ApiResource,
) -> Differences {
    let of_kind = events.iter().filter(|e| e["k8skind"] == kind);
    super::compare(of_kind, &cluster.objects(resource, None).await)
}

/// A metric's samples in a Prometheus text exposition: labels → value.
pub fn samples(text: &str, metric: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(metric))
        .filter(|rest| rest.starts_with('{') || rest.starts_with(' '))
        .filter_map(|rest| {
            let (labels, value) = rest.rsplit_once(' ')?;
            Some((labels.trim().to_owned(), value.parse().ok()?))
        })
        .collect()
}

pub async fn replica_metrics(replica: &Replica) -> String {
    match replica.admin() {
        Some(addr) => super::http_get(addr, "/metrics").await.1,
        None => String::new(),
    }
}

/// The namespace deploy/ installs into (its kustomization's `namespace`).
pub const DEPLOY_NAMESPACE: &str = "kube-event-bridge";

/// The YAML documents of a file, as JSON.
pub fn yaml_docs(path: &Path) -> Vec<Value> {
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
pub fn merge(base: &Value, patch: &Value) -> Value {
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
pub fn rbac_of(dir: &Path) -> Vec<Value> {
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
pub async fn apply_rbac(client: &kube::Client, objects: &[Value]) {
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
pub async fn allowed(client: &kube::Client, verb: &str, group: &str, resource: &str) -> bool {
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

/// Waits until the stream's fold ends with the API server's objects of `kind`.
pub async fn caught_up(
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
    eprintln!("{kind}: {}", found.counts());
    if !ok {
        dump(std::slice::from_ref(replica));
    }
    assert!(ok, "{kind}: {found}");
}

/// What the replica's `/readyz` answers: status and body (0 before it serves).
pub async fn ready(replica: &Replica) -> (u16, String) {
    match replica.admin() {
        Some(a) => super::http_get(a, "/readyz").await,
        None => (0, String::new()),
    }
}

/// Waits until the replica's `/readyz` answers 200 and `also` holds; fails at once if the
/// replica could not start.
pub async fn wait_ready(replica: &Replica, mut also: impl AsyncFnMut() -> bool) {
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
pub async fn forbidden_gauges(replica: &Replica) -> BTreeMap<String, f64> {
    samples(&replica_metrics(replica).await, "keb_informer_forbidden")
}

/// Changes made while a replica runs: ConfigMaps and Deployments in `shop` updated, one of
/// each deleted, one of each created (names with `round`).
pub async fn change(client: &kube::Client, round: &str) {
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

/// Writes a kubeconfig with a token of the ServiceAccount `account` in `namespace` from the
/// TokenRequest API (this cluster runs no token controller); returns its path.
pub async fn service_account_kubeconfig(
    cluster: &Cluster,
    namespace: &str,
    account: &str,
) -> PathBuf {
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.client().await, namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let token = accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token;
    cluster.kubeconfig_for(account, &token)
}

/// Creates the ServiceAccount `kube-event-bridge` in [`DEPLOY_NAMESPACE`] (as deploy/ does)
/// and returns a kubeconfig with its token.
pub async fn deploy_service_account_kubeconfig(cluster: &Cluster) -> PathBuf {
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.client().await, DEPLOY_NAMESPACE);
    accounts
        .create(&PostParams::default(), &named(None, "kube-event-bridge"))
        .await
        .unwrap();
    service_account_kubeconfig(cluster, DEPLOY_NAMESPACE, "kube-event-bridge").await
}

/// Log lines of `replica` that speak of a refusal (403, forbidden).
pub fn refusals(replica: &Replica) -> Vec<String> {
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

/// The Helm binary `scripts/test` builds from `tests/helm`.
pub fn helm() -> PathBuf {
    super::built_tool("helm/helm", "scripts/build-helm (scripts/test does)")
}

/// Runs `helm ARGS` against `cluster` (its admin kubeconfig); returns its output, or panics
/// with it when Helm fails.
pub fn run_helm(cluster: &Cluster, args: &[&str]) -> String {
    let home = cluster.dir().join("helm");
    let out = std::process::Command::new(helm())
        .args(args)
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        // Helm keeps its cache and config under these; the test's own, not the user's.
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "helm {args:?} failed:\n{text}");
    text
}
