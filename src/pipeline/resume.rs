//! Resume: a route compares the informer's initial state with its checkpoint, exactly as
//! client-go's `DeltaFIFO.Replace` compares a relist with its known objects, so that a restart
//! or a new leader publishes what changed while no replica published, and only that.
//!
//! # Contract
//! The [`Resumer`] sits between a route's listeners and its [`RouteQueue`](super::RouteQueue) (or its filter). While resuming
//! (from [`Resumer::begin`] with a checkpoint until every informer of the route has passed on
//! its initial state), for each object of the initial state:
//! - not in the checkpoint → `added`, not marked initial;
//! - same uid and resourceVersion → nothing (counted `unchanged`);
//! - same uid, other resourceVersion → `updated`, with a stub `old` (no `oldObject` in the
//!   message: the checkpoint holds no object);
//! - other uid (deleted and recreated meanwhile) → `deleted` of the old uid (final state
//!   unknown, a stub object, found gone at the new object's resourceVersion), then `added`;
//!
//! and once the whole initial state has passed, every checkpoint key it did not hold →
//! `deleted`, final state unknown, with a stub object (apiVersion, kind, namespace, name, uid,
//! resourceVersion of the last acknowledged version), found gone at the list's
//! resourceVersion. A change the informer delivers meanwhile settles its key the same way (a
//! new uid first deletes the old one).
//!
//! A resumed delete's message reports the version it was found gone at as its
//! `k8sresourceversion` (see `Notification::gone_at`): the checkpoint's may be older than what
//! another replica published for the key after its last checkpoint write. Its id keeps the
//! checkpoint's version (`uid:resourceVersion:deleted` of the stub), so every replica and
//! attempt resuming from the same checkpoint gives the delete the same id, whatever list
//! found it gone. Messages derived from
//! the checkpoint carry `k8sresumed: true`. Without a checkpoint the initial state passes
//! through as initial adds (the behaviour without resume).
//!
//! The route's `events` apply after the comparison (and the filter), in its queue, so that
//! they cannot make objects look vanished, and a delete the route does not publish still
//! removes the key from the checkpoint.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicBool, Ordering},
};

use kube::api::{DynamicObject, ObjectMeta, TypeMeta};
use prometheus::IntCounter;
use tracing::info;

use super::{checkpoint::Checkpoint, checkpoint::Entry};
use crate::informer::{
    CachedObject, Notification, NotificationHandler, NotificationKind, ObjectRef,
};

/// What a resume found for one object, counted in `keb_resume_objects_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Same uid and resourceVersion as the checkpoint: nothing published.
    Unchanged = 0,
    /// A newer resourceVersion: published as updated.
    Updated,
    /// In the checkpoint but gone: published as deleted.
    Deleted,
    /// Not in the checkpoint: published as added.
    Added,
    /// A new uid under a checkpointed key: delete then add.
    Recreated,
}

impl Outcome {
    /// Every outcome, in discriminant order.
    pub const ALL: [Outcome; 5] = [
        Self::Unchanged,
        Self::Updated,
        Self::Deleted,
        Self::Added,
        Self::Recreated,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unchanged => "unchanged",
            Self::Updated => "updated",
            Self::Deleted => "deleted",
            Self::Added => "added",
            Self::Recreated => "recreated",
        }
    }
}

/// See the module docs.
pub struct Resumer {
    route: String,
    next: Arc<dyn NotificationHandler>,
    types: Mutex<TypeMeta>,
    informers: usize,
    state: Mutex<State>,
    // Mirrors `state` (set and cleared under its lock): once a resume is over, notifications
    // go straight to the queue without taking the lock.
    resuming: AtomicBool,
    outcomes: [IntCounter; Outcome::ALL.len()],
    // `keb_route_resuming`: 1 from `term_began` until the resume is over or the term ends.
    unresumed: prometheus::IntGauge,
    // The version the kind was last found gone at (see `kind_gone`), until it is served again.
    kind_gone_at: Mutex<Option<Arc<str>>>,
}

enum State {
    Passing,
    Resuming {
        remaining: Checkpoint,
        unsynced: usize,
        /// What was passed on so far, per key (what consumers will have once it is
        /// delivered): informers replaced mid-resume compare their initial state with it too.
        passed: Checkpoint,
        /// What was passed on before the informers were replaced, compared like `remaining`
        /// (a key the new initial state lacks is deleted), except that an unchanged one is not
        /// reported as known (the stages behind already know what they passed on).
        replayed: Checkpoint,
    },
}

impl Resumer {
    /// A resumer in front of `next` (the route's queue, or its filter), for a route fed by
    /// `informers` informers. `types` are the apiVersion and kind of stubs.
    pub fn new(
        route: String,
        next: Arc<dyn NotificationHandler>,
        types: TypeMeta,
        informers: usize,
        outcomes: [IntCounter; Outcome::ALL.len()],
        unresumed: prometheus::IntGauge,
    ) -> Self {
        Self {
            route,
            next,
            types: Mutex::new(types),
            informers: informers.max(1),
            state: Mutex::new(State::Passing),
            resuming: AtomicBool::new(false),
            outcomes,
            unresumed,
            kind_gone_at: Mutex::default(),
        }
    }

    /// A term of the route began here: until its resume is over (see [`begin`](Self::begin))
    /// `keb_route_resuming` is 1.
    pub fn term_began(&self) {
        self.unresumed.set(1);
    }

    /// The term ended: whatever its resume reached, `keb_route_resuming` is 0.
    pub fn term_ended(&self) {
        self.unresumed.set(0);
    }

    /// The resume is over (or there was none): stops `keb_route_resuming` once in `Passing`.
    fn over(&self) {
        self.resuming.store(false, Ordering::SeqCst);
        self.unresumed.set(0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The route's informers were replaced (the kind is now served at another version):
    /// stubs carry `types` from now on, and a resume still running starts over with the new
    /// informers' initial state, compared with the checkpoint where nothing was passed on yet
    /// and with what was passed on elsewhere.
    pub fn informers_replaced(&self, types: TypeMeta) {
        *self.types.lock().unwrap_or_else(|e| e.into_inner()) = types;
        *self.kind_gone_at.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let State::Resuming {
            unsynced,
            passed,
            replayed,
            ..
        } = &mut *self.lock()
        {
            *unsynced = self.informers;
            replayed.extend(passed.drain());
        }
    }

    /// The kind is gone (its CRD was deleted): a resume still running deletes every key it
    /// has not seen yet (the informer's own deletes cannot reach listeners that are off),
    /// found gone at `gone_at` (the newest version its informers saw, if any ran), and is
    /// over.
    pub fn kind_gone(&self, gone_at: Option<Arc<str>>) {
        // Kept for a resume that begins later (a route waiting for its checkpoint while the
        // kind went): its informers are gone by then.
        let gone_at = {
            let mut kept = self.kind_gone_at.lock().unwrap_or_else(|e| e.into_inner());
            let newest =
                crate::informer::newest_resource_version(gone_at.into_iter().chain(kept.clone()));
            kept.clone_from(&newest);
            newest
        };
        let mut state = self.lock();
        let State::Resuming {
            remaining,
            replayed,
            ..
        } = &mut *state
        else {
            return;
        };
        let vanished: Vec<(String, Entry)> = std::mem::take(remaining)
            .into_iter()
            .chain(std::mem::take(replayed))
            .collect();
        *state = State::Passing;
        self.over();
        drop(state);
        self.delete_vanished(vanished, gone_at);
    }

    /// Deletes `vanished` checkpoint keys (final state unknown, stubs), found gone at
    /// `gone_at`, in key order.
    fn delete_vanished(
        &self,
        mut vanished: Vec<(String, Entry)>,
        gone_at: Option<Arc<str>>,
    ) -> usize {
        vanished.sort_by(|a, b| a.0.cmp(&b.0));
        let (received, observed) = (std::time::Instant::now(), jiff::Timestamp::now());
        let deleted = vanished.len();
        for (key, entry) in vanished {
            self.count(Outcome::Deleted);
            let kind = NotificationKind::Delete {
                obj: self.stub(&key, &entry),
                final_state_unknown: true,
            };
            self.forward(
                Notification::keyed(kind, key.into(), received, observed)
                    .into_resumed()
                    .found_gone_at(gone_at.clone()),
            );
        }
        deleted
    }

    /// Whether a resume runs (the initial state is still being compared).
    pub fn is_resuming(&self) -> bool {
        self.resuming.load(Ordering::SeqCst)
    }

    /// Starts resuming from `checkpoint` (call it before the listeners pass on the initial
    /// state); `None` passes the initial state through as initial adds.
    pub fn begin(&self, checkpoint: Option<Checkpoint>) {
        let mut state = self.lock();
        *state = match checkpoint {
            Some(remaining) => {
                info!(route = %self.route, keys = remaining.len(), "Resuming from the checkpoint");
                State::Resuming {
                    remaining,
                    unsynced: self.informers,
                    passed: Checkpoint::default(),
                    replayed: Checkpoint::default(),
                }
            }
            None => State::Passing,
        };
        let resuming = matches!(*state, State::Resuming { .. });
        self.resuming.store(resuming, Ordering::SeqCst);
        if !resuming {
            self.unresumed.set(0);
        }
    }

    fn forward(&self, n: Notification) {
        self.next.on_notification(n);
    }

    /// The stub of what the checkpoint knows of `key`.
    fn stub(&self, key: &str, entry: &Entry) -> ObjectRef {
        let (namespace, name) = match key.split_once('/') {
            Some((ns, name)) => (Some(ns.to_owned()), name.to_owned()),
            None => (None, key.to_owned()),
        };
        Arc::new(CachedObject::new(&DynamicObject {
            types: Some(self.types.lock().unwrap_or_else(|e| e.into_inner()).clone()),
            metadata: ObjectMeta {
                namespace,
                name: Some(name),
                uid: Some(entry.uid.clone()),
                resource_version: Some(entry.resource_version.clone()),
                ..Default::default()
            },
            data: serde_json::json!({}),
        }))
    }

    fn derived(&self, like: &Notification, kind: NotificationKind) -> Notification {
        Notification::keyed(kind, like.key().clone(), like.received, like.observed).into_resumed()
    }

    /// Deletes the incarnation the checkpoint knows at `key` (final state unknown, a stub),
    /// found gone at the version of its successor `like` is about (so that the successor's
    /// messages do not go back behind the delete).
    fn forward_gone(&self, like: &Notification, key: &str, entry: &Entry) {
        let at = crate::informer::resource_version(like.object()).into();
        self.forward(
            self.derived(
                like,
                NotificationKind::Delete {
                    obj: self.stub(key, entry),
                    final_state_unknown: true,
                },
            )
            .found_gone_at(Some(at)),
        );
    }

    fn count(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].inc();
    }
}

impl NotificationHandler for Resumer {
    fn on_notification(&self, n: Notification) {
        if !self.resuming.load(Ordering::SeqCst) {
            return self.forward(n);
        }
        let mut state = self.lock();
        let State::Resuming { remaining, .. } = &mut *state else {
            drop(state);
            return self.forward(n);
        };
        let key: &str = n.key();
        let mut entry = remaining.remove(key);
        let mut known_here = entry.is_some();
        if let State::Resuming {
            passed, replayed, ..
        } = &mut *state
        {
            if let Some(e) = replayed.remove(key) {
                known_here = false;
                entry = Some(e);
            }
            match n.kind() {
                NotificationKind::Delete { .. } => passed.remove(key),
                _ => passed.insert(
                    key.to_owned(),
                    Entry {
                        uid: n.object().uid().unwrap_or_default().to_owned(),
                        resource_version: crate::informer::resource_version(n.object()).to_owned(),
                        pending: false,
                        kind: None,
                    },
                ),
            };
        }
        drop(state);
        let uid = n.object().uid().unwrap_or_default().to_owned();
        match (n.kind().clone(), entry) {
            (
                NotificationKind::Add {
                    obj,
                    is_initial_list: true,
                },
                entry,
            ) => match entry {
                None => {
                    self.count(Outcome::Added);
                    self.forward(self.derived(
                        &n,
                        NotificationKind::Add {
                            obj,
                            is_initial_list: false,
                        },
                    ));
                }
                Some(e)
                    if e.uid == uid
                        && !e.pending
                        && e.resource_version == crate::informer::resource_version(&obj) =>
                {
                    self.count(Outcome::Unchanged);
                    if known_here {
                        self.next.on_known(key, Some(&obj));
                    }
                }
                Some(e) if e.uid == uid => {
                    self.count(Outcome::Updated);
                    let old = self.stub(key, &e);
                    self.forward(self.derived(&n, NotificationKind::Update { old, new: obj }));
                }
                Some(e) => {
                    self.count(Outcome::Recreated);
                    self.forward_gone(&n, key, &e);
                    self.forward(self.derived(
                        &n,
                        NotificationKind::Add {
                            obj,
                            is_initial_list: false,
                        },
                    ));
                }
            },
            // A change after the initial state: the informer follows the key from here on;
            // an older incarnation the checkpoint knows is deleted first.
            (_, Some(e)) if e.uid != uid => {
                self.count(Outcome::Deleted);
                self.forward_gone(&n, key, &e);
                self.forward(n);
            }
            (_, entry) => {
                if entry.is_some() && known_here {
                    self.next.on_known(key, None);
                }
                self.forward(n)
            }
        }
    }

    fn flush(&self) {
        self.next.flush();
    }

    /// One informer passed on its initial state: the checkpoint keys it would have held and
    /// did not are deleted now (an informer of one namespace: that namespace's keys), so that a
    /// namespace still waiting (forbidden, say) holds back only its own deletes. Once every
    /// informer has, every key left is deleted and the resume is over.
    fn on_synced(&self, namespace: Option<&str>, listed_at: Option<&str>) {
        let mut state = self.lock();
        let State::Resuming {
            remaining,
            unsynced,
            replayed,
            ..
        } = &mut *state
        else {
            return;
        };
        *unsynced = unsynced.saturating_sub(1);
        let vanished: Vec<_> = if *unsynced == 0 {
            let all = std::mem::take(remaining)
                .into_iter()
                .chain(std::mem::take(replayed))
                .collect();
            *state = State::Passing;
            self.over();
            all
        } else if let Some(ns) = namespace {
            let of_ns = |m: &mut Checkpoint| -> Vec<(String, Entry)> {
                let keys: Vec<String> = m
                    .keys()
                    .filter(|k| k.split_once('/').is_some_and(|(n, _)| n == ns))
                    .cloned()
                    .collect();
                keys.into_iter()
                    .filter_map(|k| m.remove_entry(&k))
                    .collect()
            };
            let mut v = of_ns(remaining);
            v.extend(of_ns(replayed));
            v
        } else {
            Vec::new()
        };
        let over = matches!(*state, State::Passing);
        drop(state);
        let deleted = self.delete_vanished(vanished, listed_at.map(Arc::from));
        if over {
            info!(route = %self.route, deleted, "Resumed: objects gone while down are deleted");
        } else {
            info!(route = %self.route, namespace, deleted, "Resumed one namespace: its objects gone while down are deleted");
        }
    }
}
