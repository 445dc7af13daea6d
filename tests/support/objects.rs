//! The objects tests and benches build, one builder per kind: typed (k8s-openapi) for the
//! built-in kinds, JSON for the custom resources the API test server serves.
//!
//! Benches include this file with `#[path]`: it uses only crates every target has, and
//! nothing of the `support` module around it.
#![allow(dead_code)] // each test binary and bench uses a different part

use std::{collections::BTreeMap, sync::Arc};

use k8s_openapi::{
    ByteString, Metadata, Resource,
    api::{
        apps::v1::{Deployment, DeploymentCondition, DeploymentSpec, DeploymentStatus},
        core::v1::{
            ConfigMap, Container, ContainerPort, Namespace, PodSpec, PodTemplateSpec, Secret,
        },
    },
    apimachinery::pkg::apis::meta::v1::{
        FieldsV1, LabelSelector, ManagedFieldsEntry, ObjectMeta, Time,
    },
};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, TypeMeta};
use kube_event_bridge::informer::{CachedObject, ObjectRef};
use serde_json::{Value, json};

/// ConfigMap `i` of a realistic cluster: about 960 bytes of JSON with labels, annotations,
/// managedFields and a few data keys, in one of 40 namespaces (`team-N`). Memory and sync
/// benches use it.
pub fn realistic_configmap(i: usize) -> ConfigMap {
    let team = format!("team-{}", i % 40);
    let created = Time("2026-11-01T08:30:00Z".parse().unwrap());
    let config = format!(
        "server:\n  port: 8080\n  replicas: {}\ncache:\n  ttl: 300s\n  size: 512Mi\ndatabase:\n  host: db-{}.internal\n  pool: 20\n",
        i % 7,
        i % 13
    );
    configmap_with_data(
        &team,
        &format!("app-config-{i:06}"),
        [
            ("LOG_LEVEL", "info".to_owned()),
            ("FEATURE_FLAGS", "checkout-v2,search-beta".to_owned()),
            ("config.yaml", config),
        ],
    )
    .uid(format!("5f0c2b1e-9d7a-4c1b-8e2f-{i:012}"))
    .resource_version(1_000_000 + i)
    .labels([
        ("app.kubernetes.io/name", "shop"),
        ("app.kubernetes.io/part-of", "platform"),
        ("team", team.as_str()),
    ])
    .annotation("meta.helm.sh/release-name", "shop")
    .annotation("meta.helm.sh/release-namespace", &team)
    .meta(|m| {
        m.creation_timestamp = Some(created.clone());
        m.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some("helm".into()),
            operation: Some("Update".into()),
            api_version: Some("v1".into()),
            time: Some(created),
            fields_type: Some("FieldsV1".into()),
            fields_v1: Some(FieldsV1(
                json!({"f:data": {"f:config.yaml": {}, "f:LOG_LEVEL": {}}}),
            )),
            ..Default::default()
        }]);
    })
}

/// The namespace of the `i`-th object spread round robin over [`spread_namespaces`].
pub fn spread_namespace(i: usize) -> String {
    thread_local! {
        static NAMESPACES: Vec<String> = spread_namespaces();
    }
    NAMESPACES.with(|n| n[i % n.len()].clone())
}

/// Namespaces as teams name them (service, then environment): 60 of them. FNV-1a's high
/// bits, which pick the shard, hardly change with a string's last characters, so names that
/// differ only at the end (`ns-01`, `ns-02`, …) fall into one shard; these spread.
pub fn spread_namespaces() -> Vec<String> {
    let services = [
        "payments",
        "checkout",
        "search",
        "cart",
        "users",
        "orders",
        "inventory",
        "shipping",
        "billing",
        "auth",
        "gateway",
        "monitoring",
        "logging",
        "ingress",
        "catalog",
        "reviews",
        "pricing",
        "mail",
        "media",
        "ledger",
    ];
    services
        .iter()
        .flat_map(|s| ["dev", "staging", "prod"].map(|e| format!("{s}-{e}")))
        .collect()
}

/// The ConfigMap resource (`v1`, `configmaps`).
pub fn configmaps() -> ApiResource {
    core_resource("ConfigMap", "configmaps")
}

/// The Deployment resource (`apps/v1`, `deployments`).
pub fn deployments() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("apps", "v1", "Deployment"),
        "deployments",
    )
}

/// A resource of the core group (`v1`): its kind and plural.
pub fn core_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", kind), plural)
}

/// A typed object with only its metadata: `name`, in namespace `ns` (`None`: cluster-scoped).
pub fn named<K: Metadata<Ty = ObjectMeta> + Default>(ns: Option<&str>, name: &str) -> K {
    let mut obj = K::default();
    let meta = obj.metadata_mut();
    meta.name = Some(name.into());
    meta.namespace = ns.map(Into::into);
    obj
}

/// A ConfigMap `ns/name` with `data.v = value`: the shape most tests create and change.
pub fn configmap(ns: &str, name: &str, value: &str) -> ConfigMap {
    configmap_with_data(ns, name, [("v", value)])
}

/// A ConfigMap `ns/name` holding `data` (none: no `data` field at all).
pub fn configmap_with_data<K: Into<String>, V: Into<String>>(
    ns: &str,
    name: &str,
    data: impl IntoIterator<Item = (K, V)>,
) -> ConfigMap {
    let data: BTreeMap<String, String> = data
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    ConfigMap {
        data: (!data.is_empty()).then_some(data),
        ..named(Some(ns), name)
    }
}

/// A Secret `ns/name` holding `data` (raw bytes; they go out base64-encoded as the API
/// server sends them; none: no `data` field at all).
pub fn secret(ns: &str, name: &str, data: &[(&str, &[u8])]) -> Secret {
    let data: BTreeMap<String, ByteString> = data
        .iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
        .collect();
    Secret {
        data: (!data.is_empty()).then_some(data),
        ..named(Some(ns), name)
    }
}

/// A Namespace `name`.
pub fn namespace(name: &str) -> Namespace {
    named(None, name)
}

/// A Deployment `ns/name` labelled and selected by `app: name`, annotated `owner: shop`, of
/// `replicas` replicas running `image` (one container `main`, port 8080), `ready` of them
/// ready (and `Available` when any is).
pub fn deployment(ns: &str, name: &str, replicas: i32, ready: i32, image: &str) -> Deployment {
    let app = || BTreeMap::from([("app".to_string(), name.to_string())]);
    Deployment {
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(app()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(app()),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![Container {
                        name: "main".into(),
                        image: Some(image.into()),
                        ports: Some(vec![ContainerPort {
                            container_port: 8080,
                            ..Default::default()
                        }]),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: Some(DeploymentStatus {
            replicas: Some(replicas),
            ready_replicas: Some(ready),
            conditions: Some(vec![DeploymentCondition {
                type_: "Available".into(),
                status: if ready > 0 { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..named(Some(ns), name)
    }
    .label("app", name)
    .annotation("owner", "shop")
}

/// Metadata changes on any typed object, builder style:
/// `configmap("ns", "a", "1").label("team", "shop").uid("u-1")`.
pub trait Meta: Sized {
    /// Changes the metadata with `f`.
    fn meta(self, f: impl FnOnce(&mut ObjectMeta)) -> Self;

    /// Adds the label `key=value`.
    fn label(self, key: &str, value: &str) -> Self {
        self.meta(|m| {
            m.labels
                .get_or_insert_default()
                .insert(key.into(), value.into());
        })
    }

    /// Adds every label of `labels`.
    fn labels<K: Into<String>, V: Into<String>>(
        self,
        labels: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.meta(|m| {
            m.labels
                .get_or_insert_default()
                .extend(labels.into_iter().map(|(k, v)| (k.into(), v.into())));
        })
    }

    /// Adds the annotation `key=value`.
    fn annotation(self, key: &str, value: &str) -> Self {
        self.meta(|m| {
            m.annotations
                .get_or_insert_default()
                .insert(key.into(), value.into());
        })
    }

    /// Sets the uid (the API test server assigns one when it is unset).
    fn uid(self, uid: impl Into<String>) -> Self {
        self.meta(|m| m.uid = Some(uid.into()))
    }

    /// Sets the resourceVersion (the API test server assigns its own).
    fn resource_version(self, rv: impl ToString) -> Self {
        self.meta(|m| m.resource_version = Some(rv.to_string()))
    }

    /// Adds a `managedFields` entry of `manager` (the informer strips them).
    fn managed_by(self, manager: &str) -> Self {
        self.meta(|m| {
            m.managed_fields
                .get_or_insert_default()
                .push(ManagedFieldsEntry {
                    manager: Some(manager.into()),
                    ..Default::default()
                });
        })
    }
}

impl<K: Metadata<Ty = ObjectMeta>> Meta for K {
    fn meta(mut self, f: impl FnOnce(&mut ObjectMeta)) -> Self {
        f(self.metadata_mut());
        self
    }
}

/// Serializes a typed object with its apiVersion and kind (k8s-openapi omits them by default).
pub fn typed<K: Resource + serde::Serialize>(obj: &K) -> Value {
    let mut v = serde_json::to_value(obj).unwrap();
    v["apiVersion"] = K::API_VERSION.into();
    v["kind"] = K::KIND.into();
    v
}

/// A ConfigMap as an informer caches it (what listeners, encoders and sinks get). Built
/// without a JSON round trip, so that benches building one per event measure the pipeline.
pub fn cached(cm: ConfigMap) -> ObjectRef {
    let mut data = serde_json::Map::new();
    if let Some(d) = cm.data {
        data.insert(
            "data".into(),
            Value::Object(d.into_iter().map(|(k, v)| (k, Value::String(v))).collect()),
        );
    }
    Arc::new(CachedObject::new(&DynamicObject {
        types: Some(TypeMeta {
            api_version: ConfigMap::API_VERSION.into(),
            kind: ConfigMap::KIND.into(),
        }),
        metadata: cm.metadata,
        data: Value::Object(data),
    }))
}

/// A custom resource of `api_version` and `kind`, `name` in namespace `ns` (`None`:
/// cluster-scoped), without a spec.
pub fn custom_resource(api_version: &str, kind: &str, ns: Option<&str>, name: &str) -> Value {
    let mut obj = json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name}});
    if let Some(ns) = ns {
        obj["metadata"]["namespace"] = ns.into();
    }
    obj
}

/// A Widget (`example.com/v1`, a kind the API test server serves from the start) `ns/name`
/// with `spec`.
pub fn widget(ns: &str, name: &str, spec: Value) -> Value {
    let mut obj = custom_resource("example.com/v1", "Widget", Some(ns), name);
    obj["spec"] = spec;
    obj
}

/// A Gadget of `group`/v1 (a kind a test serves by installing its CRD) `ns/name`, with
/// `spec.size = 1`.
pub fn gadget(group: &str, ns: &str, name: &str) -> Value {
    let mut obj = custom_resource(&format!("{group}/v1"), "Gadget", Some(ns), name);
    obj["spec"] = json!({"size": 1});
    obj
}
