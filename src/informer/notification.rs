//! What listeners receive: client-go's add, update and delete notifications, and the event
//! type a message reports for each.

use std::{sync::Arc, time::Instant};

use serde::{Deserialize, Serialize};

use super::{ObjectRef, meta_namespace_key, resource_version};

/// An object's key (`namespace/name`): made once when the informer builds a notification and
/// shared by every listener's copy, and by the route queue's and work queue's maps, so that
/// handing it on copies a pointer, not the text.
pub type Key = Arc<str>;

/// What a listener receives: client-go's `addNotification`, `updateNotification` and
/// `deleteNotification`, stamped with when the reflector received the change.
///
/// The key and event type are worked out once, when it is built, and kept beside `kind`:
/// that is why `kind` is private and changed only through [`Notification::set_kind`].
#[derive(Debug, Clone)]
pub struct Notification {
    /// What happened.
    kind: NotificationKind,
    /// `kind`'s event type (see [`Notification::event_type`]).
    event_type: EventType,
    /// The object's `namespace/name`.
    key: Key,
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
    /// For a delete inferred rather than seen (final state unknown: a relist or a resume found
    /// the object gone, or a new incarnation under its key): the resourceVersion at which it
    /// was found gone (the list's, or the new incarnation's), which the message reports as its
    /// `k8sresourceversion` instead of the last known state's. It is no older than anything
    /// published for the key before, and no newer than what follows, so that consumers that
    /// drop messages older than what they hold keep the delete. `None`: the object's own.
    pub gone_at: Option<Arc<str>>,
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
        Self::at(kind, Instant::now(), jiff::Timestamp::now())
    }

    /// A notification of `kind` received at `received` (wall clock `observed`), not resumed
    /// and not a filter's.
    pub fn at(kind: NotificationKind, received: Instant, observed: jiff::Timestamp) -> Self {
        let key = meta_namespace_key(object_of(&kind)).into();
        Self::keyed(kind, key, received, observed)
    }

    /// As [`Notification::at`], with the object's key already made (it must be `kind`'s
    /// object's `namespace/name`).
    pub fn keyed(
        kind: NotificationKind,
        key: Key,
        received: Instant,
        observed: jiff::Timestamp,
    ) -> Self {
        debug_assert_eq!(*key, meta_namespace_key(object_of(&kind)));
        Self {
            event_type: event_type_of(&kind),
            kind,
            key,
            received,
            observed,
            resumed: false,
            filtered_out: false,
            gone_at: None,
        }
    }

    /// Sets [`gone_at`](Self::gone_at) (a delete inferred rather than seen).
    pub fn found_gone_at(mut self, resource_version: Option<Arc<str>>) -> Self {
        self.gone_at = resource_version;
        self
    }

    /// Marks it derived by a resume (see `resumed`).
    pub fn into_resumed(mut self) -> Self {
        self.resumed = true;
        self
    }

    /// Marks it a filter's delete (see `filtered_out`).
    pub fn into_filtered_out(mut self) -> Self {
        self.filtered_out = true;
        self
    }

    /// What happened.
    pub fn kind(&self) -> &NotificationKind {
        &self.kind
    }

    /// Replaces what happened, about the same object (coalescing, a filter's rewrite); the
    /// event type follows.
    pub fn set_kind(&mut self, kind: NotificationKind) {
        debug_assert_eq!(*self.key, meta_namespace_key(object_of(&kind)));
        self.event_type = event_type_of(&kind);
        self.kind = kind;
    }

    /// The object the notification is about (the newest state).
    pub fn object(&self) -> &ObjectRef {
        object_of(&self.kind)
    }

    /// `namespace/name` of the object.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The event type a message reports: an update that did not change the
    /// resourceVersion is a resync.
    pub fn event_type(&self) -> EventType {
        self.event_type
    }
}

fn object_of(kind: &NotificationKind) -> &ObjectRef {
    match kind {
        NotificationKind::Add { obj, .. } | NotificationKind::Delete { obj, .. } => obj,
        NotificationKind::Update { new, .. } => new,
    }
}

fn event_type_of(kind: &NotificationKind) -> EventType {
    match kind {
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

/// A notification type. The discriminants index per-type arrays (metrics, filters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
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
