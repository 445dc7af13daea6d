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
//!   crash can lose: those notifications are re-sent after the restart, with the same ids.
//! - A failed write is counted, logged, and retried with the next batch; a change recorded
//!   meanwhile for the same key wins.
//! - At shutdown, once the queues have drained, [`Checkpointer::flush`] writes what is left.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus::{IntCounter, IntGauge};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::informer::{Notification, NotificationKind, ObjectRef, resource_version};
pub use crate::sinks::checkpoint::{Change, Checkpoint, CheckpointStore, Entry, Error, Result};

/// The key under which a route's checkpoint records the cluster it belongs to (the uid of
/// its `kube-system` namespace) as the entry's uid. No object has this key: `:` is not allowed
/// in names.
pub const CLUSTER_KEY: &str = ":cluster";

/// Records one route's acknowledgements and writes them to its store. See the module docs.
pub struct Checkpointer {
    route: String,
    store: Arc<dyn CheckpointStore>,
    // Per key, the newest settled object (`None`: deleted). Holding the shared object rather
    // than its uid and resourceVersion keeps the acknowledgement path free of allocations
    // for keys already pending.
    changed: Mutex<HashMap<String, Option<ObjectRef>>>,
    // The cluster identity still to write (see `CLUSTER_KEY`).
    cluster: Mutex<Option<String>>,
    // Serializes writes, so that an older batch never lands after a newer one.
    writing: tokio::sync::Mutex<()>,
    lag: IntGauge,
    failures: IntCounter,
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
            changed: Mutex::default(),
            cluster: Mutex::default(),
            writing: tokio::sync::Mutex::new(()),
            lag,
            failures,
        }
    }

    /// The route's name.
    pub fn route(&self) -> &str {
        &self.route
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn CheckpointStore> {
        &self.store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Option<ObjectRef>>> {
        self.changed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers that the sink settled `n` (about the object at `key`).
    pub fn record(&self, key: &str, n: &Notification) {
        let object = match &n.kind {
            NotificationKind::Delete { .. } => None,
            NotificationKind::Add { obj, .. } | NotificationKind::Update { new: obj, .. } => {
                Some(obj.clone())
            }
        };
        let mut changed = self.lock();
        match changed.get_mut(key) {
            Some(slot) => *slot = object,
            None => {
                changed.insert(key.to_owned(), object);
                self.lag.set(changed.len() as i64);
            }
        }
    }

    /// Records that the checkpoint belongs to the cluster whose `kube-system` namespace has uid
    /// `uid` (written with the next batch, under [`CLUSTER_KEY`]).
    pub fn record_cluster(&self, uid: &str) {
        *self.cluster.lock().unwrap_or_else(|e| e.into_inner()) = Some(uid.to_owned());
    }

    /// Writes every change recorded so far. On failure they are kept for the next attempt
    /// (unless a newer change of the same key arrived meanwhile).
    pub async fn flush(&self) -> Result<()> {
        let _writing = self.writing.lock().await;
        let taken = std::mem::take(&mut *self.lock());
        let cluster = self
            .cluster
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if taken.is_empty() && cluster.is_none() {
            return Ok(());
        }
        let identity = cluster.iter().map(|uid| {
            (
                CLUSTER_KEY.to_owned(),
                Some(Entry {
                    uid: uid.clone(),
                    resource_version: String::new(),
                }),
            )
        });
        let batch: Vec<Change> = identity
            .chain(taken.iter().map(|(key, object)| {
                let entry = object.as_ref().map(|obj| Entry {
                    uid: obj.uid().unwrap_or_default().to_owned(),
                    resource_version: resource_version(obj).to_owned(),
                });
                (key.clone(), entry)
            }))
            .collect();
        let n = batch.len();
        match self.store.write(&self.route, batch).await {
            Ok(()) => {
                debug!(route = %self.route, keys = n, "Checkpoint written");
                self.lag.set(self.lock().len() as i64);
                Ok(())
            }
            Err(err) => {
                self.failures.inc();
                if let Some(uid) = cluster {
                    self.cluster
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(uid);
                }
                let mut changed = self.lock();
                for (key, object) in taken {
                    changed.entry(key).or_insert(object);
                }
                self.lag.set(changed.len() as i64);
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
            if let Err(err) = self.flush().await {
                warn!(route = %self.route, error = %err, "Checkpoint write failed; retrying with the next batch");
            }
        }
    }
}

#[cfg(test)]
mod tests {
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
}
