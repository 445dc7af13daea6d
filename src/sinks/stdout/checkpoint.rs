//! The checkpoint store of a file sink: a log of JSON lines beside the output file.

use std::{
    collections::HashMap,
    io::Write,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use futures::{FutureExt, future::BoxFuture};
use serde::{Deserialize, Serialize};

use crate::sinks::checkpoint::{Change, Checkpoint, CheckpointStore, Entry, Error, Result};

/// The checkpoint store of a file sink: a log beside the output file (`<path>.checkpoint`),
/// [`HEADER`] and then one JSON line per write, `{"route": "…", "records": {"namespace/name":
/// {"uid", "resourceVersion", …}}, "removed": ["namespace/name"]}`, a key's later line
/// winning. A write appends its line and syncs it; when the log has grown past twice the
/// bytes it held when this process last compacted or loaded it (and past
/// [`COMPACT_AT_LEAST`]), the write also replaces it atomically (written to
/// `<path>.checkpoint.tmp`, synced, renamed, the directory synced) with one line per route.
/// Each write holds an exclusive lock on `<path>.checkpoint.lock`, so that processes sharing
/// the file (sharded replicas on one volume, each writing its shards' routes) never undo each
/// other's writes; a load takes no lock.
///
/// A write a crash cut short was never acknowledged: a load skips a last line without its
/// newline (unless it is whole), and a line with zeros (pages of it lost), with a warning;
/// the next write replaces the log without the former (a new file, so that a load reading
/// meanwhile sees one or the other). A write that fails after its line went in (its sync
/// failed, or it was given up meanwhile) may still be read: it holds what the sink had
/// acknowledged, which the retry writes again.
/// A line that cannot be read makes every load an error (it may hold any route's changes),
/// a record that cannot be read the load of its route; a compaction keeps such records as
/// they are and leaves a log with a line it cannot read as it is. A file written before the
/// log (one JSON document, `{"route": {"namespace/name": …}}`) is read and replaced by the
/// log at the first write.
pub struct FileCheckpointStore {
    path: PathBuf,
    /// The output file: synced to disk before each checkpoint write, so that a checkpoint
    /// never claims a line a node crash could still lose.
    output: PathBuf,
    // One write at a time in this process (the file lock serialises processes).
    writing: tokio::sync::Mutex<()>,
    /// The size of the log when it last held one line per route (this process's compaction
    /// or load): the log is compacted when it grows past twice that.
    compacted: Arc<AtomicU64>,
    /// [`COMPACT_AT_LEAST`], smaller in tests.
    compact_at_least: u64,
}

/// The log's first line.
const HEADER: &[u8] = b"{\"kube-event-bridge checkpoint log\":1}\n";

/// A log smaller than this is never compacted (a compaction reads and rewrites all of it).
const COMPACT_AT_LEAST: u64 = 1 << 20;

/// Each route's records, kept as the file's text: a compaction rewrites every route's records
/// (other processes' included), so it parses none of them into a tree (with 30,000 records
/// and twelve routes in one file, building and dropping `Value`s made a sharded replica's
/// first sync a fifth slower).
type Document = HashMap<String, HashMap<String, Record>>;

/// One record, as written.
type Record = Box<serde_json::value::RawValue>;

/// One line of the log: a write's changes to one route (each key once), or (compacted) all
/// its records.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    route: String,
    /// Records written (replacing the key's).
    #[serde(default)]
    records: HashMap<String, Record>,
    /// Keys removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    removed: Vec<String>,
}

impl Line {
    /// `records` with this line's changes.
    fn apply_to(self, records: &mut HashMap<String, Record>) {
        if records.is_empty() {
            // A compacted line, mostly: taken as it is (its keys are each there once).
            *records = self.records;
            return;
        }
        for key in &self.removed {
            records.remove(key);
        }
        records.extend(self.records);
    }
}

/// A route's records as a compacted line writes them.
#[derive(Serialize)]
struct Snapshot<'a> {
    route: &'a str,
    records: &'a HashMap<String, Record>,
}

impl FileCheckpointStore {
    /// The store beside the output file `output`.
    pub fn beside(output: &Path) -> Self {
        let mut name = output.as_os_str().to_owned();
        name.push(".checkpoint");
        Self {
            path: PathBuf::from(name),
            output: output.to_owned(),
            writing: tokio::sync::Mutex::new(()),
            compacted: Arc::default(),
            compact_at_least: COMPACT_AT_LEAST,
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

    /// Reads the file (none: an empty document), a log or a document written before it;
    /// blocking.
    fn read(path: &Path) -> std::result::Result<Document, String> {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
            Err(e) => return Err(format!("cannot read it: {e}")),
        };
        if text.is_empty() {
            return Ok(HashMap::new());
        }
        let Some(log) = text.strip_prefix(HEADER) else {
            let mut doc: Document = serde_json::from_slice(&text).map_err(|e| {
                format!(
                    "the file is not a checkpoint document ({e}), so every checkpoint in it is \
                     unknown; remove it to start over without checkpoints (every object is then \
                     published as added, and deletes made while down are not)"
                )
            })?;
            // Its records as one line each, for the log (a document edited by hand may be
            // spread over lines).
            for (route, records) in &mut doc {
                for (key, record) in records.iter_mut().filter(|(_, r)| r.get().contains('\n')) {
                    *record = serde_json::from_str::<serde_json::Value>(record.get())
                        .and_then(|v| serde_json::value::to_raw_value(&v))
                        .map_err(|e| format!("route {route}: the record of {key}: {e}"))?;
                }
            }
            return Ok(doc);
        };
        let mut doc = Document::new();
        for (n, line) in (2..).zip(log.split_inclusive(|b| *b == b'\n')) {
            // A write a crash cut short, never acknowledged: the last piece without its
            // newline (unless it is whole: a line whose newline an edit by hand took away),
            // or (pages of it lost) a line with zeros, which JSON never holds. (And a blank
            // line, from an edit by hand.)
            if line.last() != Some(&b'\n') {
                if let Ok(line) = serde_json::from_slice::<Line>(line) {
                    let records = doc.entry(line.route.clone()).or_default();
                    line.apply_to(records);
                }
                break;
            }
            if line.trim_ascii().is_empty() {
                continue;
            }
            if line.contains(&0) {
                tracing::warn!(
                    file = %path.display(),
                    "Line {n} of the checkpoint log holds zeros (a write a crash cut short, or \
                     pages the disk lost); it is skipped"
                );
                continue;
            }
            let line: Line = serde_json::from_slice(line).map_err(|e| {
                format!(
                    "line {n} of the log is not a checkpoint record ({e}), so every checkpoint \
                     in the file is unknown; remove that line to go on (the changes it held are \
                     then forgotten: their objects are published again, deletes among them are \
                     not), or the file to start over without checkpoints"
                )
            })?;
            let records = doc.entry(line.route.clone()).or_default();
            line.apply_to(records);
        }
        Ok(doc)
    }

    /// About the size of `doc` as a compacted log.
    fn size(doc: &Document) -> u64 {
        let records = |r: &HashMap<String, Record>| {
            r.iter()
                .map(|(k, v)| k.len() + v.get().len() + 4)
                .sum::<usize>()
        };
        let lines: usize = doc
            .iter()
            .map(|(route, r)| route.len() + 24 + records(r))
            .sum();
        (HEADER.len() + lines) as u64
    }

    /// Replaces the file at `path` with `doc` as a compacted log, through `tmp`, once `ready`
    /// agrees (with the new log on disk); blocking. Returns the log's size.
    fn replace(
        path: &Path,
        tmp: &Path,
        doc: &Document,
        ready: impl FnOnce() -> std::result::Result<(), String>,
    ) -> std::result::Result<u64, String> {
        let mut bytes = HEADER.to_vec();
        for (route, records) in doc {
            serde_json::to_writer(&mut bytes, &Snapshot { route, records })
                .map_err(|e| e.to_string())?;
            bytes.push(b'\n');
        }
        let written = std::fs::File::create(tmp)
            .and_then(|mut f| f.write_all(&bytes).and_then(|_| f.sync_all()))
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))
            .and_then(|_| ready())
            .and_then(|_| {
                std::fs::rename(tmp, path)
                    .map_err(|e| format!("cannot rename {} over it: {e}", tmp.display()))
            });
        if let Err(e) = written {
            // Not left beside it: a whole copy of the log.
            let _ = std::fs::remove_file(tmp);
            return Err(e);
        }
        // The rename itself durable: the directory synced. The new log is in place either
        // way (a failure here is no failed write: a filesystem may refuse to sync a
        // directory, and ext4 and XFS commit the rename with the next sync of the file).
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        if let Err(e) =
            std::fs::File::open(dir.unwrap_or(Path::new("."))).and_then(|d| d.sync_all())
        {
            tracing::warn!(file = %path.display(), "Cannot sync the checkpoint's directory: {e}");
        }
        Ok(bytes.len() as u64)
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

/// Where one write puts its line, holding the file lock; blocking.
struct Append<'a> {
    path: &'a Path,
    tmp: &'a Path,
    /// The write's changes, and as the log's line (newline included).
    changes: Line,
    line: Vec<u8>,
    /// Set when the write was given up: nothing is written after it is seen.
    abandoned: &'a AtomicBool,
    compacted: &'a AtomicU64,
    compact_at_least: u64,
}

/// An error once the write is given up (see [`Append::abandoned`]).
fn given_up(abandoned: &AtomicBool) -> std::result::Result<(), String> {
    if abandoned.load(Ordering::SeqCst) {
        return Err("given up before it was written".into());
    }
    Ok(())
}

impl Append<'_> {
    fn run(self) -> std::result::Result<(), String> {
        use std::os::unix::fs::FileExt;
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .open(self.path);
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return self.rewrite(),
            Err(e) => return Err(format!("cannot open it: {e}")),
        };
        let mut len = file
            .metadata()
            .map_err(|e| format!("cannot read its size: {e}"))?
            .len();
        let (mut head, mut last) = ([0; HEADER.len()], [0]);
        if len < HEADER.len() as u64
            || file.read_exact_at(&mut head, 0).is_err()
            || head[..] != *HEADER
            || file.read_exact_at(&mut last, len - 1).is_err()
            || last[0] != b'\n'
        {
            // A document written before the log, an empty file, or a last write a crash cut
            // short (never acknowledged): replaced by the log without it. Not cut off in
            // place: a load reading meanwhile (without the lock) could join the cut line's
            // start to this write's end.
            return self.rewrite();
        }
        given_up(self.abandoned)?;
        file.write_all(&self.line)
            .and_then(|_| file.sync_data())
            .map_err(|e| format!("cannot append to it: {e}"))?;
        len += self.line.len() as u64;
        if len > self.compact_at_least && len > 2 * self.compacted.load(Ordering::Relaxed) {
            // What the log holds does not change: a failure here fails no write.
            let compacted = FileCheckpointStore::read(self.path)
                .and_then(|doc| FileCheckpointStore::replace(self.path, self.tmp, &doc, || Ok(())));
            match compacted {
                Ok(size) => self.compacted.store(size, Ordering::Relaxed),
                Err(e) => {
                    tracing::warn!(
                        file = %self.path.display(),
                        "Cannot compact the checkpoint log (it grows until it can): {e}"
                    );
                    self.compacted.store(len, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// Writes the file anew as a compacted log, with this write's changes.
    fn rewrite(self) -> std::result::Result<(), String> {
        let mut doc = FileCheckpointStore::read(self.path)?;
        let records = doc.entry(self.changes.route.clone()).or_default();
        self.changes.apply_to(records);
        let abandoned = self.abandoned;
        let size = FileCheckpointStore::replace(self.path, self.tmp, &doc, || given_up(abandoned))?;
        self.compacted.store(size, Ordering::Relaxed);
        Ok(())
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
            self.compacted.store(Self::size(&all), Ordering::Relaxed);
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
            // In order: a key's later change wins.
            let latest: HashMap<String, Option<Entry>> = changes.into_iter().collect();
            let mut changes = Line {
                route: route.to_owned(),
                records: HashMap::new(),
                removed: Vec::new(),
            };
            for (key, entry) in latest {
                match entry {
                    Some(e) => {
                        let record = serde_json::value::to_raw_value(&e).expect("an entry is JSON");
                        changes.records.insert(key, record);
                    }
                    None => changes.removed.push(key),
                }
            }
            let mut line = serde_json::to_vec(&changes).expect("a line is JSON");
            line.push(b'\n');
            let (path, lock, tmp) = (
                self.path.clone(),
                self.beside_it(".lock"),
                self.beside_it(".tmp"),
            );
            let compacted = self.compacted.clone();
            let compact_at_least = self.compact_at_least;
            // Set when this write is given up (its future dropped: the lease's deadline passed
            // while it waited for the lock): the blocking work then writes nothing.
            struct GivenUp(Arc<AtomicBool>);
            impl Drop for GivenUp {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::SeqCst);
                }
            }
            let given_up = GivenUp(Arc::default());
            let abandoned = given_up.0.clone();
            let done = tokio::task::spawn_blocking(move || -> std::result::Result<(), String> {
                let lock = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&lock)
                    .map_err(|e| format!("cannot open {}: {e}", lock.display()))?;
                // Released when `lock` is dropped (closed).
                lock.lock()
                    .map_err(|e| format!("cannot lock {}: {e}", path.display()))?;
                Append {
                    path: &path,
                    tmp: &tmp,
                    changes,
                    line,
                    abandoned: &abandoned,
                    compacted: &compacted,
                    compact_at_least,
                }
                .run()
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

    fn entry(rv: usize) -> Option<Entry> {
        Some(Entry {
            uid: "u".into(),
            resource_version: rv.to_string(),
            pending: false,
            kind: None,
        })
    }

    /// The file's lines.
    fn lines(store: &FileCheckpointStore) -> Vec<String> {
        let text = std::fs::read_to_string(store.path()).unwrap();
        text.lines().map(String::from).collect()
    }

    #[tokio::test]
    async fn the_log_is_compacted_when_it_grows_past_twice_what_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let mut store = FileCheckpointStore::beside(&out);
        store.compact_at_least = 2048;
        for i in 0..300 {
            let mut changes = vec![(format!("ns/k{}", i % 20), entry(i))];
            if i == 290 {
                changes.push(("ns/k3".into(), None));
            }
            store.write("r", changes).await.unwrap();
        }
        let lines = lines(&store);
        assert_eq!(lines[0].as_bytes(), HEADER.trim_ascii_end());
        assert!(
            (2..60).contains(&lines.len()),
            "compacted now and then: {} lines",
            lines.len()
        );
        let size = std::fs::metadata(store.path()).unwrap().len();
        assert!(size < 2 * 2048 + 200, "{size} bytes");
        let loaded = FileCheckpointStore::beside(&out).load("r").await.unwrap();
        let loaded = loaded.unwrap();
        assert_eq!(loaded.len(), 19, "ns/k3 removed");
        assert!(!loaded.contains_key("ns/k3"));
        // Each key's last write wins, across compactions.
        for k in (0..20).filter(|k| *k != 3) {
            let last = (0..300).rev().find(|i| i % 20 == k).unwrap();
            assert_eq!(
                loaded[&format!("ns/k{k}")].resource_version,
                last.to_string()
            );
        }
    }

    /// A store whose log has route `r`'s `ns/a`, then `bytes` appended as they are.
    async fn with_a_line_then(bytes: &[u8]) -> (tempfile::TempDir, FileCheckpointStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        store
            .write("r", vec![("ns/a".into(), entry(1))])
            .await
            .unwrap();
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(store.path())
            .unwrap();
        f.write_all(bytes).unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn a_write_a_crash_cut_short_is_skipped_then_cut_off() {
        let (dir, store) = with_a_line_then(br#"{"route":"r","records":{"ns/x":{"uid""#).await;
        let out = dir.path().join("out.jsonl");
        let loaded = FileCheckpointStore::beside(&out).load("r").await.unwrap();
        assert_eq!(loaded.unwrap().len(), 1, "the cut line is not read");
        store
            .write("r", vec![("ns/b".into(), entry(2))])
            .await
            .unwrap();
        let text = std::fs::read_to_string(store.path()).unwrap();
        assert!(!text.contains("ns/x") && text.ends_with('\n'), "{text}");
        let loaded = FileCheckpointStore::beside(&out).load("r").await.unwrap();
        let loaded = loaded.unwrap();
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded["ns/b"].resource_version, "2");
    }

    #[tokio::test]
    async fn a_document_from_before_the_log_is_read_then_replaced_at_the_first_write() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let store = FileCheckpointStore::beside(&out);
        // Edited by hand: a record spread over lines, a route emptied, a record made null.
        std::fs::write(
            store.path(),
            r#"{"r": {"ns/a": {"uid": "u",
                               "resourceVersion": "1"}},
                "other": {"ns/c": {"uid": "u", "resourceVersion": "2"}},
                "emptied": {},
                "nulled": {"ns/n": null}}"#,
        )
        .unwrap();
        assert_eq!(store.load("r").await.unwrap().unwrap().len(), 1);
        store
            .write("r", vec![("ns/b".into(), entry(3))])
            .await
            .unwrap();
        assert_eq!(lines(&store)[0].as_bytes(), HEADER.trim_ascii_end());
        let reread = FileCheckpointStore::beside(&out);
        assert_eq!(reread.load("r").await.unwrap().unwrap().len(), 2);
        let other = reread.load("other").await.unwrap().unwrap();
        assert_eq!(other["ns/c"].resource_version, "2");
        assert_eq!(
            reread.load("emptied").await.unwrap(),
            Some(Checkpoint::default())
        );
        let err = reread.load("nulled").await.unwrap_err().to_string();
        assert!(err.contains("ns/n") && err.contains("corrupt"), "{err}");
    }

    /// A record of an old document spread over lines, with escapes, is one line of the log
    /// and reads back the same.
    #[tokio::test]
    async fn a_record_spread_over_lines_is_written_on_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        let record = "{ \"uid\" :\n \"x \\\" y\\\\\" , \"resourceVersion\": \"1\"}";
        std::fs::write(store.path(), format!("{{\"r\": {{\"ns/a\": {record}}}}}")).unwrap();
        store
            .write("o", vec![("ns/b".into(), entry(2))])
            .await
            .unwrap();
        let lines = lines(&store);
        assert_eq!(lines.len(), 3, "the header and a line per route: {lines:?}");
        let loaded = store.load("r").await.unwrap().unwrap();
        assert_eq!(loaded["ns/a"].uid, "x \" y\\");
    }

    #[tokio::test]
    async fn a_line_of_zeros_a_crash_left_or_a_blank_line_is_skipped() {
        let (dir, store) = with_a_line_then(b"\0\0\0\0ns/x\"}}\n").await;
        store
            .write("r", vec![("ns/b".into(), entry(2))])
            .await
            .unwrap();
        let reread = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        let loaded = reread.load("r").await.unwrap().unwrap();
        assert_eq!(loaded.len(), 2, "{loaded:?}");
        // Blank lines (an edit by hand) too.
        let (_dir, store) = with_a_line_then(b"\n  \n").await;
        assert_eq!(store.load("r").await.unwrap().unwrap().len(), 1);
    }

    /// A last line whose newline an edit took away is whole: read, and kept by the next write.
    #[tokio::test]
    async fn a_whole_last_line_without_its_newline_is_kept() {
        let (dir, store) = with_a_line_then(
            br#"{"route":"r","records":{"ns/c":{"uid":"u","resourceVersion":"3"}}}"#,
        )
        .await;
        assert_eq!(store.load("r").await.unwrap().unwrap().len(), 2);
        store
            .write("r", vec![("ns/b".into(), entry(2))])
            .await
            .unwrap();
        let reread = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        assert_eq!(reread.load("r").await.unwrap().unwrap().len(), 3);
    }

    #[tokio::test]
    async fn a_line_that_cannot_be_read_is_an_error_naming_it() {
        let (_dir, store) = with_a_line_then(b"{\"route\": 7}\n").await;
        store
            .write("r", vec![("ns/b".into(), entry(2))])
            .await
            .unwrap();
        let err = store.load("r").await.unwrap_err().to_string();
        assert!(err.contains("line 3 of the log"), "{err}");
        // A field misspelt by hand is no line that changes nothing.
        let (_dir, store) = with_a_line_then(b"{\"route\": \"r\", \"record\": {}}\n").await;
        let err = store.load("r").await.unwrap_err().to_string();
        assert!(
            err.contains("line 3 of the log") && err.contains("record"),
            "{err}"
        );
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
            // Compacting often: a compaction keeps the other process's lines too.
            let mut store = FileCheckpointStore::beside(&out);
            store.compact_at_least = 512;
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
