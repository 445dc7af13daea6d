//! client-go's `SharedIndexInformer`: one reflector, one FIFO, one cache, many listeners.
//!
//! # Contract
//! - Deltas are applied oldest first. Added, Updated, Replaced and Sync are upserts: a key
//!   already cached gives `Update(old, new)`, an unknown key `Add(new, is_initial_list)`;
//!   a key cached with another uid (recreated while the watch was down) gives
//!   `Delete(old, final_state_unknown)` then `Add(new)` (client-go: `Update(old, new)`);
//!   Deleted removes the key and gives `Delete(last, final_state_unknown)`.
//! - An update whose old and new resourceVersions are equal is a *resync* notification. It
//!   reaches only listeners whose resync is due (see [`ProcessorListener::is_syncing`]); every
//!   other notification reaches every listener.
//! - Distribution never blocks: listeners buffer.
//! - `has_synced` is true once the first list has been applied to the cache.
//! - A listener registered while the informer runs (a second resource sharing the informer of
//!   a kind that appeared later) starts switched off, and is switched on by
//!   [`SharedIndexInformer::activate_listeners`], which hands it the cache under the FIFO lock,
//!   as client-go's `AddEventHandler` does; it takes no part in the resync check period.
//! - Listeners switched on "after a relist" (a new leader's, which must not trust a cache
//!   whose watch may lag) are switched on at once and a fresh consistent list streams into
//!   them: each object of that list as an initial add as it pops (tagged by the relist
//!   request its list serves, see `Delta::list`), what the watch brings after the list as to
//!   any listener, nothing from before the list and none of the deletes it infers for keys
//!   they were not handed; their `on_synced` once the whole list has popped. Until then they
//!   do not count as on (`listeners_on_where`). The notification counters count what the
//!   informer distributes and hands from its cache, not what a stream passes on.

use std::{
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use prometheus::{IntCounter, IntGauge};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::{
    DeltaFifo, DeltaType, EventType, Indexer, Key, Notification, NotificationKind, ObjectRef,
    ProcessorListener, delta_fifo::Deltas, meta_namespace_key, reflector::Reflector,
    resource_version,
};

/// Gauges and counters one informer keeps.
#[derive(Clone)]
pub struct InformerMetrics {
    /// Objects in the cache.
    pub cached_objects: IntGauge,
    /// 1 once the first list is in the cache.
    pub synced: IntGauge,
    /// Notifications distributed, by type: `added`, `updated`, `deleted`, `synced`.
    pub notifications: [IntCounter; 4],
}

/// See the module docs for the contract.
pub struct SharedIndexInformer {
    name: String,
    indexer: Arc<Indexer>,
    fifo: Arc<DeltaFifo>,
    reflector: Reflector,
    listeners: RwLock<Vec<Arc<ProcessorListener>>>,
    started: AtomicBool,
    // Set by the first `spawn`: an informer shared by several resources runs once.
    spawned: AtomicBool,
    // Set when the kind stopped being served: a stop then deletes what the cache holds.
    gone: AtomicBool,
    // Set (under the FIFO lock) once listeners were told the first list is through.
    sync_signalled: AtomicBool,
    // Set when `run` ends.
    stopped: AtomicBool,
    // The running task and what stops it (set by `spawn`).
    task: std::sync::Mutex<Option<(CancellationToken, tokio::task::JoinHandle<()>)>>,
    // Listeners a relist streams into (see `activate_listeners_after_relist_since`); read and
    // changed only under the FIFO lock.
    streams: std::sync::Mutex<Vec<Stream>>,
    next_stream: std::sync::atomic::AtomicU64,
    metrics: InformerMetrics,
}

/// Listeners switched on while a fresh list streams into them: each object of that list
/// reaches them as an initial add as it pops, then what follows of its key as it does any
/// listener. What came before the list, and the deletes it infers, do not reach them (a
/// resume deletes what the list lacks).
struct Stream {
    id: u64,
    listeners: Vec<Arc<ProcessorListener>>,
    /// Deltas of lists serving this relist request or a later one, and the watch's after
    /// them, count (see [`super::delta_fifo::Delta::list`]).
    from: u64,
    /// The keys handed so far.
    handed: std::collections::HashSet<Key, crate::FastHash>,
    /// A list asked for ahead (a term's start, see
    /// [`SharedIndexInformer::request_relist`]), with no listeners yet: it keeps the keys it
    /// popped, so that listeners switched on later are handed their cached state and the
    /// rest streams in.
    early: bool,
}

impl Stream {
    fn holds(&self, l: &Arc<ProcessorListener>) -> bool {
        self.listeners.iter().any(|x| Arc::ptr_eq(x, l))
    }
}

impl std::fmt::Debug for SharedIndexInformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedIndexInformer")
            .field("name", &self.name)
            .finish()
    }
}

impl SharedIndexInformer {
    /// An informer named `name` whose reflector feeds `fifo`, which must be backed by `indexer`.
    pub(crate) fn new(
        name: String,
        indexer: Arc<Indexer>,
        fifo: Arc<DeltaFifo>,
        reflector: Reflector,
        metrics: InformerMetrics,
    ) -> Self {
        Self {
            name,
            indexer,
            fifo,
            reflector,
            listeners: RwLock::new(Vec::new()),
            started: AtomicBool::new(false),
            spawned: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            sync_signalled: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            task: std::sync::Mutex::new(None),
            streams: std::sync::Mutex::default(),
            next_stream: std::sync::atomic::AtomicU64::new(0),
            metrics,
        }
    }

    /// The informer's name: resource path, namespace and selectors.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cache.
    pub fn indexer(&self) -> &Arc<Indexer> {
        &self.indexer
    }

    /// Whether the first list has been applied to the cache.
    pub fn has_synced(&self) -> bool {
        self.fifo.has_synced()
    }

    /// resourceVersion of the newest state the reflector saw (its last list's, or a later
    /// watch event's object's).
    pub fn last_sync_resource_version(&self) -> String {
        self.reflector.last_sync_resource_version()
    }

    /// [`last_sync_resource_version`](Self::last_sync_resource_version), `None` before any:
    /// what an object found gone now is gone at.
    pub fn last_resource_version(&self) -> Option<Arc<str>> {
        Some(self.last_sync_resource_version())
            .filter(|rv| !rv.is_empty())
            .map(Arc::from)
    }

    /// How long ago its list+watch last heard from the API server (an event, a bookmark, a
    /// list page); `None` before the first.
    pub fn last_heard(&self) -> Option<std::time::Duration> {
        self.reflector.last_heard()
    }

    /// Registers a listener. Before `run` it receives everything from the first list on;
    /// once the informer runs it is registered switched off, under the FIFO lock, until
    /// [`activate_listeners`](Self::activate_listeners) hands it the cache.
    pub fn add_listener(&self, listener: Arc<ProcessorListener>) {
        self.fifo.with_lock(|_| {
            let mut listeners = self.listeners.write().unwrap_or_else(|e| e.into_inner());
            if self.started.load(Ordering::SeqCst) {
                listener.set_active(false);
            }
            listeners.push(listener);
        });
    }

    /// Whether `run` has begun.
    pub fn is_running(&self) -> bool {
        self.started.load(Ordering::SeqCst)
    }

    /// Whether [`spawn`](Self::spawn) started it (its task may not have begun `run` yet).
    pub fn is_spawned(&self) -> bool {
        self.spawned.load(Ordering::SeqCst)
    }

    fn listeners(&self) -> Vec<Arc<ProcessorListener>> {
        self.listeners
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Lists, watches and distributes until `cancel` fires; then drains the FIFO into the
    /// listeners. What the listeners' handlers hold is theirs to deliver.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        self.started.store(true, Ordering::SeqCst);
        let listeners = self.listeners();
        let process = tokio::spawn({
            let this = self.clone();
            async move {
                while this
                    .fifo
                    .pop(|deltas, initial| this.handle_deltas(deltas, initial))
                    .await
                    .is_some()
                {
                    this.metrics.cached_objects.set(this.indexer.len() as i64);
                    this.metrics.synced.set(this.has_synced() as i64);
                }
            }
        });
        let resync = resync_check_period(&listeners).map(|period| {
            let this = self.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval_at(tokio::time::Instant::now() + period, period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        now = tick.tick() => this.resync_tick(now),
                    }
                }
            })
        });
        // Tells the listeners once the first list has gone through the FIFO (an empty list
        // syncs without any pop, so this watches rather than hooking into `pop`).
        let sync_signal = {
            let this = self.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                loop {
                    let signalled = this.fifo.with_lock_listed(|synced, listed_at| {
                        if synced {
                            this.signal_first_sync(listed_at.map(|rv| &**rv), &[]);
                        }
                        synced
                    });
                    if signalled {
                        return;
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                    }
                }
            })
        };
        self.reflector.run(cancel.clone()).await;
        sync_signal.abort();
        if self.gone.load(Ordering::SeqCst) {
            // The kind is no longer served (its CRD was deleted): what the watch has not
            // deleted yet is deleted now, as a relist that found nothing would, found gone at
            // the newest version the watch brought.
            self.fifo.replace(Vec::new(), self.last_resource_version());
        }
        // The reflector has stopped: let the FIFO drain into the listeners.
        self.fifo.close();
        let _ = process.await;
        if let Some(r) = resync {
            let _ = r.await;
        }
        self.stopped.store(true, Ordering::SeqCst);
        debug!(informer = %self.name, "Informer stopped");
    }

    /// Runs the informer in a task, until [`stop`](Self::stop) or `parent` fires, unless an
    /// earlier call already did (several resources of the config may share one informer).
    /// Returns whether this call started it.
    pub fn spawn(self: &Arc<Self>, parent: &CancellationToken) -> bool {
        if self
            .spawned
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return false;
        }
        let cancel = parent.child_token();
        let task = tokio::spawn(self.clone().run(cancel.clone()));
        *self.task.lock().unwrap_or_else(|e| e.into_inner()) = Some((cancel, task));
        true
    }

    /// Stops the informer (if it runs) and waits until its FIFO has drained into the
    /// listeners. Also what waits for an informer whose `parent` token fired.
    pub async fn stop(&self) {
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((cancel, task)) = task {
            cancel.cancel();
            let _ = task.await;
        }
    }

    /// Removes the listeners `which` selects: they get nothing more from this informer (the
    /// informer runs on for the others). Returns what the cache holds at that moment: the
    /// state every one of them that was on has been handed (one a list was still streaming
    /// into does not count as on: see `listeners_on_where`).
    pub fn remove_listeners_where(
        &self,
        which: impl Fn(&ProcessorListener) -> bool,
    ) -> Vec<ObjectRef> {
        self.fifo.with_lock(|_| {
            self.listeners
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|l| !which(l));
            let mut streams = self.streams();
            streams
                .iter_mut()
                .for_each(|s| s.listeners.retain(|l| !which(l)));
            streams.retain(|s| s.early || !s.listeners.is_empty());
            self.indexer.list()
        })
    }

    /// Whether every listener `which` selects is on.
    /// One that a list still streams into is not on yet: it has not been handed the whole
    /// state.
    pub fn listeners_on_where(&self, which: impl Fn(&ProcessorListener) -> bool) -> bool {
        let streams = self.streams();
        self.listeners()
            .iter()
            .filter(|l| which(l))
            .all(|l| l.is_active() && !streams.iter().any(|s| s.holds(l)))
    }

    /// Once, under the FIFO lock, when the first list has popped entirely: tells every
    /// listener on but those a list streams into (told when theirs is through) and `except`.
    fn signal_first_sync(&self, listed_at: Option<&str>, except: &[Arc<ProcessorListener>]) {
        if self.sync_signalled.swap(true, Ordering::SeqCst) {
            return;
        }
        let streams = self.streams();
        self.listeners()
            .iter()
            .filter(|l| !streams.iter().any(|s| s.holds(l)))
            .filter(|l| !except.iter().any(|x| Arc::ptr_eq(x, l)))
            .for_each(|l| l.synced(listed_at));
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, Vec<Stream>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switches the listeners `which` selects that are off on, handing them what changed
    /// between `base` (the state they were handed elsewhere: the informer of another version
    /// of the kind they followed until now) and this informer's cache, under the FIFO lock
    /// (each change exactly once, as [`activate_listeners`](Self::activate_listeners)):
    /// objects not in `base` are added, those at another resourceVersion updated (from the
    /// `base` object), those of another uid deleted and added, and those of `base` not cached
    /// deleted (final state unknown). Returns how many notifications each got.
    pub fn activate_listeners_against(
        &self,
        base: Vec<ObjectRef>,
        which: impl Fn(&ProcessorListener) -> bool,
    ) -> usize {
        self.fifo.with_lock_listed(|_, listed_at| {
            let switched_on = self.switch_on(&which);
            if switched_on.is_empty() {
                return 0;
            }
            let mut base: std::collections::HashMap<String, ObjectRef> = base
                .into_iter()
                .map(|o| (meta_namespace_key(&o), o))
                .collect();
            let mut changes = Vec::new();
            let mut cached = self.indexer.list();
            cached.sort_by_key(meta_namespace_key);
            for obj in cached {
                let key = meta_namespace_key(&obj);
                match base.remove(&key) {
                    Some(old) if old.uid() != obj.uid() => {
                        // Gone at the version its successor is at.
                        let at = Some(resource_version(&obj).into());
                        changes.push((
                            NotificationKind::Delete {
                                obj: old,
                                final_state_unknown: true,
                            },
                            at,
                        ));
                        changes.push((
                            NotificationKind::Add {
                                obj,
                                is_initial_list: false,
                            },
                            None,
                        ));
                    }
                    Some(old) if resource_version(&old) == resource_version(&obj) => {}
                    Some(old) => changes.push((NotificationKind::Update { old, new: obj }, None)),
                    None => changes.push((
                        NotificationKind::Add {
                            obj,
                            is_initial_list: false,
                        },
                        None,
                    )),
                }
            }
            let mut gone: Vec<_> = base.into_iter().collect();
            gone.sort_by(|a, b| a.0.cmp(&b.0));
            // Gone at the newer of this informer's list and the state the listeners were
            // handed (the other informer may have seen, and they published, a version past
            // that list; what comes next of the key is past both).
            changes.extend(gone.into_iter().map(|(_, obj)| {
                let at = super::newest_resource_version(
                    listed_at
                        .cloned()
                        .into_iter()
                        .chain([Arc::from(resource_version(&obj))]),
                );
                (
                    NotificationKind::Delete {
                        obj,
                        final_state_unknown: true,
                    },
                    at,
                )
            }));
            let count = changes.len();
            self.hand(&switched_on, changes);
            count
        })
    }

    /// Marks the kind as no longer served: when the informer is stopped, every object still
    /// cached is delivered as deleted (final state unknown) before the FIFO drains.
    pub fn mark_gone(&self) {
        self.gone.store(true, Ordering::SeqCst);
    }

    /// Why the last list or watch failed, until one succeeds again (a refusal names the
    /// verb and resource).
    pub fn problem(&self) -> Option<String> {
        self.reflector.problem()
    }

    /// Switches every listener off: they drop what the informer distributes until
    /// [`activate_listeners`](Self::activate_listeners). A standby replica's listeners are off.
    pub fn deactivate_listeners(&self) {
        self.fifo.with_lock(|_| {
            for l in self.listeners() {
                l.set_active(false);
            }
            self.streams().retain(|s| s.early);
        });
    }

    /// Switches every listener that is off back on and sends it each cached object as an
    /// initial add, as client-go does for a handler added to a running informer. It runs
    /// under the FIFO lock (client-go's `blockDeltas`), so each object reaches the listener
    /// exactly once: either it is cached now and comes from here, or it is still in the FIFO
    /// (the first list not yet processed, or a change) and comes from there afterwards.
    /// Listeners already on get nothing. Returns how many objects were sent to each listener
    /// switched on (0 when none was off).
    pub fn activate_listeners(&self) -> usize {
        self.activate_listeners_where(|_| true)
    }

    /// [`activate_listeners`](Self::activate_listeners) for the listeners `which` selects.
    pub fn activate_listeners_where(&self, which: impl Fn(&ProcessorListener) -> bool) -> usize {
        self.activate_listeners_if(|| true, which).unwrap_or(0)
    }

    /// [`activate_listeners`](Self::activate_listeners) after a fresh list: asks the reflector
    /// for a new consistent list and streams it into the listeners, so that they get the API
    /// server's state as of now, not a cache whose watch may lag or be stalled (a new leader
    /// compares its checkpoints with this). They are switched on at once; each object of that
    /// list reaches them as an initial add as it pops (the first pages while the last are
    /// fetched), what the watch brings after the list as to any listener, and nothing from
    /// before the list, nor the deletes the list infers (a key they were not handed). Their
    /// `on_synced` comes once the whole list has popped. On an informer not running yet, its
    /// first list is that list. `None`, with the listeners switched off again, once `cancel`
    /// fires (checked under the FIFO lock, so a caller that cancels and then deactivates never
    /// finds listeners switched on after it) or the informer stops. Only listeners that are
    /// off and `which` selects are switched on. Returns how many objects the list handed them.
    pub async fn activate_listeners_after_relist(
        &self,
        cancel: &CancellationToken,
        which: impl Fn(&ProcessorListener) -> bool,
    ) -> Option<usize> {
        self.activate_listeners_after_relist_since(cancel, which, None)
            .await
    }

    /// Asks the reflector for a new consistent list now: its number, for
    /// [`activate_listeners_after_relist_since`](Self::activate_listeners_after_relist_since).
    /// A running informer drops a list in progress and starts over; one not running yet
    /// serves the request with its first list (a cold standby's informers are spawned as its
    /// term begins: asking their first list for the term instead of a second one keeps a
    /// shard from listing twice). What that list pops is noted (replacing an earlier such
    /// note), so that listeners switched on while it runs get what it popped from the cache
    /// and the rest as it pops.
    pub fn request_relist(&self) -> u64 {
        let id = self.next_stream.fetch_add(1, Ordering::SeqCst);
        self.fifo.with_lock(|_| {
            let from = self.reflector.request_relist();
            let mut streams = self.streams();
            streams.retain(|s| !s.early);
            streams.push(Stream {
                id,
                listeners: Vec::new(),
                from,
                handed: std::collections::HashSet::default(),
                early: true,
            });
            from
        })
    }

    /// Forgets what [`request_relist`](Self::request_relist) noted (the term it was asked
    /// for ended before it was used).
    pub fn forget_relist_requests(&self) {
        self.fifo.with_lock(|_| self.streams().retain(|s| !s.early));
    }

    /// [`activate_listeners_after_relist`](Self::activate_listeners_after_relist), or, when the
    /// list `request` (of [`request_relist`](Self::request_relist)) asked for earlier (a
    /// term's start) is in the cache already, the cache handed at once as
    /// [`activate_listeners`](Self::activate_listeners) does. When that list still runs, it
    /// streams into them: what it popped so far is handed from the cache (each key's state
    /// now, the watch's changes since included), the rest as it pops. Without `request`, or
    /// when `request` was not the informer's last, a new list is asked for.
    pub async fn activate_listeners_after_relist_since(
        &self,
        cancel: &CancellationToken,
        which: impl Fn(&ProcessorListener) -> bool,
        request: Option<u64>,
    ) -> Option<usize> {
        if let Some(request) = request
            && self.is_running()
        {
            let (served, generation) = self.reflector.served();
            if served >= request && self.fifo.replaces().1 >= generation {
                let wanted = || {
                    if cancel.is_cancelled() {
                        return false;
                    }
                    // Its note is not needed now (a later term's is kept).
                    self.streams().retain(|s| !(s.early && s.from <= request));
                    true
                };
                return self.activate_listeners_if(wanted, which);
            }
        }
        let mut id = self.next_stream.fetch_add(1, Ordering::SeqCst);
        // The request is made under the FIFO lock: nothing of its list can pop before the
        // stream is in place.
        let from = self.fifo.with_lock(|_| {
            if cancel.is_cancelled() {
                return None;
            }
            let listeners = self.switch_on(&which);
            let mut streams = self.streams();
            if listeners.is_empty() {
                // None to hand it to: no note is kept for later.
                streams.retain(|s| !(s.early && Some(s.from) == request));
                return Some(None);
            }
            let early = streams
                .iter()
                .position(|s| s.early && Some(s.from) == request);
            if let Some(at) = early {
                // That list runs: what it popped already is handed from the cache (newer
                // there if the watch changed it since), the rest streams in.
                let stream = &mut streams[at];
                stream.early = false;
                stream.listeners = listeners.clone();
                id = stream.id;
                // Deleted since: the resume deletes what it lacks; what comes of the key
                // later comes from the watch.
                let mut cached: Vec<ObjectRef> = Vec::with_capacity(stream.handed.len());
                stream.handed.retain(|k| match self.indexer.get(k) {
                    Some(obj) => {
                        cached.push(obj);
                        true
                    }
                    None => false,
                });
                let from = stream.from;
                drop(streams);
                cached.sort_by_cached_key(meta_namespace_key);
                self.hand_initial(&listeners, cached);
                return Some(Some(from));
            }
            streams.retain(|s| !s.early);
            drop(streams);
            let from = if self.is_running() {
                self.reflector.request_relist()
            } else {
                0
            };
            self.streams().push(Stream {
                id,
                listeners,
                from,
                handed: std::collections::HashSet::default(),
                early: false,
            });
            Some(Some(from))
        })?;
        let Some(from) = from else { return Some(0) };
        let through = loop {
            if cancel.is_cancelled() || self.stopped.load(Ordering::SeqCst) {
                break false;
            }
            let (served, generation) = self.reflector.served();
            if generation > 0 && served >= from && self.fifo.replaces().1 >= generation {
                break true;
            }
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        };
        self.fifo.with_lock_listed(|_, listed_at| {
            let mut streams = self.streams();
            // Gone already when the listeners were switched off meanwhile.
            let at = streams.iter().position(|s| s.id == id)?;
            let stream = streams.swap_remove(at);
            drop(streams);
            if !through || cancel.is_cancelled() {
                stream.listeners.iter().for_each(|l| {
                    l.set_active(false);
                });
                return None;
            }
            let listed_at = listed_at.map(|rv| &**rv);
            // Their list may be the informer's first: the others are told first, once.
            self.signal_first_sync(listed_at, &stream.listeners);
            stream.listeners.iter().for_each(|l| l.synced(listed_at));
            Some(stream.handed.len())
        })
    }

    /// Switches the listeners `which` selects off (see
    /// [`deactivate_listeners`](Self::deactivate_listeners)).
    pub fn deactivate_listeners_where(&self, which: impl Fn(&ProcessorListener) -> bool) {
        self.fifo.with_lock(|_| {
            for l in self.listeners().iter().filter(|l| which(l)) {
                l.set_active(false);
            }
            let mut streams = self.streams();
            streams
                .iter_mut()
                .for_each(|s| s.listeners.retain(|l| !which(l)));
            streams.retain(|s| s.early || !s.listeners.is_empty());
        });
    }

    /// Switches the listeners `which` selects on as `activate_listeners` does if `wanted()`,
    /// asked under the FIFO lock, holds.
    fn activate_listeners_if(
        &self,
        wanted: impl FnOnce() -> bool,
        which: impl Fn(&ProcessorListener) -> bool,
    ) -> Option<usize> {
        self.fifo.with_lock_listed(|_, listed_at| {
            if !wanted() {
                return None;
            }
            let switched_on = self.switch_on(&which);
            if switched_on.is_empty() {
                return Some(0);
            }
            let cached = self.indexer.list();
            let count = cached.len();
            self.hand_initial(&switched_on, cached);
            // Once the first list is through, the cache is the whole initial state; before
            // that, the sync signal comes when it is (see `run`).
            if self.sync_signalled.load(Ordering::SeqCst) {
                let listed_at = listed_at.map(|rv| &**rv);
                switched_on.iter().for_each(|l| l.synced(listed_at));
            }
            Some(count)
        })
    }

    /// Switches the listeners `which` selects that are off on (under the FIFO lock): those.
    fn switch_on(&self, which: impl Fn(&ProcessorListener) -> bool) -> Vec<Arc<ProcessorListener>> {
        self.listeners()
            .into_iter()
            .filter(|l| which(l) && !l.set_active(true))
            .collect()
    }

    /// Hands `objects` to `listeners` as initial adds (see [`hand`](Self::hand)).
    fn hand_initial(&self, listeners: &[Arc<ProcessorListener>], objects: Vec<ObjectRef>) {
        let adds = objects.into_iter().map(|obj| {
            let add = NotificationKind::Add {
                obj,
                is_initial_list: true,
            };
            (add, None)
        });
        self.hand(listeners, adds);
    }

    /// Hands `kinds` (built under the FIFO lock; deletes with the version they were found gone
    /// at) to `listeners` only, as notifications of now.
    fn hand(
        &self,
        listeners: &[Arc<ProcessorListener>],
        kinds: impl IntoIterator<Item = (NotificationKind, Option<Arc<str>>)>,
    ) {
        let (received, observed) = (std::time::Instant::now(), jiff::Timestamp::now());
        for (kind, gone_at) in kinds {
            let n = Notification::at(kind, received, observed).found_gone_at(gone_at);
            self.metrics.notifications[n.event_type() as usize].inc();
            for l in listeners {
                l.add(n.clone());
            }
        }
    }

    fn resync_tick(&self, now: tokio::time::Instant) {
        // Every listener must be asked (no short-circuit): asking moves its next resync.
        let due = self
            .listeners()
            .iter()
            .fold(false, |any, l| l.should_resync(now) | any);
        if due && self.has_synced() {
            self.fifo.resync();
        }
    }

    /// client-go's `HandleDeltas` (`processDeltas`): apply to the cache, then distribute.
    fn handle_deltas(&self, deltas: Deltas, is_initial_list: bool) {
        let mut streams = self.streams();
        for delta in deltas {
            let key: Key = meta_namespace_key(&delta.object).into();
            let (tag, delta_type, inferred) = (delta.list, delta.kind, delta.final_state_unknown);
            let (received, observed) = (delta.received, delta.observed);
            let listed = (delta_type == DeltaType::Replaced && !streams.is_empty())
                .then(|| delta.object.clone());
            let mut gone = None;
            let kind = match delta.kind {
                DeltaType::Added | DeltaType::Updated | DeltaType::Replaced | DeltaType::Sync => {
                    match self.indexer.upsert(&key, delta.object.clone()) {
                        // Another incarnation under the same key (deleted and recreated while
                        // the watch was down, found by a relist): client-go reports an update;
                        // here the old one is deleted and the new one added, as a resume does,
                        // so that consumers keyed by uid see every incarnation end.
                        Some(old) if old.uid() != delta.object.uid() => {
                            let kind = NotificationKind::Delete {
                                obj: old,
                                final_state_unknown: true,
                            };
                            // Gone at the version its successor is at (found by the same
                            // list), so that its add does not go back behind the delete.
                            let at = resource_version(&delta.object).into();
                            gone = Some(
                                Notification::keyed(kind, key.clone(), received, observed)
                                    .found_gone_at(Some(at)),
                            );
                            NotificationKind::Add {
                                obj: delta.object,
                                is_initial_list,
                            }
                        }
                        Some(old) => NotificationKind::Update {
                            old,
                            new: delta.object,
                        },
                        None => NotificationKind::Add {
                            obj: delta.object,
                            is_initial_list,
                        },
                    }
                }
                DeltaType::Deleted => {
                    self.indexer.delete(&key);
                    NotificationKind::Delete {
                        obj: delta.object,
                        final_state_unknown: delta.final_state_unknown,
                    }
                }
            };
            let n = Notification::keyed(kind, key.clone(), received, observed)
                .found_gone_at(delta.gone_at);
            if streams.is_empty() {
                if let Some(gone) = gone {
                    self.distribute(gone, &[]);
                }
                self.distribute(n, &[]);
                continue;
            }
            for stream in streams.iter_mut() {
                if stream.early && delta_type == DeltaType::Deleted {
                    // No listener yet: a key gone is not handed when they come (what comes
                    // of it later is a change or a listed object again).
                    stream.handed.remove(&key);
                    continue;
                }
                let handed = stream.handed.contains(&key);
                let current = tag >= stream.from;
                let watched = match delta_type {
                    DeltaType::Added | DeltaType::Updated => true,
                    DeltaType::Deleted => !inferred,
                    DeltaType::Replaced | DeltaType::Sync => false,
                };
                if handed || (current && watched) {
                    // Handed earlier, or a change the watch brought after the list.
                    if !handed {
                        stream.handed.insert(key.clone());
                    }
                    if let Some(gone) = &gone {
                        self.deliver(&stream.listeners, gone);
                    }
                    self.deliver(&stream.listeners, &n);
                } else if let Some(obj) = listed.clone().filter(|_| current) {
                    stream.handed.insert(key.clone());
                    let add = NotificationKind::Add {
                        obj,
                        is_initial_list: true,
                    };
                    let add = Notification::keyed(add, key.clone(), received, observed);
                    self.deliver(&stream.listeners, &add);
                }
                // Else from before the list, or a delete it inferred of a key it lacks
                // (what a resume deletes itself): not theirs.
            }
            if let Some(gone) = gone {
                self.distribute(gone, &streams);
            }
            self.distribute(n, &streams);
        }
    }

    /// Hands `n` to every listener but those `streams` hold.
    fn distribute(&self, n: Notification, streams: &[Stream]) {
        self.metrics.notifications[n.event_type() as usize].inc();
        let listeners = self.listeners.read().unwrap_or_else(|e| e.into_inner());
        if streams.iter().all(|s| s.listeners.is_empty()) {
            self.deliver(&listeners, &n);
        } else {
            let rest: Vec<_> = listeners
                .iter()
                .filter(|l| !streams.iter().any(|s| s.holds(l)))
                .cloned()
                .collect();
            self.deliver(&rest, &n);
        }
    }

    /// Hands `n` to `listeners`; a resync only to those whose resync is due.
    fn deliver(&self, listeners: &[Arc<ProcessorListener>], n: &Notification) {
        let is_sync = n.event_type() == EventType::Synced;
        for l in listeners {
            if !is_sync || l.is_syncing() {
                l.add(n.clone());
            }
        }
    }
}

/// client-go's `resyncCheckPeriod`: the shortest listener period, at least 1 s; `None` when no
/// listener resyncs.
fn resync_check_period(listeners: &[Arc<ProcessorListener>]) -> Option<Duration> {
    listeners
        .iter()
        .filter_map(|l| l.resync_period())
        .min()
        .map(|p| p.max(Duration::from_secs(1)))
}
