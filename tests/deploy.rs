//! What operators install, on a real kube-apiserver v1.36 and etcd 3.6 (tests/support/
//! cluster.rs): the RBAC of `deploy/` (kustomize) and the Helm chart
//! (`deploy/helm/kube-event-bridge`, installed with a Helm v3.22 built from the Go module
//! proxy). The bridge runs with the token of the ServiceAccount they bind, and what it
//! publishes to a real nats-server's JetStream is folded per key and compared with the API
//! server.
//!
//! - The overlays' RBAC is enough (nats, sharded), and with `watch` taken away on one kind
//!   the bridge reports it and carries on with the other.
//! - `helm install` of the chart's NATS example: the same, with the objects and the config
//!   the chart installed; a missing verb is reported and `helm upgrade` restores it.
//! - The chart's table of built-in plurals (how it turns `config.resources` into RBAC rules)
//!   is what the API server's discovery says.

mod support;

use std::{collections::BTreeMap, path::Path, time::Duration};

use k8s_openapi::api::{
    apps::v1::Deployment,
    coordination::v1::Lease,
    core::v1::ConfigMap,
    rbac::v1::{ClusterRole, Role},
};
use kube::{
    api::{Api, PostParams},
    discovery::{Discovery, verbs},
};
use serde_json::{Value, json};
use support::{
    Differences,
    cluster::Cluster,
    config::nats_sink,
    deployed::{
        DEPLOY_NAMESPACE, allowed, apply_rbac, caught_up, change, compare,
        deploy_service_account_kubeconfig, forbidden_gauges, rbac_of, read, ready, refusals,
        run_helm, service_account_kubeconfig, wait_ready, yaml_docs,
    },
    nats::NatsServer,
    objects::{configmap, configmaps, deployment, deployments},
    replica::{Replica, dump},
    wait::{self, Patience},
};

/// The overlay whose RBAC and config the test runs with: two watched kinds and a sink with a
/// checkpoint.
const OVERLAY: &str = "deploy/overlays/nats";

/// A shipped config made to run here: this test's NATS server, a loopback admin address, a
/// replica identity (a pod gets it and the Lease namespace from `POD_NAME` and
/// `POD_NAMESPACE`) and fast Leases.
fn for_this_test(mut config: Value, url: &str, identity: &str) -> Value {
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

/// An overlay's config, made to run here.
fn overlay_config(overlay: &str, url: &str, identity: &str) -> Value {
    let config = yaml_docs(&Path::new(overlay).join("config.yaml")).remove(0);
    for_this_test(config, url, identity)
}

/// What both install paths must give, once their RBAC is installed and `kubeconfig` holds a
/// token of their ServiceAccount: the bridge running `config(url, identity)` (Deployments and
/// ConfigMaps to NATS, leader election, checkpoints) lists and watches both kinds, identifies
/// the cluster, holds the Lease, publishes every change, and nothing is refused. Then with
/// `watch` on Deployments taken off the installed ClusterRole: a new replica reports
/// Deployments forbidden (`/readyz`, `keb_informer_forbidden`) while ConfigMaps keep
/// running; after `restore`, Deployments catch up without a restart.
async fn rbac_is_enough_and_a_missing_verb_is_reported(
    cluster: &Cluster,
    kubeconfig: &Path,
    config: impl AsyncFn(&str, &str) -> Value,
    restore: impl AsyncFnOnce(),
) {
    let admin = cluster.client().await;
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
        &config(&url, "replica-1").await,
        kubeconfig,
    );
    wait_ready(&first, async || true).await;
    change(&admin, "a").await;
    caught_up(cluster, &url, "ConfigMap", &configmaps(), &first).await;
    caught_up(cluster, &url, "Deployment", &deployments(), &first).await;
    let (code, body) = ready(&first).await;
    let refused = refusals(&first);
    let holder = Api::<Lease>::namespaced(admin.clone(), DEPLOY_NAMESPACE)
        .get("kube-event-bridge")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity);
    let gauges = forbidden_gauges(&first).await;
    eprintln!(
        "/readyz {code} {body:?}, Lease held by {holder:?}, {} log lines about refusals, \
         forbidden gauges {gauges:?}",
        refused.len(),
    );
    assert!(refused.is_empty(), "{refused:#?}");
    assert_eq!((code, body.trim()), (200, "ok"));
    assert_eq!(holder.as_deref(), Some("replica-1"));
    assert!(gauges.values().all(|v| *v == 0.0), "{gauges:?}");
    first.terminate();

    // One verb fewer on the installed ClusterRole: no watch on Deployments.
    let role = Api::<ClusterRole>::all(admin.clone())
        .get("kube-event-bridge")
        .await
        .unwrap();
    let mut fewer = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "kube-event-bridge"},
        "rules": role.rules,
    });
    let rule = fewer["rules"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|r| r["resources"] == json!(["deployments"]))
        .expect("a rule for Deployments");
    rule["verbs"] = json!(["list"]);
    apply_rbac(&admin, &[fewer]).await;
    wait::until("watch on Deployments refused", wait::PATIENCE, async || {
        !allowed(&admin, "watch", "apps", "deployments").await
    })
    .await;
    let second = Replica::start(
        dir.path(),
        "replica-2",
        &config(&url, "replica-2").await,
        kubeconfig,
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
    assert!(
        second
            .log()
            .lines()
            .any(|l| l.contains("forbidden to watch /apis/apps/v1/deployments")),
        "the log names it"
    );
    change(&admin, "b").await;
    caught_up(cluster, &url, "ConfigMap", &configmaps(), &second).await;
    // The refused kind received none of those changes (it lists, but cannot watch).
    let behind = compare(cluster, &read(&url).await, "Deployment", &deployments()).await;
    eprintln!("Deployment while refused: {}", behind.counts());
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
    restore().await;
    wait::until(
        "watch on Deployments granted again",
        wait::PATIENCE,
        async || allowed(&admin, "watch", "apps", "deployments").await,
    )
    .await;
    caught_up(cluster, &url, "Deployment", &deployments(), &second).await;
    if !wait::within(wait::PATIENCE, async || !deployments_forbidden().await).await {
        dump(std::slice::from_ref(&second));
        panic!("the forbidden gauge of Deployments stayed set");
    }
    let (code, body) = ready(&second).await;
    assert_eq!((code, body.trim()), (200, "ok"));
}

/// RBAC on a real API server: the ServiceAccount bound to exactly the roles
/// `deploy/overlays/nats` installs, running that overlay's config, passes
/// [`rbac_is_enough_and_a_missing_verb_is_reported`] (restored by applying the overlay's RBAC
/// again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deploy_rbac_is_enough_and_a_missing_verb_is_reported() {
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
    let kubeconfig = deploy_service_account_kubeconfig(&cluster).await;
    rbac_is_enough_and_a_missing_verb_is_reported(
        &cluster,
        &kubeconfig,
        async |url, identity| overlay_config(OVERLAY, url, identity),
        async || apply_rbac(&admin, &rbac).await,
    )
    .await;
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
    let kubeconfig = deploy_service_account_kubeconfig(&cluster).await;
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
// ---------------------------------------------------------------------------------------
// The Helm chart

/// The chart's directory.
const CHART: &str = "deploy/helm/kube-event-bridge";

/// The chart maps each kind of `config.resources` to its plural for the ClusterRole with
/// `files/builtin-plurals.yaml`: it must hold exactly the kinds a real v1.36 API server serves
/// with list and watch (every group, every version), under the plural its discovery gives.
/// On a difference this prints the file as it should be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_plurals_are_the_api_servers() {
    let cluster = Cluster::start().await;
    let discovery = Discovery::new(cluster.client().await).run().await.unwrap();
    let mut served = BTreeMap::new();
    for group in discovery.groups() {
        for version in group.versions() {
            for (resource, caps) in group.versioned_resources(version) {
                if caps.supports_operation(verbs::LIST) && caps.supports_operation(verbs::WATCH) {
                    let g = if resource.group.is_empty() {
                        "core"
                    } else {
                        &resource.group
                    };
                    served.insert(format!("{g}/{}", resource.kind), resource.plural.clone());
                }
            }
        }
    }
    let file = Path::new(CHART).join("files/builtin-plurals.yaml");
    let table: BTreeMap<String, String> = yaml_docs(&file)
        .pop()
        .map(|v| serde_json::from_value(v).unwrap())
        .unwrap_or_default();
    eprintln!(
        "{} kinds served with list and watch, {} in {}",
        served.len(),
        table.len(),
        file.display()
    );
    if table != served {
        let lines: Vec<String> = served.iter().map(|(k, p)| format!("{k}: {p}")).collect();
        panic!(
            "{} differs from the API server's discovery; it should read:\n{}",
            file.display(),
            lines.join("\n")
        );
    }
}

/// The config the chart installed (its ConfigMap), made to run here.
async fn installed_config(admin: &kube::Client, url: &str, identity: &str) -> Value {
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), DEPLOY_NAMESPACE)
        .get("kube-event-bridge-config")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, &cm.data.unwrap()["config.yaml"]).unwrap();
    for_this_test(yaml_docs(&path).remove(0), url, identity)
}

/// `helm install` of the chart with its NATS example into a real API server (no `--wait`:
/// nothing runs pods here). Every object is created; the ServiceMonitor and PrometheusRule
/// are left out (the cluster serves no monitoring.coreos.com). With a token of the chart's
/// ServiceAccount and the config the chart installed, the bridge passes
/// [`rbac_is_enough_and_a_missing_verb_is_reported`], restored by `helm upgrade` (its
/// three-way merge puts the edited rule back). An upgrade that changes
/// `config.sharding.shards` uses `Recreate`, the next one rolls again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_and_its_rbac_is_enough() {
    let cluster = Cluster::start().await;
    let admin = cluster.client().await;
    cluster.create_namespace("shop").await;
    let values = ["-f", "deploy/helm/examples/nats.yaml"];
    let install = [
        &[
            "install",
            "kube-event-bridge",
            CHART,
            "-n",
            DEPLOY_NAMESPACE,
            "--create-namespace",
        ][..],
        &values,
    ]
    .concat();
    let upgrade = [
        &[
            "upgrade",
            "kube-event-bridge",
            CHART,
            "-n",
            DEPLOY_NAMESPACE,
        ][..],
        &values,
    ]
    .concat();
    eprintln!("helm install:\n{}", run_helm(&cluster, &install));
    let manifest = run_helm(
        &cluster,
        &[
            "get",
            "manifest",
            "kube-event-bridge",
            "-n",
            DEPLOY_NAMESPACE,
        ],
    );
    let installed: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .collect();
    eprintln!("installed: {installed:?}");
    for kind in [
        "ServiceAccount",
        "ConfigMap",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
    ] {
        assert!(installed.contains(&kind), "no {kind}: {installed:?}");
    }
    assert!(
        !installed.contains(&"ServiceMonitor") && !installed.contains(&"PrometheusRule"),
        "monitoring objects on a cluster without their CRDs: {installed:?}"
    );
    let role = Api::<ClusterRole>::all(admin.clone())
        .get("kube-event-bridge")
        .await
        .unwrap();
    let lease_role = Api::<Role>::namespaced(admin.clone(), DEPLOY_NAMESPACE)
        .get("kube-event-bridge-leader-election")
        .await
        .unwrap();
    eprintln!(
        "ClusterRole rules: {}\nLease Role rules: {}",
        serde_json::to_string(&role.rules).unwrap(),
        serde_json::to_string(&lease_role.rules).unwrap()
    );
    let deployment_strategy = async || {
        let d = Api::<Deployment>::namespaced(admin.clone(), DEPLOY_NAMESPACE)
            .get("kube-event-bridge")
            .await
            .unwrap()
            .spec
            .unwrap();
        (d.replicas, d.strategy.unwrap().type_)
    };
    assert_eq!(
        deployment_strategy().await,
        (Some(2), Some("RollingUpdate".into()))
    );

    let kubeconfig =
        service_account_kubeconfig(&cluster, DEPLOY_NAMESPACE, "kube-event-bridge").await;
    rbac_is_enough_and_a_missing_verb_is_reported(
        &cluster,
        &kubeconfig,
        async |url, identity| installed_config(&admin, url, identity).await,
        async || drop(run_helm(&cluster, &upgrade)),
    )
    .await;

    // An upgrade that changes the number of shards replaces the pods at once (the chart
    // reads the installed config); the next one, with the same count, rolls them again.
    let sharded = [&upgrade[..], &["--set", "config.sharding.shards=4"]].concat();
    run_helm(&cluster, &sharded);
    let after_change = deployment_strategy().await.1;
    run_helm(&cluster, &sharded);
    let after_same = deployment_strategy().await.1;
    eprintln!("strategy after 1 → 4 shards: {after_change:?}, after 4 → 4: {after_same:?}");
    assert_eq!(after_change.as_deref(), Some("Recreate"));
    assert_eq!(after_same.as_deref(), Some("RollingUpdate"));

    // The chart's sharded Lease Role is enough: a replica with the installed (4-shard) config
    // takes every shard's Lease and its own membership Lease, refused nothing.
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let replica = Replica::start(
        dir.path(),
        "replica-3",
        &installed_config(&admin, &nats.url(), "replica-3").await,
        &kubeconfig,
    );
    let leases: Api<Lease> = Api::namespaced(admin.clone(), DEPLOY_NAMESPACE);
    let mut holders = Vec::new();
    let held = wait::within(Patience::of(Duration::from_secs(60)), async || {
        holders.clear();
        for s in 0..4 {
            let lease = leases
                .get_opt(&format!("kube-event-bridge-shard-{s}-of-4"))
                .await
                .unwrap();
            holders.push(lease.and_then(|l| l.spec?.holder_identity));
        }
        holders.iter().all(|h| h.as_deref() == Some("replica-3"))
    })
    .await;
    let member = leases
        .get_opt("kube-event-bridge-member-replica-3")
        .await
        .unwrap();
    let refused = refusals(&replica);
    eprintln!(
        "sharded by the chart: shard Leases held by {holders:?}, membership Lease {}, {} log \
         lines about refusals",
        if member.is_some() {
            "present"
        } else {
            "missing"
        },
        refused.len()
    );
    if !held {
        dump(std::slice::from_ref(&replica));
    }
    assert!(held, "{holders:?}");
    assert!(member.is_some());
    assert!(refused.is_empty(), "{refused:#?}");
}
