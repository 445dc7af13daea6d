//! The informer machinery of client-go's `tools/cache`, over objects kept as their JSON.
//!
//! ```text
//! Reflector ──deltas──▶ DeltaFifo ──pop──▶ SharedIndexInformer ──▶ Indexer
//!                                               │ distribute (never blocks)
//!                                               ▼
//!                       ProcessorListener (one per informer and sink) ─▶ NotificationHandler
//! ```
//!
//! Names and contracts are client-go's so that anyone who knows informers finds their way;
//! where behaviour differs, the type's doc says so.

pub mod delta_fifo;
pub mod factory;
pub mod indexer;
pub mod list_watch;
pub mod listener;
pub mod notification;
pub mod object;
pub mod reflector;
pub mod shared_informer;
pub mod transform;
pub mod watch_events;

use std::sync::Arc;

pub use delta_fifo::{Delta, DeltaFifo, DeltaType};
pub use factory::{InformerKey, SharedInformerFactory};
pub use indexer::Indexer;
pub use listener::{NotificationHandler, ProcessorListener};
pub use notification::{EventType, Key, Notification, NotificationKind};
pub use object::{CachedObject, ObjectMetaRef};
pub use shared_informer::SharedIndexInformer;
pub use transform::Transform;

/// A cached object. Shared between the cache, queues and encoders, and never mutated.
pub type ObjectRef = Arc<CachedObject>;

/// client-go's `MetaNamespaceKeyFunc`: `namespace/name`, or `name` for cluster-scoped objects.
pub fn meta_namespace_key(obj: &impl ObjectMetaRef) -> String {
    let name = obj.name().unwrap_or_default();
    match obj.namespace() {
        Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
        _ => name.to_owned(),
    }
}

/// The object's `metadata.resourceVersion`, or `""`.
pub fn resource_version(obj: &impl ObjectMetaRef) -> &str {
    obj.resource_version().unwrap_or_default()
}

/// The newest of `versions`, for what an object is found gone at when several versions are
/// known to be past its last state (each is). Compared as numbers, which they are on
/// etcd-backed API servers; otherwise the first (any of them is past that state).
pub fn newest_resource_version(versions: impl IntoIterator<Item = Arc<str>>) -> Option<Arc<str>> {
    let versions: Vec<Arc<str>> = versions.into_iter().collect();
    versions
        .iter()
        .map(|v| v.parse::<u64>().map(|n| (n, v)))
        .collect::<Result<Vec<_>, _>>()
        .ok()
        .and_then(|numbered| numbered.into_iter().max_by_key(|(n, _)| *n))
        .map(|(_, v)| v.clone())
        .or_else(|| versions.first().cloned())
}

#[cfg(test)]
pub(crate) mod testing {
    //! Object builders for unit tests.
    use super::*;

    /// A namespaced ConfigMap-like object with the given resourceVersion.
    pub fn obj(ns: &str, name: &str, rv: &str) -> ObjectRef {
        let mut o = kube::api::DynamicObject {
            types: Some(kube::api::TypeMeta {
                api_version: "v1".into(),
                kind: "ConfigMap".into(),
            }),
            metadata: Default::default(),
            data: serde_json::json!({}),
        };
        o.metadata.namespace = (!ns.is_empty()).then(|| ns.to_owned());
        o.metadata.name = Some(name.to_owned());
        o.metadata.resource_version = Some(rv.to_owned());
        o.metadata.uid = Some(format!("uid-{ns}-{name}"));
        Arc::new(CachedObject::new(&o))
    }

    /// The transform of a core `v1` kind: types restored, managedFields stripped, data
    /// redacted if `redact`.
    pub fn transform(kind: &str, redact: bool) -> Transform {
        let types = kube::api::TypeMeta {
            api_version: "v1".into(),
            kind: kind.into(),
        };
        Transform::new(types, true, redact)
    }
}
