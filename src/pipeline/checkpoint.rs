//! Checkpoints: what each route's sink has acknowledged, per object key, kept durably where
//! the messages go, so that a restart or a new leader resumes from it (see [`super::resume`]).
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
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::{FutureExt, future::BoxFuture};
use prometheus::{IntCounter, IntGauge};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::informer::{Notification, NotificationKind, ObjectRef, resource_version};

/// Errors of a checkpoint store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing the store failed.
    #[error("checkpoint {store}: {reason}")]
    Store {
        /// Which store (a file path, a topic, a bucket).
        store: String,
        /// What went wrong.
        reason: String,
    },
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a route's sink acknowledged for one object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The object's uid.
    pub uid: String,
    /// The resourceVersion of the newest acknowledged notification.
    #[serde(rename = "resourceVersion")]
    pub resource_version: String,
}

/// A loaded checkpoint: entries by `namespace/name`.
pub type Checkpoint = HashMap<String, Entry>;

/// One change to write: `None` removes the key.
pub type Change = (String, Option<Entry>);

/// Where a sink keeps its routes' checkpoints.
pub trait CheckpointStore: Send + Sync {
    /// The store, for logs and errors (a file path, a topic, a bucket).
    fn describe(&self) -> String;

    /// The checkpoints of `routes`, read in one pass over the store; a route the store has
    /// never held one for is absent. A record that cannot be read is logged (naming the
    /// route and key) and skipped.
    fn load_routes<'a>(
        &'a self,
        routes: &'a [String],
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>>;

    /// The checkpoint of `route`, or `None` when the store has never held one for it.
    fn load<'a>(&'a self, route: &'a str) -> BoxFuture<'a, Result<Option<Checkpoint>>> {
        async move {
            let mut all = self
                .load_routes(std::slice::from_ref(&route.to_owned()))
                .await?;
            Ok(all.remove(route))
        }
        .boxed()
    }

    /// Applies `changes` to the checkpoint of `route` durably.
    fn write<'a>(&'a self, route: &'a str, changes: Vec<Change>) -> BoxFuture<'a, Result<()>>;
}

/// Records one route's acknowledgements and writes them to its store. See the module docs.
pub struct Checkpointer {
    route: String,
    store: Arc<dyn CheckpointStore>,
    // Per key, the newest settled object (`None`: deleted). Holding the shared object rather
    // than its uid and resourceVersion keeps the acknowledgement path free of allocations
    // for keys already pending.
    changed: Mutex<HashMap<String, Option<ObjectRef>>>,
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

    /// Writes every change recorded so far. On failure they are kept for the next attempt
    /// (unless a newer change of the same key arrived meanwhile).
    pub async fn flush(&self) -> Result<()> {
        let _writing = self.writing.lock().await;
        let taken = std::mem::take(&mut *self.lock());
        if taken.is_empty() {
            return Ok(());
        }
        let batch: Vec<Change> = taken
            .iter()
            .map(|(key, object)| {
                let entry = object.as_ref().map(|obj| Entry {
                    uid: obj.uid().unwrap_or_default().to_owned(),
                    resource_version: resource_version(obj).to_owned(),
                });
                (key.clone(), entry)
            })
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

/// The checkpoint store of a file sink: one JSON document beside the output file
/// (`<path>.checkpoint`), `{"route": {"namespace/name": {"uid", "resourceVersion"}}}`,
/// replaced atomically (written to a temporary file, synced, renamed) at each write.
pub struct FileCheckpointStore {
    path: PathBuf,
    // The whole document as last read or written; every write rewrites the file from it, and
    // every load reads the file again.
    routes: tokio::sync::Mutex<Option<HashMap<String, Checkpoint>>>,
}

impl FileCheckpointStore {
    /// The store beside the output file `output`.
    pub fn beside(output: &Path) -> Self {
        let mut name = output.as_os_str().to_owned();
        name.push(".checkpoint");
        Self {
            path: PathBuf::from(name),
            routes: tokio::sync::Mutex::new(None),
        }
    }

    /// The checkpoint file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, reason: impl std::fmt::Display) -> Error {
        Error::Store {
            store: self.describe(),
            reason: reason.to_string(),
        }
    }

    /// Reads the file: routes by name, each record checked on its own.
    async fn read(&self) -> Result<HashMap<String, Checkpoint>> {
        let text = match tokio::fs::read(&self.path).await {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
            Err(e) => return Err(self.error(e)),
        };
        let doc: HashMap<String, HashMap<String, serde_json::Value>> = match serde_json::from_slice(
            &text,
        ) {
            Ok(d) => d,
            Err(e) => {
                warn!(store = %self.describe(), error = %e, "Checkpoint file is corrupt; every route starts without a checkpoint");
                return Ok(HashMap::new());
            }
        };
        Ok(doc
            .into_iter()
            .map(|(route, records)| {
                let entries = records
                    .into_iter()
                    .filter_map(|(key, value)| match serde_json::from_value::<Entry>(value) {
                        Ok(entry) => Some((key, entry)),
                        Err(e) => {
                            warn!(store = %self.describe(), route = %route, key = %key, error = %e,
                                  "Corrupt checkpoint record; that object is treated as unknown");
                            None
                        }
                    })
                    .collect();
                (route, entries)
            })
            .collect())
    }
}

impl CheckpointStore for FileCheckpointStore {
    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    fn load_routes<'a>(
        &'a self,
        routes: &'a [String],
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>> {
        async move {
            // Always from disk: a new leader must see what the previous one wrote.
            let mut cached = self.routes.lock().await;
            let all = self.read().await?;
            let wanted = routes
                .iter()
                .filter_map(|r| all.get(r).map(|c| (r.clone(), c.clone())))
                .collect();
            *cached = Some(all);
            Ok(wanted)
        }
        .boxed()
    }

    fn write<'a>(&'a self, route: &'a str, changes: Vec<Change>) -> BoxFuture<'a, Result<()>> {
        async move {
            let mut routes = self.routes.lock().await;
            if routes.is_none() {
                *routes = Some(self.read().await?);
            }
            let all = routes.as_mut().expect("loaded above");
            let entries = all.entry(route.to_owned()).or_default();
            for (key, entry) in changes {
                match entry {
                    Some(e) => entries.insert(key, e),
                    None => entries.remove(&key),
                };
            }
            let bytes = serde_json::to_vec(all).map_err(|e| self.error(e))?;
            let mut tmp = self.path.as_os_str().to_owned();
            tmp.push(".tmp");
            let tmp = PathBuf::from(tmp);
            let write = async {
                use tokio::io::AsyncWriteExt;
                let mut f = tokio::fs::File::create(&tmp).await?;
                f.write_all(&bytes).await?;
                f.sync_all().await?;
                tokio::fs::rename(&tmp, &self.path).await
            };
            write.await.map_err(|e| self.error(e))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::testing::obj;

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
    async fn the_routes_of_one_store_load_in_one_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        let entry = |rv: &str| {
            Some(Entry {
                uid: "u".into(),
                resource_version: rv.into(),
            })
        };
        store
            .write("configmap/out", vec![("ns/a".into(), entry("1"))])
            .await
            .unwrap();
        store
            .write("secret/out", vec![("ns/s".into(), entry("2"))])
            .await
            .unwrap();
        let routes = ["configmap/out", "secret/out", "never/out"].map(String::from);
        let loaded = FileCheckpointStore::beside(&dir.path().join("out.jsonl"))
            .load_routes(&routes)
            .await
            .unwrap();
        assert_eq!(loaded.len(), 2, "a route never written is absent");
        assert_eq!(loaded["configmap/out"]["ns/a"].resource_version, "1");
        assert_eq!(loaded["secret/out"]["ns/s"].resource_version, "2");
    }

    #[tokio::test]
    async fn a_corrupt_record_is_skipped_and_the_rest_loads() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        std::fs::write(
            store.path(),
            r#"{"r": {"ns/a": {"uid": "u", "resourceVersion": "1"}, "ns/b": {"uid": 7}}}"#,
        )
        .unwrap();
        let cp = store.load("r").await.unwrap().unwrap();
        assert_eq!(cp.keys().collect::<Vec<_>>(), ["ns/a"]);
        std::fs::write(store.path(), "not json").unwrap();
        let fresh = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        assert!(
            fresh.load("r").await.unwrap().is_none(),
            "corrupt file: no checkpoint"
        );
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
