//! client-go's `DeltaFIFO`: a per-object queue of deltas between the reflector and the informer.
//!
//! # Contract
//! - `items` maps a key to its deltas (oldest first, never empty); `queue` holds each key once,
//!   in FIFO order. A key that is already queued keeps its place when more deltas arrive.
//! - Two consecutive `Deleted` deltas collapse into one: the older is kept, unless it is a
//!   final-state-unknown tombstone, then the newer (real) one is kept.
//! - `delete` of a key that is neither queued nor cached is ignored.
//! - A (re)list queues `Replaced` for every listed object as it arrives (`begin_list`,
//!   `listed`), and when it is whole (`end_list`) a final-state-unknown `Deleted` for every
//!   queued or cached key it does not hold: objects that vanished while the watch was down
//!   are not forgotten. `replace` is the three at once, client-go's `Replace`.
//! - `resync` queues `Sync` only for cached keys with nothing queued, so a stale cached copy is
//!   never queued behind a newer event.
//! - `pop` hands the head key's deltas to a closure that runs under the FIFO lock, like
//!   client-go: while the informer applies deltas to the cache, `resync` and `replace` cannot
//!   observe a cache that is behind a popped delta.
//! - `has_synced` is true once the first list is whole and every key it queued (tombstones
//!   included) was popped, or once an add/update/delete came before any list.
//!
//! Unlike client-go, a list's objects pop while it is still running (client-go's reflector
//! collects the whole list and then calls `Replace`): the first pages reach the sinks while the
//! last are fetched, and no list is held in memory beside the cache. Nothing is lost by it: a
//! list that fails midway starts over, what its first part queued are real states at a
//! consistent version (a later list finds them again, unchanged, which is a resync that
//! publishes nothing, or changed, which is a real update), and only a whole list decides what
//! vanished. Also unlike client-go, nothing here transforms objects (the reflector does, before enqueueing).
//! `Replace`'s resourceVersion (the list's) is kept on each tombstone it makes: the version at
//! which the object was found gone, which its message reports (see
//! [`Notification::gone_at`](super::Notification::gone_at)).

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Instant,
};

use tokio::sync::Notify;

use super::{Indexer, ObjectRef, meta_namespace_key};

/// client-go's delta types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaType {
    /// The watch reported a new object.
    Added,
    /// The watch reported a change.
    Updated,
    /// The object is gone.
    Deleted,
    /// The object was in a (re)list.
    Replaced,
    /// Periodic resync of a cached object.
    Sync,
}

/// One change of one object.
#[derive(Debug, Clone)]
pub struct Delta {
    /// What happened.
    pub kind: DeltaType,
    /// The object's state; for deletes the last known state.
    pub object: ObjectRef,
    /// Only for `Deleted`: inferred by a relist, not seen on the watch
    /// (client-go's `DeletedFinalStateUnknown`).
    pub final_state_unknown: bool,
    /// Only for a final-state-unknown `Deleted`: the resourceVersion of the list that found
    /// the object gone.
    pub gone_at: Option<Arc<str>>,
    /// When the change was received.
    pub received: Instant,
    /// Wall-clock time of `received`.
    pub observed: jiff::Timestamp,
    /// The relist request the newest list begun when this delta was queued serves (see
    /// [`DeltaFifo::begin_list`]): a `Replaced` delta's is its own list's; a watch delta's,
    /// the list it follows. A listener streamed a relist tells by it what came from that
    /// list or after it.
    pub list: u64,
}

impl Delta {
    fn new(kind: DeltaType, object: ObjectRef) -> Self {
        Self {
            kind,
            object,
            final_state_unknown: false,
            gone_at: None,
            received: Instant::now(),
            observed: jiff::Timestamp::now(),
            list: 0,
        }
    }

    fn tombstone(object: ObjectRef, gone_at: Option<Arc<str>>) -> Self {
        Self {
            final_state_unknown: true,
            gone_at,
            ..Self::new(DeltaType::Deleted, object)
        }
    }
}

/// The deltas of one key, oldest first.
pub type Deltas = Vec<Delta>;

/// See the module docs for the contract.
pub struct DeltaFifo {
    state: Mutex<State>,
    notify: Notify,
    known: Arc<Indexer>,
}

#[derive(Default)]
struct State {
    items: HashMap<String, Deltas, crate::FastHash>,
    queue: VecDeque<String>,
    populated: bool,
    initial_population_count: usize,
    // Lists replaced so far, and the newest of them whose deltas have all been popped (keys
    // still to pop before it is: `replace_remaining`).
    replaces: u64,
    replaced_through: u64,
    replace_remaining: usize,
    // The resourceVersion of the newest list replaced, and of the newest one popped entirely.
    replaced_at: Option<Arc<str>>,
    applied_at: Option<Arc<str>>,
    // The keys of the list in progress, so far.
    listing: Option<std::collections::HashSet<String, crate::FastHash>>,
    // The relist request the newest list begun serves (see `Delta::list`).
    list_tag: u64,
    closed: bool,
}

impl std::fmt::Debug for DeltaFifo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeltaFifo")
            .field("len", &self.len())
            .finish()
    }
}

impl DeltaFifo {
    /// A FIFO whose known objects (for deletes, replace and resync) are `known`.
    pub fn new(known: Arc<Indexer>) -> Self {
        Self {
            state: Mutex::new(State::default()),
            notify: Notify::new(),
            known,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `Added`.
    pub fn add(&self, obj: ObjectRef) {
        let mut s = self.lock();
        s.populated = true;
        s.enqueue(meta_namespace_key(&obj), Delta::new(DeltaType::Added, obj));
        drop(s);
        self.notify.notify_one();
    }

    /// Queues `Updated`.
    pub fn update(&self, obj: ObjectRef) {
        let mut s = self.lock();
        s.populated = true;
        s.enqueue(
            meta_namespace_key(&obj),
            Delta::new(DeltaType::Updated, obj),
        );
        drop(s);
        self.notify.notify_one();
    }

    /// Queues `Deleted(obj)`, unless the key is neither queued nor known.
    pub fn delete(&self, obj: ObjectRef) {
        let key = meta_namespace_key(&obj);
        let mut s = self.lock();
        s.populated = true;
        if !s.items.contains_key(&key) && !self.known.contains(&key) {
            return;
        }
        s.enqueue(key, Delta::new(DeltaType::Deleted, obj));
        drop(s);
        self.notify.notify_one();
    }

    /// A whole (re)list at once: [`begin_list`](Self::begin_list), its objects, and
    /// [`end_list`](Self::end_list) under one lock.
    pub fn replace(&self, list: Vec<ObjectRef>, resource_version: Option<Arc<str>>) {
        let mut s = self.lock();
        s.listing = Some(std::collections::HashSet::with_capacity_and_hasher(
            list.len(),
            crate::FastHash::default(),
        ));
        for obj in list {
            s.list_one(obj);
        }
        s.end_list(&self.known, resource_version);
        drop(s);
        self.notify.notify_one();
    }

    /// A (re)list begins (forgetting what a list interrupted before it held): its objects come
    /// with [`listed`](Self::listed) as they arrive, and pop at once. `serving`: the newest
    /// relist request made before it was asked for; its deltas, and the watch's after it,
    /// carry it (see [`Delta::list`]).
    pub fn begin_list(&self, serving: u64) {
        let mut s = self.lock();
        s.listing = Some(std::collections::HashSet::default());
        s.list_tag = serving;
    }

    /// Queues `Replaced` for an object of the list in progress.
    pub fn listed(&self, obj: ObjectRef) {
        self.lock().list_one(obj);
        self.notify.notify_one();
    }

    /// The list in progress is whole, at `resource_version`: a final-state-unknown `Deleted`
    /// for every queued or known key it does not hold, found gone at that version. It counts
    /// as applied (and the first one as synced) once every key queued now has popped.
    pub fn end_list(&self, resource_version: Option<Arc<str>>) {
        self.lock().end_list(&self.known, resource_version);
        self.notify.notify_one();
    }

    /// How many lists [`replace`](Self::replace) took so far, and how many of them have been
    /// popped entirely (applied to the cache and distributed).
    pub fn replaces(&self) -> (u64, u64) {
        let s = self.lock();
        (s.replaces, s.replaced_through)
    }

    /// Queues `Sync(cached)` for every known key with nothing queued.
    pub fn resync(&self) {
        let mut s = self.lock();
        let mut any = false;
        for (key, cached) in self.known.entries() {
            if !s.items.contains_key(&key) {
                s.enqueue(key, Delta::new(DeltaType::Sync, cached));
                any = true;
            }
        }
        drop(s);
        if any {
            self.notify.notify_one();
        }
    }

    /// True once the first list has been popped entirely (see the module docs).
    pub fn has_synced(&self) -> bool {
        let s = self.lock();
        s.populated && s.initial_population_count == 0
    }

    /// Number of queued keys.
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether no key is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `f` under the FIFO lock: no delta is applied meanwhile (client-go's `blockDeltas`).
    /// `f` gets [`has_synced`](Self::has_synced) as of that moment.
    pub fn with_lock<R>(&self, f: impl FnOnce(bool) -> R) -> R {
        self.with_lock_listed(|synced, _| f(synced))
    }

    /// [`with_lock`](Self::with_lock), `f` also getting the resourceVersion of the newest list
    /// popped entirely (the version the cache's state is at, but for changes popped since):
    /// a key the cache lacks was gone at it.
    pub fn with_lock_listed<R>(&self, f: impl FnOnce(bool, Option<&Arc<str>>) -> R) -> R {
        let guard = self.lock();
        let synced = guard.populated && guard.initial_population_count == 0;
        f(synced, guard.applied_at.as_ref())
    }

    /// Wakes `pop` for good: once the queue is empty it returns `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.notify.notify_waiters();
        self.notify.notify_one();
    }

    /// Removes the head key's deltas and calls `process(deltas, is_in_initial_list)` under the
    /// FIFO lock. Waits while the queue is empty; `None` once closed and empty.
    pub async fn pop<R>(&self, mut process: impl FnMut(Deltas, bool) -> R) -> Option<R> {
        loop {
            if let Some(r) = self.try_pop(&mut process) {
                return Some(r);
            }
            if self.lock().closed {
                return None;
            }
            // `notify_one` stores a permit when nobody waits, so a push between the check above
            // and this await is not missed.
            self.notify.notified().await;
        }
    }

    /// `pop` without waiting: `None` when the queue is empty.
    pub fn try_pop<R>(&self, mut process: impl FnMut(Deltas, bool) -> R) -> Option<R> {
        let mut s = self.lock();
        let key = s.queue.pop_front()?;
        let deltas = s.items.remove(&key).expect("queued keys have deltas");
        let is_in_initial_list = !(s.populated && s.initial_population_count == 0);
        if s.initial_population_count > 0 {
            s.initial_population_count -= 1;
        }
        if s.replace_remaining > 0 {
            s.replace_remaining -= 1;
            if s.replace_remaining == 0 {
                s.replaced_through = s.replaces;
                s.applied_at = s.replaced_at.clone();
            }
        }
        Some(process(deltas, is_in_initial_list))
    }
}

impl State {
    fn list_one(&mut self, obj: ObjectRef) {
        let key = meta_namespace_key(&obj);
        self.listing.get_or_insert_default().insert(key.clone());
        self.enqueue(key, Delta::new(DeltaType::Replaced, obj));
    }

    fn end_list(&mut self, known: &Indexer, resource_version: Option<Arc<str>>) {
        let listed = self.listing.take().unwrap_or_default();
        // Keys only in the queue: tombstone carries the newest queued object.
        let queued_only: Vec<(String, ObjectRef)> = self
            .items
            .iter()
            .filter(|(k, _)| !listed.contains(*k))
            .map(|(k, d)| {
                (
                    k.clone(),
                    d.last().expect("deltas are never empty").object.clone(),
                )
            })
            .collect();
        for (key, newest) in queued_only {
            self.enqueue(key, Delta::tombstone(newest, resource_version.clone()));
        }
        // Keys only in the cache, with nothing queued (those of the list that popped already
        // are listed).
        for (key, cached) in known.entries() {
            if listed.contains(&key) || self.items.contains_key(&key) {
                continue;
            }
            self.enqueue(key, Delta::tombstone(cached, resource_version.clone()));
        }
        if !self.populated {
            // The first list: what is still queued (its keys that have not popped, and the
            // deletions) pops before it is synced.
            self.populated = true;
            self.initial_population_count = self.queue.len();
        }
        // Every key queued now (this list's and those queued before it) pops before the list
        // counts as applied.
        self.replaces += 1;
        self.replace_remaining = self.queue.len();
        self.replaced_at = resource_version;
        if self.replace_remaining == 0 {
            self.replaced_through = self.replaces;
            self.applied_at = self.replaced_at.clone();
        }
    }

    fn enqueue(&mut self, key: String, mut delta: Delta) {
        delta.list = self.list_tag;
        match self.items.get_mut(&key) {
            Some(deltas) => {
                deltas.push(delta);
                dedup_deletes(deltas);
            }
            None => {
                self.queue.push_back(key.clone());
                self.items.insert(key, vec![delta]);
            }
        }
    }
}

/// Collapses two trailing `Deleted` deltas; keeps the older unless it is a tombstone.
fn dedup_deletes(deltas: &mut Deltas) {
    let n = deltas.len();
    if n < 2 || deltas[n - 1].kind != DeltaType::Deleted || deltas[n - 2].kind != DeltaType::Deleted
    {
        return;
    }
    if deltas[n - 2].final_state_unknown {
        deltas.remove(n - 2);
    } else {
        deltas.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::testing::obj;

    fn fifo() -> (DeltaFifo, Arc<Indexer>) {
        let known = Arc::new(Indexer::new());
        (DeltaFifo::new(known.clone()), known)
    }

    /// (key, [(type, resourceVersion, final_state_unknown)], is_in_initial_list)
    type Popped = (String, Vec<(DeltaType, String, bool)>, bool);

    fn pop_all(f: &DeltaFifo) -> Vec<Popped> {
        let mut out = Vec::new();
        while let Some(entry) = f.try_pop(|deltas, initial| {
            let key = meta_namespace_key(&deltas[0].object);
            let ds = deltas
                .iter()
                .map(|d| {
                    (
                        d.kind,
                        crate::informer::resource_version(&d.object).to_owned(),
                        d.final_state_unknown,
                    )
                })
                .collect();
            (key, ds, initial)
        }) {
            out.push(entry);
        }
        out
    }

    #[test]
    fn deltas_accumulate_per_key_and_keys_keep_their_place() {
        let (f, _) = fifo();
        f.add(obj("ns", "a", "1"));
        f.add(obj("ns", "b", "2"));
        f.update(obj("ns", "a", "3"));
        let out = pop_all(&f);
        assert_eq!(
            out[0].0, "ns/a",
            "a queued key keeps its place (no line jumping)"
        );
        assert_eq!(
            out[0].1,
            [
                (DeltaType::Added, "1".into(), false),
                (DeltaType::Updated, "3".into(), false)
            ]
        );
        assert_eq!(out[1].0, "ns/b");
        assert!(!out[0].2, "add before any replace means synced");
    }

    #[test]
    fn consecutive_deletes_collapse() {
        let (f, known) = fifo();
        known.upsert("ns/a", obj("ns", "a", "1"));
        f.delete(obj("ns", "a", "2"));
        f.delete(obj("ns", "a", "3"));
        assert_eq!(
            pop_all(&f)[0].1,
            [(DeltaType::Deleted, "2".into(), false)],
            "older real delete is kept"
        );
    }

    #[test]
    fn real_delete_replaces_a_preceding_tombstone() {
        let (f, known) = fifo();
        known.upsert("ns/a", obj("ns", "a", "1"));
        f.replace(vec![], None);
        f.delete(obj("ns", "a", "5"));
        assert_eq!(pop_all(&f)[0].1, [(DeltaType::Deleted, "5".into(), false)]);
    }

    #[test]
    fn tombstones_are_found_gone_at_the_lists_version_and_it_counts_once_popped() {
        let (f, known) = fifo();
        known.upsert("ns/cached", obj("ns", "cached", "1"));
        f.add(obj("ns", "queued", "2"));
        f.delete(obj("ns", "seen", "3"));
        f.replace(vec![obj("ns", "kept", "4")], Some("9".into()));
        assert_eq!(
            f.with_lock_listed(|_, at| at.cloned()),
            None,
            "the list is not applied before its keys are popped"
        );
        let mut gone = HashMap::new();
        while let Some((key, deltas)) =
            f.try_pop(|deltas, _| (meta_namespace_key(&deltas[0].object), deltas))
        {
            let last = deltas.last().unwrap();
            gone.insert(key, (last.kind, last.gone_at.as_deref().map(str::to_owned)));
        }
        let tombstone = (DeltaType::Deleted, Some("9".to_owned()));
        assert_eq!(gone["ns/cached"], tombstone);
        assert_eq!(gone["ns/queued"], tombstone);
        assert_eq!(gone["ns/kept"], (DeltaType::Replaced, None));
        assert_eq!(
            f.with_lock_listed(|_, at| at.cloned()).as_deref(),
            Some("9")
        );
    }

    #[test]
    fn delete_of_unknown_key_is_ignored() {
        let (f, _) = fifo();
        f.delete(obj("ns", "ghost", "1"));
        assert!(f.is_empty());
    }

    #[test]
    fn replace_makes_deletions_for_known_and_queued_objects() {
        let (f, known) = fifo();
        known.upsert("ns/cached", obj("ns", "cached", "1"));
        known.upsert("ns/kept", obj("ns", "kept", "1"));
        f.add(obj("ns", "queued", "2"));
        f.update(obj("ns", "queued", "3"));
        f.replace(vec![obj("ns", "kept", "1")], None);
        let out = pop_all(&f);
        let by_key: HashMap<_, _> = out.into_iter().map(|(k, d, _)| (k, d)).collect();
        assert_eq!(
            by_key["ns/queued"].last().unwrap(),
            &(DeltaType::Deleted, "3".into(), true),
            "tombstone carries the newest queued object"
        );
        assert_eq!(
            by_key["ns/cached"],
            [(DeltaType::Deleted, "1".into(), true)]
        );
        assert_eq!(
            by_key["ns/kept"],
            [(DeltaType::Replaced, "1".into(), false)]
        );
    }

    #[test]
    fn replace_does_not_tombstone_a_queued_real_delete_twice() {
        let (f, known) = fifo();
        known.upsert("ns/a", obj("ns", "a", "1"));
        f.delete(obj("ns", "a", "2"));
        f.replace(vec![], None);
        assert_eq!(pop_all(&f)[0].1, [(DeltaType::Deleted, "2".into(), false)]);
    }

    #[test]
    fn resync_skips_keys_with_queued_deltas() {
        let (f, known) = fifo();
        known.upsert("ns/a", obj("ns", "a", "1"));
        known.upsert("ns/b", obj("ns", "b", "1"));
        f.update(obj("ns", "a", "2"));
        f.resync();
        let out = pop_all(&f);
        assert_eq!(out.len(), 2);
        let a = out.iter().find(|e| e.0 == "ns/a").unwrap();
        assert_eq!(
            a.1,
            [(DeltaType::Updated, "2".into(), false)],
            "no stale Sync behind an Update"
        );
        let b = out.iter().find(|e| e.0 == "ns/b").unwrap();
        assert_eq!(b.1, [(DeltaType::Sync, "1".into(), false)]);
    }

    #[test]
    fn resync_without_known_objects_does_nothing() {
        let (f, _) = fifo();
        f.resync();
        assert!(f.is_empty());
    }

    #[test]
    fn has_synced_counts_first_replace_including_deletions() {
        let (f, known) = fifo();
        known.upsert("ns/gone", obj("ns", "gone", "1"));
        assert!(!f.has_synced());
        f.replace(vec![obj("ns", "a", "1"), obj("ns", "b", "1")], None);
        assert!(!f.has_synced());
        let initial: Vec<bool> = pop_all(&f).into_iter().map(|e| e.2).collect();
        assert_eq!(
            initial,
            [true, true, true],
            "the synthetic delete counts as initial"
        );
        assert!(f.has_synced());
        f.replace(vec![obj("ns", "a", "2")], None);
        assert!(f.has_synced(), "later relists do not unsync");
    }

    #[test]
    fn a_listed_object_pops_before_its_list_ends_and_only_the_whole_list_syncs() {
        let (f, known) = fifo();
        known.upsert("ns/gone", obj("ns", "gone", "1"));
        f.begin_list(0);
        f.listed(obj("ns", "a", "5"));
        let first = pop_all(&f);
        assert_eq!(
            first,
            [(
                "ns/a".to_owned(),
                vec![(DeltaType::Replaced, "5".to_owned(), false)],
                true
            )]
        );
        assert!(!f.has_synced(), "the list is not whole yet");
        assert_eq!(f.replaces(), (0, 0));
        known.upsert("ns/a", obj("ns", "a", "5"));
        f.listed(obj("ns", "b", "6"));
        f.end_list(Some("9".into()));
        assert!(!f.has_synced(), "b and the deletion have not popped");
        let rest = pop_all(&f);
        assert_eq!(
            rest.iter()
                .map(|e| (e.0.as_str(), e.1[0].0, e.2))
                .collect::<Vec<_>>(),
            [
                ("ns/b", DeltaType::Replaced, true),
                ("ns/gone", DeltaType::Deleted, true)
            ],
            "only what the whole list lacks is deleted, not a's popped key"
        );
        assert!(f.has_synced());
        assert_eq!(f.replaces(), (1, 1));
    }

    #[test]
    fn a_list_that_starts_over_deletes_only_what_the_whole_one_lacks() {
        let (f, known) = fifo();
        known.upsert("ns/a", obj("ns", "a", "1"));
        known.upsert("ns/b", obj("ns", "b", "1"));
        known.upsert("ns/c", obj("ns", "c", "1"));
        f.begin_list(0);
        f.listed(obj("ns", "a", "2"));
        f.listed(obj("ns", "b", "1"));
        // The list fails (an expired continue token) and starts over: c was never listed by
        // the first, a is gone by the second.
        f.begin_list(0);
        f.listed(obj("ns", "b", "1"));
        f.listed(obj("ns", "c", "3"));
        f.end_list(Some("7".into()));
        let popped = pop_all(&f);
        let deleted: Vec<&str> = popped
            .iter()
            .filter(|e| e.1.iter().any(|d| d.0 == DeltaType::Deleted))
            .map(|e| e.0.as_str())
            .collect();
        assert_eq!(deleted, ["ns/a"], "{popped:?}");
    }

    #[test]
    fn empty_first_replace_is_synced_at_once() {
        let (f, _) = fifo();
        f.replace(vec![], None);
        assert!(f.has_synced());
    }

    #[tokio::test(start_paused = true)]
    async fn pop_waits_for_items_and_returns_none_when_closed() {
        let (f, _) = fifo();
        let f = Arc::new(f);
        let popper = tokio::spawn({
            let f = f.clone();
            async move { f.pop(|d, _| d.len()).await }
        });
        tokio::task::yield_now().await;
        f.add(obj("ns", "a", "1"));
        assert_eq!(popper.await.unwrap(), Some(1));
        let popper = tokio::spawn({
            let f = f.clone();
            async move { f.pop(|d, _| d.len()).await }
        });
        tokio::task::yield_now().await;
        f.close();
        assert_eq!(popper.await.unwrap(), None);
    }
}
