//! The checkpoint store of a file sink: a JSON document beside the output file.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use futures::{FutureExt, future::BoxFuture};

use crate::sinks::checkpoint::{Change, Checkpoint, CheckpointStore, Entry, Error, Result};

/// The checkpoint store of a file sink: one JSON document beside the output file
/// (`<path>.checkpoint`), `{"route": {"namespace/name": {"uid", "resourceVersion"}}}`,
/// replaced atomically (written to a temporary file, synced, renamed) at each write. A write
/// holds an exclusive lock on `<path>.checkpoint.lock` while it reads the document again,
/// changes its own route's records and replaces it, so that processes sharing the file
/// (sharded replicas on one volume, each writing its shards' routes) never undo each other's
/// writes. A file or a record that cannot be read makes the load of the routes it concerns
/// an error (the checkpoint would be incomplete); a rewrite keeps such records as they are.
pub struct FileCheckpointStore {
    path: PathBuf,
    /// The output file: synced to disk before each checkpoint write, so that a checkpoint
    /// never claims a line a node crash could still lose.
    output: PathBuf,
    // One write at a time in this process (the file lock serialises processes).
    writing: tokio::sync::Mutex<()>,
}

/// Each route's records, kept as the file's text: a write re-reads and rewrites the whole
/// document (other routes' records included), so it parses none of them into a tree (with
/// 30,000 records and twelve routes in one file, building and dropping `Value`s made a
/// sharded replica's first sync a fifth slower).
type Document = HashMap<String, HashMap<String, Record>>;

/// One record, as written.
type Record = Box<serde_json::value::RawValue>;

impl FileCheckpointStore {
    /// The store beside the output file `output`.
    pub fn beside(output: &Path) -> Self {
        let mut name = output.as_os_str().to_owned();
        name.push(".checkpoint");
        Self {
            path: PathBuf::from(name),
            output: output.to_owned(),
            writing: tokio::sync::Mutex::new(()),
        }
    }

    /// The checkpoint file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `<path>` with `suffix` appended.
    fn beside_it(&self, suffix: &str) -> PathBuf {
        let mut name = self.path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    }

    fn error(&self, reason: impl std::fmt::Display) -> Error {
        Error::Store {
            store: self.describe(),
            reason: reason.to_string(),
        }
    }

    /// Reads the file (none: an empty document); blocking.
    fn read(path: &Path) -> std::result::Result<Document, String> {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
            Err(e) => return Err(e.to_string()),
        };
        serde_json::from_slice(&text).map_err(|e| {
            format!(
                "the file is not a checkpoint document ({e}), so every checkpoint in it is \
                 unknown; remove it to start over without checkpoints (every object is then \
                 published as added, and deletes made while down are not)"
            )
        })
    }

    /// The checkpoint of `route` in `doc`: an error names a record that cannot be read.
    fn decode(&self, route: &str, records: &HashMap<String, Record>) -> Result<Checkpoint> {
        let corrupt = |key: &str, e: serde_json::Error| {
            self.error(format!(
                "route {route}: the record of {key} is corrupt ({e}), so the checkpoint is \
                 incomplete; remove that record to go on (its object is then published as added)"
            ))
        };
        records
            .iter()
            .map(|(key, record)| {
                let entry =
                    serde_json::from_str::<Entry>(record.get()).map_err(|e| corrupt(key, e))?;
                Ok((key.clone(), entry))
            })
            .collect()
    }
}

impl CheckpointStore for FileCheckpointStore {
    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    fn load_family<'a>(
        &'a self,
        routes: &'a [String],
        also: &'a (dyn Fn(&str) -> bool + Send + Sync),
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>> {
        async move {
            let wanted = |route: &str| routes.iter().any(|r| r == route) || also(route);
            // Always from disk: a new owner must see what the previous one wrote.
            let path = self.path.clone();
            let all = tokio::task::spawn_blocking(move || Self::read(&path))
                .await
                .map_err(|e| self.error(e))?
                .map_err(|e| self.error(e))?;
            all.iter()
                .filter(|(r, _)| wanted(r))
                .map(|(r, c)| Ok((r.clone(), self.decode(r, c)?)))
                .collect::<Result<_>>()
        }
        .boxed()
    }

    fn write<'a>(&'a self, route: &'a str, changes: Vec<Change>) -> BoxFuture<'a, Result<()>> {
        async move {
            let _one_at_a_time = self.writing.lock().await;
            // What the checkpoint will claim is on disk first (the sink flushes each line
            // to the operating system only).
            match tokio::fs::File::open(&self.output).await {
                Ok(f) => f.sync_data().await.map_err(|e| {
                    self.error(format!("cannot sync {}: {e}", self.output.display()))
                })?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(self.error(format!("cannot open {}: {e}", self.output.display())));
                }
            }
            let changes: Vec<(String, Option<Record>)> = changes
                .into_iter()
                .map(|(key, entry)| {
                    let record = entry
                        .map(|e| serde_json::value::to_raw_value(&e).expect("an entry is JSON"));
                    (key, record)
                })
                .collect();
            let (path, lock, tmp) = (
                self.path.clone(),
                self.beside_it(".lock"),
                self.beside_it(".tmp"),
            );
            let route = route.to_owned();
            // Set when this write is given up (its future dropped: the lease's deadline passed
            // while it waited for the lock): the blocking work then replaces nothing.
            struct GivenUp(Arc<AtomicBool>);
            impl Drop for GivenUp {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::SeqCst);
                }
            }
            let given_up = GivenUp(Arc::default());
            let abandoned = given_up.0.clone();
            let done = tokio::task::spawn_blocking(move || -> std::result::Result<(), String> {
                use std::io::Write;
                let lock = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&lock)
                    .map_err(|e| format!("cannot open {}: {e}", lock.display()))?;
                // Released when `lock` is dropped (closed).
                lock.lock()
                    .map_err(|e| format!("cannot lock {}: {e}", path.display()))?;
                let mut all = Self::read(&path)?;
                let entries = all.entry(route).or_default();
                for (key, entry) in changes {
                    match entry {
                        Some(e) => entries.insert(key, e),
                        None => entries.remove(&key),
                    };
                }
                let bytes = serde_json::to_vec(&all).map_err(|e| e.to_string())?;
                let mut f = std::fs::File::create(&tmp).map_err(|e| e.to_string())?;
                f.write_all(&bytes).map_err(|e| e.to_string())?;
                f.sync_all().map_err(|e| e.to_string())?;
                if abandoned.load(Ordering::SeqCst) {
                    return Err("given up before it was written".into());
                }
                std::fs::rename(&tmp, &path).map_err(|e| e.to_string())
            })
            .await;
            drop(given_up);
            done.map_err(|e| self.error(e))?.map_err(|e| self.error(e))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_routes_of_one_store_load_in_one_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        let entry = |rv: &str| {
            Some(Entry {
                uid: "u".into(),
                resource_version: rv.into(),
                pending: false,
                kind: None,
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

    /// Two stores on one file (two processes: sharded replicas on a shared volume), writing
    /// their own routes at once: neither undoes the other's writes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stores_sharing_a_file_keep_each_others_routes() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let entry = |rv: usize| {
            Some(Entry {
                uid: "u".into(),
                resource_version: rv.to_string(),
                pending: false,
                kind: None,
            })
        };
        let writer = |route: &'static str| {
            let store = FileCheckpointStore::beside(&out);
            tokio::spawn(async move {
                for i in 0..50 {
                    let key = format!("ns/{route}-{i}");
                    store.write(route, vec![(key, entry(i))]).await.unwrap();
                }
            })
        };
        let (a, b) = (writer("a#0-of-2/out"), writer("a#1-of-2/out"));
        a.await.unwrap();
        b.await.unwrap();
        let routes = ["a#0-of-2/out", "a#1-of-2/out"].map(String::from);
        let loaded = FileCheckpointStore::beside(&out)
            .load_routes(&routes)
            .await
            .unwrap();
        assert_eq!(loaded["a#0-of-2/out"].len(), 50);
        assert_eq!(loaded["a#1-of-2/out"].len(), 50);
    }

    #[tokio::test]
    async fn a_corrupt_record_or_file_is_an_error_naming_it_and_a_rewrite_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        std::fs::write(
            store.path(),
            r#"{"r": {"ns/a": {"uid": "u", "resourceVersion": "1"}, "ns/b": {"uid": 7}},
                "other": {"ns/c": {"uid": "u", "resourceVersion": "2"}}}"#,
        )
        .unwrap();
        let err = store.load("r").await.unwrap_err().to_string();
        assert!(
            err.contains("route r") && err.contains("ns/b") && err.contains("incomplete"),
            "{err}"
        );
        // Another route of the store loads, and its writes keep the corrupt record.
        assert_eq!(store.load("other").await.unwrap().unwrap().len(), 1);
        store
            .write("other", vec![("ns/c".into(), None)])
            .await
            .unwrap();
        assert!(store.load("r").await.is_err(), "the corrupt record is kept");
        std::fs::write(store.path(), "not json").unwrap();
        let fresh = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        let err = fresh.load("r").await.unwrap_err().to_string();
        assert!(err.contains("not a checkpoint document"), "{err}");
    }
}
