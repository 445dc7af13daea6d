//! The service binary against a real kube-apiserver v1.36 and etcd 3.6 (tests/support/
//! cluster.rs), with client-go's own informer beside it as the reference: what each ends
//! with is folded per key in message order and compared with the API server (lost deletes,
//! phantom deletes, stale finals, missing, duplicates), and the stream is compared with
//! client-go's, notification by notification.
//!
//! One test binary (each costs link time), a module per feature: [`parity`] with client-go,
//! [`discovery`] (CRDs and API server restarts), [`resume`], [`failover`], [`filters`],
//! [`paged_list`] (a list streamed into the pipeline page by page), [`gzip`] (compressed
//! lists) and [`in_flight`] (a small bound on objects in flight at scale);
//! the scenarios run on either broker through
//! `support::broker::Broker`. The sharded scenarios are in tests/sharding/.

#[path = "../support/mod.rs"]
mod support;

mod discovery;
mod failover;
mod filters;
mod gzip;
mod in_flight;
mod paged_list;
mod parity;
mod resume;

use std::path::Path;

use serde_json::{Value, json};
use support::{config::ConfigBuilder, replica::Replica};

/// The group of the Gadget CRD the discovery scenarios install.
const GROUP: &str = "shop.example.org";

/// A Gadget of `GROUP` at `version`, `ns/name`, with `spec.size`.
fn gadget(version: &str, ns: &str, name: &str, size: u64) -> Value {
    json!({
        "apiVersion": format!("{GROUP}/{version}"), "kind": "Gadget",
        "metadata": {"namespace": ns, "name": name}, "spec": {"size": size},
    })
}

/// A bridge replica `identity` of cluster `cluster_name` watching ConfigMaps in `ns`,
/// publishing to `sink`, with the tests' fast leader election when `leader`.
pub(crate) fn replica_to(
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

/// The ConfigMaps of `api` (namespace `ns`) labelled `team=shop`, the objects a consumer of
/// the filter scenarios should end with: per key, uid and resourceVersion.
pub(crate) async fn shop_configmaps(
    api: &kube::Api<k8s_openapi::api::core::v1::ConfigMap>,
    ns: &str,
) -> support::fold::Objects {
    api.list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
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
}
