//! The informer machinery of client-go's `tools/cache`, over `DynamicObject`s.
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
pub mod listener;
pub mod object;
pub mod reflector;
pub mod shared_informer;

use std::{sync::Arc, time::Instant};

pub use delta_fifo::{Delta, DeltaFifo, DeltaType};
pub use factory::{InformerKey, SharedInformerFactory};
pub use indexer::Indexer;
pub use listener::{NotificationHandler, ProcessorListener};
pub use object::{CachedObject, ObjectMetaRef};
pub use shared_informer::SharedIndexInformer;

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

/// What a listener receives: client-go's `addNotification`, `updateNotification` and
/// `deleteNotification`, stamped with when the reflector received the change.
#[derive(Debug, Clone)]
pub struct Notification {
    /// What happened.
    pub kind: NotificationKind,
    /// When the watch event (or list) that caused it was received; for end-to-end latency.
    pub received: Instant,
    /// Wall-clock time of the same moment; the message's `time`.
    pub observed: jiff::Timestamp,
    /// Derived by a route's resume from its checkpoint rather than seen by the informer: an
    /// update's `old` and a delete's object are then stubs holding only what the checkpoint
    /// knows (apiVersion, kind, namespace, name, uid, resourceVersion), and messages omit
    /// `oldObject`. See `pipeline::resume`.
    pub resumed: bool,
    /// A `deleted` notification made by a route's filter: the object still exists but no
    /// longer passes the filter, and consumers that had it must drop it (`k8sfilteredout`).
    pub filtered_out: bool,
}

/// The three notifications of `ResourceEventHandler`.
#[derive(Debug, Clone)]
pub enum NotificationKind {
    /// `OnAdd(obj, isInInitialList)`.
    Add {
        /// The new object.
        obj: ObjectRef,
        /// True while the informer delivers its first list.
        is_initial_list: bool,
    },
    /// `OnUpdate(old, new)`. When both carry the same resourceVersion this is a resync.
    Update {
        /// The cached state before.
        old: ObjectRef,
        /// The state now.
        new: ObjectRef,
    },
    /// `OnDelete(obj)`.
    Delete {
        /// The last known state.
        obj: ObjectRef,
        /// The deletion was inferred by a relist (client-go's `DeletedFinalStateUnknown`): the
        /// object vanished while the watch was down and `obj` is the last state the cache saw.
        final_state_unknown: bool,
    },
}

impl Notification {
    /// A notification of `kind` received now (not resumed, not a filter's).
    pub fn new(kind: NotificationKind) -> Self {
        Self {
            kind,
            received: Instant::now(),
            observed: jiff::Timestamp::now(),
            resumed: false,
            filtered_out: false,
        }
    }

    /// The object the notification is about (the newest state).
    pub fn object(&self) -> &ObjectRef {
        match &self.kind {
            NotificationKind::Add { obj, .. } | NotificationKind::Delete { obj, .. } => obj,
            NotificationKind::Update { new, .. } => new,
        }
    }

    /// `namespace/name` of the object.
    pub fn key(&self) -> String {
        meta_namespace_key(self.object())
    }

    /// The event type a message reports: an update that did not change the
    /// resourceVersion is a resync.
    pub fn event_type(&self) -> crate::config::EventType {
        use crate::config::EventType;
        match &self.kind {
            NotificationKind::Add { .. } => EventType::Added,
            NotificationKind::Update { old, new }
                if Arc::ptr_eq(old, new) || resource_version(old) == resource_version(new) =>
            {
                EventType::Synced
            }
            NotificationKind::Update { .. } => EventType::Updated,
            NotificationKind::Delete { .. } => EventType::Deleted,
        }
    }
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
}
