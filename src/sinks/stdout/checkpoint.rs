//! The checkpoint store of a file sink: a JSON document beside the output file.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use futures::{FutureExt, future::BoxFuture};
use tracing::warn;

use crate::sinks::checkpoint::{Change, Checkpoint, CheckpointStore, Entry, Error, Result};

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
}
