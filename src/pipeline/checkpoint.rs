//! The checkpointer: records what each route's sink has acknowledged, per object key, and
//! writes it to the sink's checkpoint store ([`crate::sinks::checkpoint`]) in batches, so
//! that a restart or a new leader resumes from it (see [`super::resume`]).
//!
//! # Contract
//! - An entry is `key → (uid, resourceVersion)` of the newest notification of that object the
//!   sink settled (accepted, or failed for good and dead-lettered: re-sending it at every
//!   restart would not help); an acknowledged delete removes the key. So the checkpoint never
//!   claims more than was delivered.
//! - [`Checkpointer::record`] runs after the acknowledgement and only remembers the change;
//!   a background task writes the changes in batches every `interval`. Memory is bounded by
//!   the number of keys changed since the last write (`keb_checkpoint_lag`), and so is what a
//!   crash can cost: those notifications are re-sent after the restart, with the same ids.
//! - A failed write is counted, logged, and retried with the next batch; a change recorded
//!   meanwhile for the same key wins.
//! - At shutdown, once the queues have drained, [`Checkpointer::flush`] writes what is left.
//! - **What a consumer may have received, the next resume knows.** A message can reach
//!   consumers as soon as the broker stores it, before its acknowledgement (and so before the
//!   next write). So before the first message of a key the store does not hold is handed
//!   over, [`Checkpointer::intend`] writes the key as an *intent* (its uid and
//!   resourceVersion, `pending`): a restart or new leader that finds it gone publishes its
//!   delete, and one that finds it listed publishes it again (`updated`, even at the same
//!   resourceVersion), whether or not the add was ever acknowledged. Intents are written in
//!   batches by one task per route (started with the first intent), each batch with every
//!   intent recorded until it is taken; a waiter wakes once, when its batch is written (or
//!   its term ends), so a first sync of many new keys costs one wake-up per key, not a turn
//!   at a lock. A key the store holds (loaded at the resume, then kept up to date by the
//!   writes) waits for nothing.
//! - **An intent batch holds the new keys only** (unless 1,024 or more changes are
//!   pending, as in a first sync: then it takes them all): their intents, or whatever newer
//!   change of theirs was recorded meanwhile. The acknowledgements of keys the store holds
//!   wait for the periodic write, so that under a steady stream of creates the store is not
//!   written once per create with everything acknowledged since (each key's entry is its
//!   own: writing one key before another changes nothing a resume reads). A write that fails
//!   puts back what it took, and the new keys among it, so the next intent batch takes those
//!   again.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus::{IntCounter, IntGauge};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

pub use crate::sinks::checkpoint::{
    CLUSTER_KEY, Change, Checkpoint, CheckpointStore, Entry, Error, Result, RouteKind,
};
use crate::{
    FastHash,
    informer::{Notification, NotificationKind, ObjectRef, resource_version},
};

/// Records one route's acknowledgements and writes them to its store. See the module docs.
pub struct Checkpointer {
    route: String,
    store: Arc<dyn CheckpointStore>,
    pending: Mutex<Pending>,
    // The cluster identity still to write (see `CLUSTER_KEY`).
    cluster: Mutex<Option<String>>,
    // The kind the route publishes, written with the identity (see `RouteKind`).
    kind: Mutex<Option<RouteKind>>,
    // The cluster identity last recorded (written again with a changed kind).
    known_cluster: Mutex<Option<String>>,
    // Serializes writes, so that an older batch never lands after a newer one.
    writing: tokio::sync::Mutex<()>,
    // Wakes the intent writer (see `write_intents`), started with the first intent.
    intents: Arc<tokio::sync::Notify>,
    writer: std::sync::Once,
    lag: IntGauge,
    failures: IntCounter,
    // With leader election: records while the lease is held, writes while it is valid.
    fence: Option<crate::leader::Fence>,
    // The sink writes the checkpoint records in its transactions (see `in_transactions`).
    transactional: bool,
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // Its intent writer ends.
        self.intents.notify_one();
    }
}

/// What is not written yet, and which keys the store holds.
#[derive(Default)]
struct Pending {
    // Per key, the change to write. Holding the shared object rather than its uid and
    // resourceVersion keeps the acknowledgement path free of allocations for keys already
    // pending.
    changed: HashMap<String, KeyChange, FastHash>,
    // Hashes of the keys the store holds and will still hold once `changed` is written (a
    // recorded delete removes its key at once): the keys whose messages need no intent.
    known: HashSet<u64, FastHash>,
    // Batches taken for writing so far: a change recorded now goes with batch `taken + 1`.
    taken: u64,
    // Leadership terms ended so far (see `Checkpointer::end_term`): a write taken in an
    // earlier one puts nothing back.
    term: u64,
    // Intent waiters by the batch that writes their intent: released once it is durable.
    waiting: std::collections::BTreeMap<u64, CancellationToken>,
    // The keys an intent batch takes (see `Scope::NewKeys`): each key whose intent waits,
    // pushed with its waiter (perhaps more than once; cleared by every take), and those a
    // failed write took from here and put back.
    new_keys: Vec<String>,
}

/// An intent batch takes every pending change once this many are pending: under a steady
/// stream the acknowledgements of known keys wait for the periodic write, but a first sync of
/// many new keys (or any burst of over a thousand keys a second) would otherwise pile up a
/// second of them (measured: 10 MiB more at the peak
/// of a 50,000-object sync into Kafka).
const WRITE_ALL_AT: usize = 1024;

/// What a write takes from [`Pending`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Scope {
    /// Every change recorded (the periodic write, the last one at shutdown).
    All,
    /// The changes of the keys in `Pending::new_keys` (the intent writer's batches), or every
    /// change once [`WRITE_ALL_AT`] are pending.
    NewKeys,
}

/// What a write took from [`Pending`]: put back when dropped unless written (a change of the
/// same key recorded meanwhile wins).
struct Taken<'a> {
    checkpointer: &'a Checkpointer,
    changed: Option<HashMap<String, KeyChange, FastHash>>,
    cluster: Option<String>,
    term: u64,
    // `Pending::new_keys` as taken: put back with the changes, for the next intent batch.
    new_keys: Vec<String>,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let c = self.checkpointer;
        let cluster = self.cluster.take();
        let changed = self.changed.take().filter(|t| !t.is_empty());
        if cluster.is_none() && changed.is_none() {
            return;
        }
        // Held while the identity goes back: a term's end (which clears it) comes before or
        // after, never between the check and the put-back.
        let mut p = c.lock();
        if p.term != self.term {
            // Its term ended meanwhile: dropped with the rest of that term's changes, the
            // identity too (the next term's resume records it again once its checkpoint is
            // this cluster's).
            return;
        }
        if let Some(uid) = cluster {
            c.cluster
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(uid);
        }
        if let Some(taken) = changed {
            for (key, change) in taken {
                p.changed.entry(key).or_insert(change);
            }
            // Their intents' waiters still wait: the next intent batch takes them again. (Only
            // within a write that took changes: every key in `new_keys` has one pending.)
            p.new_keys.append(&mut self.new_keys);
            c.lag.set(p.changed.len() as i64);
        }
    }
}

/// One key's change to write.
#[derive(Clone)]
enum KeyChange {
    /// The newest settled object.
    Settled(ObjectRef),
    /// About to be handed over, not acknowledged yet (see [`Checkpointer::intend`]).
    Intent(ObjectRef),
    /// Deleted.
    Deleted,
}

/// The hash `Pending::known` holds of `key`: foldhash's quality variant seeded once per process
/// (the same key hashes the same for the life of the process; a collision would skip a key's
/// intent, so not the `fast` variant with a fixed seed).
fn key_hash(key: &str) -> u64 {
    use std::hash::BuildHasher;
    static STATE: std::sync::LazyLock<foldhash::quality::RandomState> =
        std::sync::LazyLock::new(foldhash::quality::RandomState::default);
    STATE.hash_one(key)
}

impl Checkpointer {
    /// A checkpointer of `route` into `store`.
    pub fn new(
        route: String,
        store: Arc<dyn CheckpointStore>,
        lag: IntGauge,
        failures: IntCounter,
    ) -> Self {
        Self {
            route,
            store,
            pending: Mutex::default(),
            cluster: Mutex::default(),
            kind: Mutex::default(),
            known_cluster: Mutex::default(),
            writing: tokio::sync::Mutex::new(()),
            intents: Arc::default(),
            writer: std::sync::Once::new(),
            lag,
            failures,
            fence: None,
            transactional: false,
        }
    }

    /// The route's sink writes the checkpoint records itself, each in the transaction of the
    /// message it is about ([`crate::sinks::Sink::in_transactions`]): this checkpointer
    /// records nothing (a record written after the acknowledgement could land after a newer
    /// message's own) and asks for no intents (a reader sees a message and its record
    /// together); it still writes the cluster's identity, through the sink.
    pub fn in_transactions(mut self, transactional: bool) -> Self {
        self.transactional = transactional;
        self
    }

    /// Whether the sink writes the records (see [`Self::in_transactions`]).
    pub fn is_transactional(&self) -> bool {
        self.transactional
    }

    /// The change of the checkpoint that settling `n` (about the object at `key`) makes.
    pub fn change_of(key: &str, n: &Notification) -> Change {
        let entry = match n.kind() {
            NotificationKind::Delete { .. } => None,
            NotificationKind::Add { obj, .. } | NotificationKind::Update { new: obj, .. } => {
                Some(Entry {
                    uid: obj.uid().unwrap_or_default().to_owned(),
                    resource_version: resource_version(obj).to_owned(),
                    pending: false,
                    kind: None,
                })
            }
        };
        (key.to_owned(), entry)
    }

    /// With leader election: records acknowledgements only while the lease is held, so that
    /// a deposed leader's late acknowledgements never reach the store (see
    /// [`Self::end_term`]), and writes only while `fence` is valid. A lapsed cap (sharded: the
    /// group's hold unconfirmed for a moment) holds writes back but drops no acknowledgement:
    /// what was published before it is acknowledged during it, and a hand-over's last write
    /// must hold it, or the next owner sends it again.
    pub fn with_fence(mut self, fence: Option<crate::leader::Fence>) -> Self {
        self.fence = fence;
        self
    }

    fn fenced(&self) -> bool {
        self.fence.as_ref().is_some_and(|f| !f.is_valid())
    }

    /// Whether the lease is not held (lost, or not taken yet): acknowledgements are not
    /// recorded then.
    fn deposed(&self) -> bool {
        self.fence.as_ref().is_some_and(|f| !f.is_held())
    }

    /// Whether its fence is not valid (with leader election: the lease lapsed, or a sharded
    /// replica's cap did): it writes nothing then.
    pub fn is_fenced(&self) -> bool {
        self.fenced()
    }

    /// A leadership term ended: what it recorded and did not write is dropped, never written
    /// in a later term (the store would go back behind what a newer leader wrote). That costs
    /// duplicates only: an unwritten acknowledgement makes the next resume send its object
    /// again, an unwritten delete makes it send the delete again, and an unwritten intent was
    /// never handed over (hand-overs wait for their intent's write).
    pub fn end_term(&self) {
        let mut p = self.lock();
        p.changed.clear();
        p.new_keys.clear();
        p.term += 1;
        self.lag.set(0);
        // Their intents are dropped: what waits for them goes on, to find its term ended.
        let waiting = std::mem::take(&mut p.waiting);
        drop(p);
        waiting.values().for_each(CancellationToken::cancel);
        // The next term's resume records the identity again, once its checkpoint is this
        // cluster's: a kind described meanwhile must not write it first.
        *self.cluster.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.known_cluster.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The route's name.
    pub fn route(&self) -> &str {
        &self.route
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn CheckpointStore> {
        &self.store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds off this checkpointer's writes while the guard lives: a checkpoint read under it
    /// and passed to [`Self::knows`] is what the store holds (a write landing in between would
    /// leave a deleted key known).
    pub async fn hold_writes(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.writing.lock().await
    }

    /// The store holds `checkpoint` (just loaded under [`Self::hold_writes`]; `None`: nothing):
    /// its keys need no intent.
    pub fn knows(&self, checkpoint: Option<&Checkpoint>) {
        let mut p = self.lock();
        p.known = checkpoint
            .into_iter()
            .flat_map(|c| c.keys())
            .filter(|k| *k != CLUSTER_KEY)
            .map(|k| key_hash(k))
            .collect();
        // What is pending and deleted is not known any more.
        let Pending { changed, known, .. } = &mut *p;
        for (k, change) in changed.iter() {
            if matches!(change, KeyChange::Deleted) {
                known.remove(&key_hash(k));
            }
        }
    }

    /// Before a message about `obj` (at `key`) is handed over: `None` when the store holds
    /// the key already; else the key is recorded as an intent, and the future resolves once
    /// it is written (see the module docs).
    pub fn intend(
        self: &Arc<Self>,
        key: &str,
        obj: &ObjectRef,
    ) -> Option<futures::future::BoxFuture<'static, ()>> {
        if self.transactional {
            return None;
        }
        let hash = key_hash(key);
        let written = {
            let mut p = self.lock();
            if p.known.contains(&hash) {
                return None;
            }
            let target = p.taken + 1;
            match p.changed.get(key) {
                // Written with the next batch anyway.
                Some(KeyChange::Settled(_) | KeyChange::Intent(_)) => {}
                _ => {
                    p.changed
                        .insert(key.to_owned(), KeyChange::Intent(obj.clone()));
                    self.lag.set(p.changed.len() as i64);
                }
            }
            p.new_keys.push(key.to_owned());
            p.waiting.entry(target).or_default().clone()
        };
        self.writer.call_once(|| {
            tokio::spawn(write_intents(Arc::downgrade(self), self.intents.clone()));
        });
        self.intents.notify_one();
        Some(Box::pin(written.cancelled_owned()))
    }

    /// Batch `batch` (and every earlier one) is written: its intents' waiters go on.
    fn made_durable(&self, batch: u64) {
        let released = {
            let mut p = self.lock();
            let later = p.waiting.split_off(&(batch + 1));
            std::mem::replace(&mut p.waiting, later)
        };
        released.values().for_each(CancellationToken::cancel);
    }

    /// Whether intents wait for a batch not written yet.
    fn intents_wait(&self) -> bool {
        !self.lock().waiting.is_empty()
    }

    /// Remembers that the sink settled `n` (about the object at `key`); nothing once the
    /// lease is not held (a deposed leader's late acknowledgement).
    pub fn record(&self, key: &str, n: &Notification) {
        if self.deposed() || self.transactional {
            return;
        }
        let change = match n.kind() {
            NotificationKind::Delete { .. } => KeyChange::Deleted,
            NotificationKind::Add { obj, .. } | NotificationKind::Update { new: obj, .. } => {
                KeyChange::Settled(obj.clone())
            }
        };
        let mut p = self.lock();
        if matches!(change, KeyChange::Deleted) {
            p.known.remove(&key_hash(key));
        }
        match p.changed.get_mut(key) {
            Some(slot) => *slot = change,
            None => {
                p.changed.insert(key.to_owned(), change);
                self.lag.set(p.changed.len() as i64);
            }
        }
    }

    /// Records that the checkpoint belongs to the cluster whose `kube-system` namespace has uid
    /// `uid` (written with the next batch, under [`CLUSTER_KEY`]).
    pub fn record_cluster(&self, uid: &str) {
        *self.cluster.lock().unwrap_or_else(|e| e.into_inner()) = Some(uid.to_owned());
        *self.known_cluster.lock().unwrap_or_else(|e| e.into_inner()) = Some(uid.to_owned());
    }

    /// The kind the route publishes: written with the cluster's identity from then on, and
    /// with the next batch when the identity was recorded before (a version switch).
    pub fn describe_kind(&self, kind: RouteKind) {
        let mut k = self.kind.lock().unwrap_or_else(|e| e.into_inner());
        if k.as_ref() == Some(&kind) {
            return;
        }
        *k = Some(kind);
        if let Some(uid) = self
            .known_cluster
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            self.cluster
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(uid);
        }
    }

    /// Writes every change recorded so far. On failure they are kept for the next attempt
    /// (unless a newer change of the same key arrived meanwhile).
    pub async fn flush(&self) -> Result<()> {
        self.flush_locked(self.writing.lock().await, Scope::All)
            .await
    }

    /// Writes what `scope` takes, holding the write lock. What it takes is put back unless
    /// written, also when this future is dropped mid-write (a waiter whose term ended, a
    /// drain's abort).
    async fn flush_locked(
        &self,
        _writing: tokio::sync::MutexGuard<'_, ()>,
        scope: Scope,
    ) -> Result<()> {
        let mut taken = Taken {
            checkpointer: self,
            changed: None,
            cluster: None,
            term: 0,
            new_keys: Vec::new(),
        };
        let batch_number = {
            let mut p = self.lock();
            taken.term = p.term;
            p.taken += 1;
            taken.new_keys = std::mem::take(&mut p.new_keys);
            // Many changes pending (a first sync of new keys): all of them go, so that what
            // waits for the periodic write stays small.
            let all = scope == Scope::All || p.changed.len() >= WRITE_ALL_AT;
            taken.changed = Some(if all {
                std::mem::take(&mut p.changed)
            } else {
                (taken.new_keys.iter())
                    .filter_map(|key| p.changed.remove_entry(key.as_str()))
                    .collect()
            });
            p.taken
        };
        taken.cluster = self
            .cluster
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let changed = taken.changed.as_ref().expect("taken above");
        if changed.is_empty() && taken.cluster.is_none() {
            self.made_durable(batch_number);
            return Ok(());
        }
        // With leader election the write must end while the lease is valid: what it did not
        // issue by then is never issued (put back, and dropped when the term's end is applied).
        let until = match &self.fence {
            Some(fence) => match fence.valid_until() {
                Some(until) => Some(until),
                None => return Err(Error::NotLeading),
            },
            None => None,
        };
        let identity = taken.cluster.iter().map(|uid| {
            (
                CLUSTER_KEY.to_owned(),
                Some(Entry {
                    uid: uid.clone(),
                    resource_version: String::new(),
                    pending: false,
                    kind: self.kind.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                }),
            )
        });
        let batch: Vec<Change> = identity
            .chain(changed.iter().map(|(key, change)| {
                let entry = match change {
                    KeyChange::Settled(obj) => Some(Entry {
                        uid: obj.uid().unwrap_or_default().to_owned(),
                        resource_version: resource_version(obj).to_owned(),
                        pending: false,
                        kind: None,
                    }),
                    KeyChange::Intent(obj) => Some(Entry {
                        uid: obj.uid().unwrap_or_default().to_owned(),
                        resource_version: resource_version(obj).to_owned(),
                        pending: true,
                        kind: None,
                    }),
                    KeyChange::Deleted => None,
                };
                (key.clone(), entry)
            }))
            .collect();
        let n = batch.len();
        let write = self.store.write(&self.route, batch);
        let written = match until {
            Some(until) => tokio::time::timeout_at(until, write)
                .await
                .unwrap_or(Err(Error::NotLeading)),
            None => write.await,
        };
        match written {
            Ok(()) => {
                debug!(route = %self.route, keys = n, "Checkpoint written");
                let written = taken.changed.take().expect("taken above");
                taken.cluster = None;
                let mut p = self.lock();
                let Pending { changed, known, .. } = &mut *p;
                for (key, change) in &written {
                    // A change recorded since decides with the next write.
                    if !changed.contains_key(key) {
                        match change {
                            KeyChange::Deleted => known.remove(&key_hash(key)),
                            _ => known.insert(key_hash(key)),
                        };
                    }
                }
                self.lag.set(changed.len() as i64);
                drop(p);
                self.made_durable(batch_number);
                Ok(())
            }
            Err(Error::NotLeading) => Err(Error::NotLeading),
            Err(err) => {
                self.failures.inc();
                Err(err)
            }
        }
    }

    /// Writes every `interval` until `cancel` fires.
    pub async fn run(self: Arc<Self>, interval: Duration, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.flush().await {
                Ok(()) => {}
                // Standing by, or about to: the term's end drops what is pending.
                Err(Error::NotLeading) => {}
                Err(err) => {
                    warn!(route = %self.route, error = %err, "Checkpoint write failed; retrying with the next batch")
                }
            }
        }
    }
}

/// Writes the intents of `checkpointer` whenever some wait (see [`Checkpointer::intend`]): one
/// batch at a time, each with the changes of every new key recorded until it is taken
/// ([`Scope::NewKeys`]); after a failure, again after a delay doubling from 100 ms to 5 s.
/// Ends with the checkpointer.
async fn write_intents(
    checkpointer: std::sync::Weak<Checkpointer>,
    wake: Arc<tokio::sync::Notify>,
) {
    let mut delay = None;
    loop {
        wake.notified().await;
        loop {
            let Some(c) = checkpointer.upgrade() else {
                return;
            };
            if !c.intents_wait() {
                break;
            }
            let writing = c.writing.lock().await;
            // A write of another (the periodic one) may have taken them meanwhile.
            if !c.intents_wait() {
                break;
            }
            let failed = match c.flush_locked(writing, Scope::NewKeys).await {
                Ok(()) => {
                    delay = None;
                    continue;
                }
                Err(err) => err,
            };
            let wait = if matches!(failed, Error::NotLeading) {
                // The lease lapsed: a renewal or the term's end (which releases the waiters)
                // comes soon; looked at again shortly, without backing off.
                Duration::from_millis(100)
            } else {
                let wait = delay.map_or(Duration::from_millis(100), |d: Duration| {
                    (d * 2).min(Duration::from_secs(5))
                });
                delay = Some(wait);
                warn!(route = %c.route, error = %failed, retry_in = ?wait, "Checkpoint write failed; messages of objects it does not know yet wait for it");
                wait
            };
            drop(c);
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::{informer::testing::obj, sinks::stdout::FileCheckpointStore};

    fn checkpointer(store: Arc<dyn CheckpointStore>) -> Checkpointer {
        Checkpointer::new(
            "configmap/out".into(),
            store,
            IntGauge::new("lag", "lag").unwrap(),
            IntCounter::new("f", "f").unwrap(),
        )
    }

    /// A store whose first write waits for `release` and then fails; later writes succeed,
    /// recording the keys they wrote.
    #[derive(Default)]
    struct SlowFailingStore {
        started: tokio::sync::Notify,
        release: tokio::sync::Notify,
        writes: std::sync::Mutex<Vec<Vec<String>>>,
        failed_once: std::sync::atomic::AtomicBool,
    }

    impl CheckpointStore for SlowFailingStore {
        fn describe(&self) -> String {
            "slow".into()
        }

        fn load_family<'a>(
            &'a self,
            _: &'a [String],
            _: &'a (dyn Fn(&str) -> bool + Send + Sync),
        ) -> futures::future::BoxFuture<
            'a,
            Result<HashMap<String, crate::sinks::checkpoint::Checkpoint>>,
        > {
            Box::pin(async { Ok(HashMap::new()) })
        }

        fn write<'a>(
            &'a self,
            _: &'a str,
            changes: Vec<Change>,
        ) -> futures::future::BoxFuture<'a, Result<()>> {
            Box::pin(async move {
                if !self.failed_once.swap(true, Ordering::SeqCst) {
                    self.started.notify_one();
                    self.release.notified().await;
                    return Err(Error::Store {
                        store: "slow".into(),
                        reason: "timed out".into(),
                    });
                }
                let keys = changes.into_iter().map(|(k, _)| k).collect();
                self.writes.lock().unwrap().push(keys);
                Ok(())
            })
        }
    }

    #[tokio::test]
    async fn a_write_failing_after_its_term_ended_does_not_put_the_identity_back() {
        let store = Arc::new(SlowFailingStore::default());
        let c = Arc::new(checkpointer(store.clone()));
        c.record_cluster("this-cluster");
        let flush = tokio::spawn({
            let c = c.clone();
            async move { c.flush().await }
        });
        store.started.notified().await;
        // The term ends while the write that took the identity is in flight, then it fails.
        c.end_term();
        store.release.notify_one();
        assert!(flush.await.unwrap().is_err());
        // The next term writes no identity until its resume records it again (its checkpoint
        // may be another cluster's).
        c.flush().await.unwrap();
        assert!(
            store
                .writes
                .lock()
                .unwrap()
                .iter()
                .flatten()
                .all(|k| k != CLUSTER_KEY),
            "{:?}",
            store.writes.lock().unwrap()
        );
    }

    #[tokio::test]
    async fn a_deposed_leader_records_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileCheckpointStore::beside(&dir.path().join("out.jsonl")));
        let fence = crate::leader::Fence::default();
        let c = checkpointer(store.clone()).with_fence(Some(fence.clone()));
        let add = |name: &str, rv: &str| {
            Notification::new(NotificationKind::Add {
                obj: obj("ns", name, rv),
                is_initial_list: false,
            })
        };
        fence.extend_to(tokio::time::Instant::now() + Duration::from_secs(60));
        c.record("ns/a", &add("a", "1"));
        // The lease is lost before the write: nothing is written, and a late acknowledgement
        // is not even recorded.
        fence.revoke();
        assert!(matches!(c.flush().await, Err(Error::NotLeading)));
        c.record("ns/b", &add("b", "1"));
        assert_eq!(c.lag.get(), 1);
        assert_eq!(c.failures.get(), 0, "not a store failure");
        // The term's end drops what it did not write; the next term writes its own.
        c.end_term();
        fence.extend_to(tokio::time::Instant::now() + Duration::from_secs(60));
        c.record("ns/c", &add("c", "1"));
        c.flush().await.unwrap();
        let written = store.load("configmap/out").await.unwrap().unwrap();
        assert_eq!(written.keys().collect::<Vec<_>>(), ["ns/c"]);
    }

    /// Sharded: the group's hold unconfirmed for a moment caps every shard's fence. The
    /// acknowledgements of what was published before arrive meanwhile: kept, and written once
    /// the cap is extended (dropped, a clean hand-over's last write would leave their intents
    /// for the next owner to send again).
    #[tokio::test(start_paused = true)]
    async fn a_lapsed_cap_holds_writes_back_and_keeps_acknowledgements() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileCheckpointStore::beside(&dir.path().join("out.jsonl")));
        let cap = crate::leader::FenceCap::default();
        let fence = crate::leader::Fence::capped(cap.clone());
        let c = checkpointer(store.clone()).with_fence(Some(fence.clone()));
        let now = tokio::time::Instant::now();
        fence.extend_to(now + Duration::from_secs(60));
        cap.extend_to(now + Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(fence.is_held() && !fence.is_valid(), "the cap lapsed");
        c.record(
            "ns/a",
            &Notification::new(NotificationKind::Add {
                obj: obj("ns", "a", "1"),
                is_initial_list: false,
            }),
        );
        assert_eq!(c.lag.get(), 1, "recorded");
        assert!(matches!(c.flush().await, Err(Error::NotLeading)));
        cap.extend_to(tokio::time::Instant::now() + Duration::from_secs(60));
        c.flush().await.unwrap();
        let written = store.load("configmap/out").await.unwrap().unwrap();
        assert_eq!(written.keys().collect::<Vec<_>>(), ["ns/a"]);
    }

    #[tokio::test]
    async fn acknowledged_changes_reach_the_file_and_a_delete_removes_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileCheckpointStore::beside(&dir.path().join("out.jsonl")));
        let c = checkpointer(store.clone());
        c.record(
            "ns/a",
            &Notification::new(NotificationKind::Add {
                obj: obj("ns", "a", "1"),
                is_initial_list: true,
            }),
        );
        c.record(
            "ns/b",
            &Notification::new(NotificationKind::Add {
                obj: obj("ns", "b", "2"),
                is_initial_list: false,
            }),
        );
        c.record(
            "ns/a",
            &Notification::new(NotificationKind::Update {
                old: obj("ns", "a", "1"),
                new: obj("ns", "a", "3"),
            }),
        );
        assert_eq!(c.lag.get(), 2);
        c.flush().await.unwrap();
        assert_eq!(c.lag.get(), 0);
        c.record(
            "ns/b",
            &Notification::new(NotificationKind::Delete {
                obj: obj("ns", "b", "4"),
                final_state_unknown: false,
            }),
        );
        c.flush().await.unwrap();
        // A fresh store (a restarted process) reads what was written.
        let reread = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        let cp = reread.load("configmap/out").await.unwrap().unwrap();
        assert_eq!(cp.len(), 1);
        assert_eq!(cp["ns/a"].resource_version, "3");
        assert_eq!(cp["ns/a"].uid, "uid-ns-a");
        assert!(reread.load("other/out").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_failed_write_keeps_the_changes_for_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        // The checkpoint's directory does not exist: every write fails.
        let store = Arc::new(FileCheckpointStore::beside(
            &dir.path().join("missing").join("out.jsonl"),
        ));
        let c = checkpointer(store);
        c.record(
            "ns/a",
            &Notification::new(NotificationKind::Add {
                obj: obj("ns", "a", "1"),
                is_initial_list: false,
            }),
        );
        assert!(c.flush().await.is_err());
        assert_eq!((c.lag.get(), c.failures.get()), (1, 1));
        std::fs::create_dir(dir.path().join("missing")).unwrap();
        c.flush().await.unwrap();
        assert_eq!(c.lag.get(), 0);
    }

    /// `c` as resumed from a checkpoint holding `ns/known` (acknowledged at version 1).
    fn knows_one_key(c: &Checkpointer) {
        let loaded: Checkpoint = [(
            "ns/known".to_owned(),
            Entry {
                uid: "uid-ns-known".into(),
                resource_version: "1".into(),
                pending: false,
                kind: None,
            },
        )]
        .into_iter()
        .collect();
        c.knows(Some(&loaded));
    }

    #[tokio::test]
    async fn a_key_the_store_does_not_hold_is_written_as_an_intent_before_its_message_goes() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let store = Arc::new(FileCheckpointStore::beside(&out));
        let c = Arc::new(checkpointer(store.clone()));
        knows_one_key(&c);
        assert!(c.intend("ns/known", &obj("ns", "known", "2")).is_none());
        let wait = c
            .intend("ns/new", &obj("ns", "new", "3"))
            .expect("an unknown key waits for its intent");
        let reread = || FileCheckpointStore::beside(&out);
        assert!(reread().load("configmap/out").await.unwrap().is_none());
        wait.await;
        let cp = reread().load("configmap/out").await.unwrap().unwrap();
        assert_eq!(
            cp["ns/new"],
            Entry {
                uid: "uid-ns-new".into(),
                resource_version: "3".into(),
                pending: true,
                kind: None,
            },
            "an intent: a resume publishes the object again, or its delete"
        );
        // Written: known from now on, and its acknowledgement records the real version.
        assert!(c.intend("ns/new", &obj("ns", "new", "3")).is_none());
        c.record(
            "ns/new",
            &Notification::new(NotificationKind::Add {
                obj: obj("ns", "new", "3"),
                is_initial_list: false,
            }),
        );
        c.flush().await.unwrap();
        let cp = reread().load("configmap/out").await.unwrap().unwrap();
        assert_eq!(cp["ns/new"].resource_version, "3");
        assert!(!cp["ns/new"].pending, "acknowledged");
        // A delete recorded (not yet written) makes the key unknown at once: a recreation
        // waits for its own intent.
        c.record(
            "ns/new",
            &Notification::new(NotificationKind::Delete {
                obj: obj("ns", "new", "4"),
                final_state_unknown: false,
            }),
        );
        let wait = c
            .intend("ns/new", &obj("ns", "new", "5"))
            .expect("deleted, then recreated: unknown");
        wait.await;
        let cp = reread().load("configmap/out").await.unwrap().unwrap();
        assert_eq!(cp["ns/new"].resource_version, "5");
        assert!(cp["ns/new"].pending);
    }

    /// A store whose writes hang while `stall` is set.
    struct Stalling {
        stall: std::sync::atomic::AtomicBool,
        inner: FileCheckpointStore,
    }

    impl CheckpointStore for Stalling {
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn load_family<'a>(
            &'a self,
            routes: &'a [String],
            also: &'a (dyn Fn(&str) -> bool + Send + Sync),
        ) -> futures::future::BoxFuture<'a, Result<HashMap<String, Checkpoint>>> {
            self.inner.load_family(routes, also)
        }
        fn write<'a>(
            &'a self,
            route: &'a str,
            changes: Vec<Change>,
        ) -> futures::future::BoxFuture<'a, Result<()>> {
            use futures::FutureExt;
            async move {
                if self.stall.load(Ordering::SeqCst) {
                    futures::future::pending::<()>().await;
                }
                self.inner.write(route, changes).await
            }
            .boxed()
        }
    }

    #[tokio::test]
    async fn a_write_of_an_ended_term_puts_nothing_back_and_a_lapsing_lease_ends_a_write() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let store = Arc::new(Stalling {
            stall: true.into(),
            inner: FileCheckpointStore::beside(&out),
        });
        let fence = crate::leader::Fence::default();
        fence.extend_to(tokio::time::Instant::now() + Duration::from_millis(200));
        let c = Arc::new(checkpointer(store.clone()).with_fence(Some(fence.clone())));
        let add = Notification::new(NotificationKind::Add {
            obj: obj("ns", "a", "1"),
            is_initial_list: false,
        });
        c.record("ns/a", &add);
        // The write hangs; the lease lapses under it: it ends, not leading.
        let started = tokio::time::Instant::now();
        assert!(matches!(c.flush().await, Err(Error::NotLeading)));
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(c.lag.get(), 1, "put back while the term lasts");
        // A write taken in a term that ends while it runs puts nothing back.
        fence.extend_to(tokio::time::Instant::now() + Duration::from_secs(60));
        let write = tokio::spawn({
            let c = c.clone();
            async move { c.flush().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.end_term();
        write.abort();
        let _ = write.await;
        assert_eq!(c.lag.get(), 0);
        store.stall.store(false, Ordering::SeqCst);
        c.flush().await.unwrap();
        assert!(
            FileCheckpointStore::beside(&out)
                .load("configmap/out")
                .await
                .unwrap()
                .is_none(),
            "the ended term's change is never written"
        );
    }

    /// Intents recorded while a write fails are written together by the next attempt; every
    /// waiter goes on once, when its batch is written.
    #[tokio::test(start_paused = true)]
    async fn intents_wait_through_a_failed_write_and_go_with_one_batch() {
        let store = Arc::new(SlowFailingStore::default());
        let c = Arc::new(checkpointer(store.clone()));
        let first = c.intend("ns/k0", &obj("ns", "k0", "1")).unwrap();
        store.started.notified().await;
        let rest: Vec<_> = (1..1000)
            .map(|i| {
                let name = format!("k{i}");
                c.intend(&format!("ns/{name}"), &obj("ns", &name, "1"))
                    .unwrap()
            })
            .collect();
        store.release.notify_one();
        first.await;
        futures::future::join_all(rest).await;
        let writes = store.writes.lock().unwrap().clone();
        assert_eq!(writes.len(), 1, "{writes:?}");
        assert_eq!(
            writes[0].len(),
            1000,
            "the failed one's intent and the rest"
        );
        assert_eq!(c.lag.get(), 0);
        assert!(
            c.intend("ns/k7", &obj("ns", "k7", "1")).is_none(),
            "known now"
        );
    }

    /// A store that records the keys of each write.
    fn recording() -> Arc<SlowFailingStore> {
        Arc::new(SlowFailingStore {
            failed_once: true.into(),
            ..Default::default()
        })
    }

    /// Records the acknowledged adds of `n` objects, `ns/k0` on.
    fn record_added(c: &Checkpointer, n: usize) {
        for i in 0..n {
            let name = format!("k{i}");
            c.record(&format!("ns/{name}"), &added("ns", &name, "1"));
        }
    }

    fn added(ns: &str, name: &str, rv: &str) -> Notification {
        Notification::new(NotificationKind::Add {
            obj: obj(ns, name, rv),
            is_initial_list: false,
        })
    }

    #[tokio::test]
    async fn an_intent_batch_writes_the_new_keys_and_leaves_the_rest_for_the_periodic_write() {
        let store = recording();
        let c = Arc::new(checkpointer(store.clone()));
        knows_one_key(&c);
        c.record("ns/known", &added("ns", "known", "2"));
        c.record("ns/gone", &added("ns", "gone", "1"));
        c.intend("ns/new", &obj("ns", "new", "3"))
            .expect("unknown")
            .await;
        assert_eq!(*store.writes.lock().unwrap(), [vec!["ns/new".to_owned()]]);
        assert_eq!(c.lag.get(), 2, "the acknowledgements still pending");
        c.flush().await.unwrap();
        let mut periodic = store.writes.lock().unwrap()[1].clone();
        periodic.sort();
        assert_eq!(periodic, ["ns/gone", "ns/known"]);
        assert_eq!(c.lag.get(), 0);
    }

    #[tokio::test]
    async fn an_intent_batch_takes_everything_once_many_changes_are_pending() {
        let store = recording();
        let c = Arc::new(checkpointer(store.clone()));
        record_added(&c, WRITE_ALL_AT);
        c.intend("ns/new", &obj("ns", "new", "1"))
            .expect("unknown")
            .await;
        let writes = store.writes.lock().unwrap().clone();
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].len(), WRITE_ALL_AT + 1, "the intent and the rest");
        assert_eq!(c.lag.get(), 0);
    }

    /// The threshold counts every change pending, the intent's own included: at
    /// `WRITE_ALL_AT - 1` an intent batch writes its new key alone, at `WRITE_ALL_AT` all.
    #[tokio::test]
    async fn an_intent_batch_takes_everything_from_exactly_the_threshold() {
        for (recorded, written) in [(WRITE_ALL_AT - 2, 1), (WRITE_ALL_AT - 1, WRITE_ALL_AT)] {
            let store = recording();
            let c = Arc::new(checkpointer(store.clone()));
            record_added(&c, recorded);
            c.intend("ns/new", &obj("ns", "new", "1"))
                .expect("unknown")
                .await;
            let writes = store.writes.lock().unwrap().clone();
            assert_eq!(writes.len(), 1, "{recorded} recorded");
            assert_eq!(writes[0].len(), written, "{recorded} recorded");
            assert_eq!(c.lag.get() as usize, recorded + 1 - written);
        }
    }

    /// A failed write that took everything puts everything back, the new key among the next
    /// batch's: the retry takes it all again, and the intent's waiter goes on once, then.
    #[tokio::test(start_paused = true)]
    async fn a_failed_write_of_everything_puts_it_all_back_for_the_retry() {
        let store = Arc::new(SlowFailingStore::default());
        let c = Arc::new(checkpointer(store.clone()));
        record_added(&c, WRITE_ALL_AT);
        let intent = c.intend("ns/new", &obj("ns", "new", "1")).expect("unknown");
        store.started.notified().await;
        store.release.notify_one();
        intent.await;
        let writes = store.writes.lock().unwrap().clone();
        assert_eq!(
            writes.len(),
            1,
            "the retry only: the failed write stored nothing"
        );
        assert_eq!(
            writes[0].len(),
            WRITE_ALL_AT + 1,
            "everything, put back and taken again"
        );
        assert!(writes[0].contains(&"ns/new".to_owned()));
        assert_eq!(c.lag.get(), 0);
        assert!(
            c.intend("ns/new", &obj("ns", "new", "1")).is_none(),
            "known now"
        );
    }

    #[tokio::test]
    async fn acknowledgements_put_back_by_a_failed_write_wait_for_the_periodic_one() {
        let store = Arc::new(SlowFailingStore::default());
        let c = Arc::new(checkpointer(store.clone()));
        c.record("ns/acked", &added("ns", "acked", "1"));
        let (failed, ()) = tokio::join!(c.flush(), async {
            store.started.notified().await;
            store.release.notify_one();
        });
        assert!(failed.is_err());
        c.intend("ns/new", &obj("ns", "new", "1"))
            .expect("unknown")
            .await;
        assert_eq!(
            *store.writes.lock().unwrap(),
            [vec!["ns/new".to_owned()]],
            "the intent batch holds the new key only"
        );
        c.flush().await.unwrap();
        assert_eq!(store.writes.lock().unwrap()[1], ["ns/acked"]);
    }

    #[tokio::test]
    async fn an_intent_put_back_by_a_failed_periodic_write_goes_with_the_next_intent_batch() {
        let store = Arc::new(SlowFailingStore::default());
        let c = Arc::new(checkpointer(store.clone()));
        let writing = c.writing.lock().await;
        // Its writer waits for the periodic write below, which takes the intent and fails.
        let wait = c.intend("ns/new", &obj("ns", "new", "1")).expect("unknown");
        let (failed, ()) = tokio::join!(c.flush_locked(writing, Scope::All), async {
            store.started.notified().await;
            store.release.notify_one();
        });
        assert!(failed.is_err());
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("written by the intent writer");
        assert_eq!(
            *store.writes.lock().unwrap(),
            [vec!["ns/new".to_owned()]],
            "the waiter went on only once its intent was written"
        );
    }

    /// A term's end releases those waiting for an intent whose write never ends.
    #[tokio::test]
    async fn the_end_of_a_term_releases_the_intents_waiters() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Stalling {
            stall: true.into(),
            inner: FileCheckpointStore::beside(&dir.path().join("out.jsonl")),
        });
        let c = Arc::new(checkpointer(store));
        let wait = c.intend("ns/a", &obj("ns", "a", "1")).expect("unknown");
        let mut wait = std::pin::pin!(wait);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut wait)
                .await
                .is_err(),
            "its write hangs"
        );
        c.end_term();
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("released");
    }

    #[tokio::test]
    async fn a_write_dropped_midway_puts_back_what_it_took() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let store = Arc::new(Stalling {
            stall: true.into(),
            inner: FileCheckpointStore::beside(&out),
        });
        let c = Arc::new(checkpointer(store.clone()));
        c.record_cluster("cluster-uid");
        c.record(
            "ns/a",
            &Notification::new(NotificationKind::Add {
                obj: obj("ns", "a", "1"),
                is_initial_list: false,
            }),
        );
        // The write hangs and is dropped mid-write (a shutdown's flush given up).
        assert!(
            tokio::time::timeout(Duration::from_millis(50), c.flush())
                .await
                .is_err()
        );
        assert_eq!(c.lag.get(), 1, "the change is pending again");
        store.stall.store(false, Ordering::SeqCst);
        c.flush().await.unwrap();
        let cp = FileCheckpointStore::beside(&out)
            .load("configmap/out")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(cp["ns/a"].resource_version, "1");
        assert_eq!(cp[CLUSTER_KEY].uid, "cluster-uid", "the identity too");
    }
}
