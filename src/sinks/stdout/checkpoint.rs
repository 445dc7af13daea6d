//! The checkpoint store of a file sink: a JSON document beside the output file.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use futures::{FutureExt, future::BoxFuture};
use serde::Deserialize;

use crate::sinks::checkpoint::{Change, Checkpoint, CheckpointStore, Entry, Error, Result};

/// The checkpoint store of a file sink: one JSON document beside the output file
/// (`<path>.checkpoint`), `{"route": {"namespace/name": {"uid", "resourceVersion"}}}`,
/// replaced atomically (written to a temporary file, synced, renamed) at each write. A file
/// or a record that cannot be read makes the load of the routes it concerns an error (the
/// checkpoint would be incomplete); a rewrite keeps such records as they are.
pub struct FileCheckpointStore {
    path: PathBuf,
    /// The output file: synced to disk before each checkpoint write, so that a checkpoint
    /// never claims a line a node crash could still lose.
    output: PathBuf,
    // The whole document as last read or written, records as read (a corrupt one is kept,
    // not dropped); every write rewrites the file from it, and every load reads it again.
    routes: tokio::sync::Mutex<Option<Document>>,
}

type Document = HashMap<String, HashMap<String, serde_json::Value>>;

impl FileCheckpointStore {
    /// The store beside the output file `output`.
    pub fn beside(output: &Path) -> Self {
        let mut name = output.as_os_str().to_owned();
        name.push(".checkpoint");
        Self {
            path: PathBuf::from(name),
            output: output.to_owned(),
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

    /// Reads the file (none: an empty document).
    async fn read(&self) -> Result<Document> {
        let text = match tokio::fs::read(&self.path).await {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
            Err(e) => return Err(self.error(e)),
        };
        serde_json::from_slice(&text).map_err(|e| {
            self.error(format!(
                "the file is not a checkpoint document ({e}), so every checkpoint in it is \
                 unknown; remove it to start over without checkpoints (every object is then \
                 published as added, and deletes made while down are not)"
            ))
        })
    }

    /// The checkpoint of `route` in `doc`: an error names a record that cannot be read.
    fn decode(
        &self,
        route: &str,
        records: &HashMap<String, serde_json::Value>,
    ) -> Result<Checkpoint> {
        records
            .iter()
            .map(|(key, value)| match Entry::deserialize(value) {
                Ok(entry) => Ok((key.clone(), entry)),
                Err(e) => Err(self.error(format!(
                    "route {route}: the record of {key} is corrupt ({e}), so the checkpoint is \
                     incomplete; remove that record to go on (its object is then published as \
                     added)"
                ))),
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
            // Always from disk: a new leader must see what the previous one wrote.
            let mut cached = self.routes.lock().await;
            let all = self.read().await?;
            let found = all
                .iter()
                .filter(|(r, _)| wanted(r))
                .map(|(r, c)| Ok((r.clone(), self.decode(r, c)?)))
                .collect::<Result<_>>();
            *cached = Some(all);
            found
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
                    Some(e) => {
                        entries.insert(key, serde_json::to_value(e).expect("an entry is JSON"))
                    }
                    None => entries.remove(&key),
                };
            }
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

    #[tokio::test]
    async fn the_routes_of_one_store_load_in_one_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        let entry = |rv: &str| {
            Some(Entry {
                uid: "u".into(),
                resource_version: rv.into(),
                pending: false,
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
