//! What listeners receive: client-go's add, update and delete notifications, and the event
//! type a message reports for each.

use std::{sync::Arc, time::Instant};

use serde::{Deserialize, Serialize};

use super::{ObjectRef, meta_namespace_key, resource_version};

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
    pub fn event_type(&self) -> EventType {
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

/// A notification type. The discriminants index per-type arrays (metrics, filters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventType {
    /// An object appeared (initial list or created).
    Added = 0,
    /// An object changed.
    Updated,
    /// An object was deleted.
    Deleted,
    /// Periodic resync of an unchanged object.
    Synced,
}

impl EventType {
    /// Every type, in discriminant order.
    pub const ALL: [EventType; 4] = [Self::Added, Self::Updated, Self::Deleted, Self::Synced];

    /// The lower-case name used in message types and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "added",
            Self::Updated => "updated",
            Self::Deleted => "deleted",
            Self::Synced => "synced",
        }
    }
}
