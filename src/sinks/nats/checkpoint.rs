//! The checkpoint store of a `nats` sink in `jetstream` mode: a key-value bucket
//! (`checkpoint_bucket`) with one key per route and object, `{route}.{namespace/name}` with
//! every character a KV key does not allow (and `_`, `.`) written `_XX` (hex), and the value
//! `{"uid", "resourceVersion"}`; the key is deleted once the object's delete was acknowledged.
//!
//! A load reads the newest record of every key of the route (a pull consumer delivering the
//! last message per subject, as many as it says are pending); writes are KV puts and
//! deletes, acknowledged by the stream, many at once.
//!
//! # Recovery
//! Every step of a load (opening the bucket, listing routes, making the consumer, each
//! record) must answer within [`READ_STALL`]: a server that stops answering (frozen, its
//! JetStream stalled, a leader election under way) fails the load then, rather than after the
//! pull consumer's missed heartbeats (about 30 s). The route then waits and reads again with
//! backoff (`app::checkpoints`: `/readyz` names it, `keb_checkpoint_waiting` is 1).

use std::{collections::HashMap, sync::Arc};

use async_nats::jetstream::{self, kv};
use futures::{FutureExt, StreamExt, TryStreamExt, future::BoxFuture};
use tracing::info;

use super::{
    client::{Conn, Conns, ShardConns},
    config::NatsSinkConfig,
    sink::NatsSink,
};
use crate::{
    sinks,
    sinks::checkpoint::{CLUSTER_KEY, Change, Checkpoint, CheckpointStore, Entry, Error, Result},
};

/// Writes waiting for their acknowledgement at once.
const WRITES_IN_FLIGHT: usize = 256;

/// How long a checkpoint load waits for any one answer of the server (see the module docs).
pub const READ_STALL: std::time::Duration = std::time::Duration::from_secs(5);

/// See the module docs.
pub struct NatsCheckpointStore {
    bucket: String,
    /// The sink's connections: the store reads on the current term's, and writes there
    /// unless the route is a shard's.
    conns: Arc<Conns>,
    /// The shard views' connections: a shard route's writes go on its shard's term's, so
    /// that what the connection of an ended term still buffers never lands after a newer
    /// owner's writes (it is retired with the term).
    shard_conns: ShardConns,
    /// The sink's name (the end of its routes' names).
    sink: String,
}

/// A KV key token for `s`: `[A-Za-z0-9-/=]` as they are, everything else `_XX`.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'/' | b'=') {
            out.push(b as char);
        } else {
            out.push_str(&format!("_{b:02X}"));
        }
    }
    out
}

fn unescape(s: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(s.len());
    let mut it = s.bytes();
    while let Some(b) = it.next() {
        if b == b'_' {
            let hex = [it.next()?, it.next()?];
            bytes.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else {
            bytes.push(b);
        }
    }
    String::from_utf8(bytes).ok()
}

impl NatsCheckpointStore {
    /// The store of sink `name`. Creates the bucket when it does not exist; a bucket that
    /// cannot be created or opened fails the start, naming it.
    pub async fn open(name: &str, cfg: &NatsSinkConfig, sink: &NatsSink) -> sinks::Result<Self> {
        let bucket = cfg.checkpoint_bucket.clone();
        let setup = |what: String| {
            sinks::Error::Setup(format!("sink {name}: checkpoint bucket {bucket}: {what}"))
        };
        let conns = sink.conns();
        let conn = conns
            .current()
            .expect("the sink's own connections always have one");
        let js: &jetstream::Context = conn
            .jetstream()
            .ok_or_else(|| setup("resume needs jetstream mode".into()))?;
        match js.get_key_value(&bucket).await {
            Ok(kv) => kv,
            // Any failure to open it is treated as "missing": creating it then either works
            // or fails naming both causes.
            Err(open_error) => {
                // The bucket's stream, as `create_key_value` would make it; created directly
                // because that call first asks for account limits in a form nats-server
                // before 2.10 does not answer.
                let config = jetstream::stream::Config {
                    name: format!("KV_{bucket}"),
                    subjects: vec![format!("$KV.{bucket}.>")],
                    max_messages_per_subject: 1,
                    storage: jetstream::stream::StorageType::File,
                    allow_rollup: true,
                    deny_delete: true,
                    allow_direct: true,
                    discard: jetstream::stream::DiscardPolicy::New,
                    num_replicas: 1,
                    ..Default::default()
                };
                let denied = |e: &dyn std::fmt::Display| {
                    setup(format!(
                        "cannot create it ({e}; opening it failed first: {open_error}); create it \
                         or allow this user to manage the stream KV_{bucket} and publish to \
                         $KV.{bucket}.>"
                    ))
                };
                js.create_stream(config).await.map_err(|e| denied(&e))?;
                info!(sink = %name, bucket = %bucket, "Created the checkpoint bucket");
                js.get_key_value(&bucket).await.map_err(|e| denied(&e))?
            }
        };
        Ok(Self {
            bucket,
            conns,
            shard_conns: sink.shard_conns(),
            sink: name.to_owned(),
        })
    }

    /// The bucket on the current term's connection.
    async fn kv(&self) -> Result<(Arc<Conn>, kv::Store)> {
        self.kv_on(&self.conns).await
    }

    /// The bucket on the connection route `route` writes on: its shard's term's when it is
    /// a shard route.
    async fn kv_for(&self, route: &str) -> Result<(Arc<Conn>, kv::Store)> {
        let label = crate::shard::label_of_route(route, &self.sink);
        let shard = (!label.is_empty())
            .then(|| {
                self.shard_conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(label)
                    .cloned()
            })
            .flatten();
        match shard {
            Some(conns) => self.kv_on(&conns).await,
            None => self.kv().await,
        }
    }

    async fn kv_on(&self, conns: &Conns) -> Result<(Arc<Conn>, kv::Store)> {
        let conn = conns.open().map_err(|e| self.error(e))?;
        let store = conn
            .kv(async |js| js.get_key_value(&self.bucket).await)
            .await
            .map_err(|e| self.error(e))?
            .clone();
        Ok((conn, store))
    }

    fn error(&self, reason: impl std::fmt::Display) -> Error {
        Error::Store {
            store: self.describe(),
            reason: reason.to_string(),
        }
    }

    /// `step` of a load, failed when the server gives no answer within [`READ_STALL`].
    async fn answered<T>(
        &self,
        what: &str,
        step: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(READ_STALL, step)
            .await
            .unwrap_or_else(|_| {
                Err(self.error(format!(
                    "{what}: no answer from the server within {}s; the read is tried again",
                    READ_STALL.as_secs()
                )))
            })
    }
}

impl CheckpointStore for NatsCheckpointStore {
    fn describe(&self) -> String {
        format!("bucket {}", self.bucket)
    }

    fn load_family<'a>(
        &'a self,
        routes: &'a [String],
        also: &'a (dyn Fn(&str) -> bool + Send + Sync),
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>> {
        async move {
            // One consumer per route, each filtered to the route's keys: no route's read
            // walks another's records.
            let mut all = self.load_routes(routes).await?;
            // The others by their cluster key: one subject per route, listed by the server.
            for route in self.routes_with_cluster_key().await? {
                if also(&route)
                    && !routes.contains(&route)
                    && let Some(checkpoint) = self.load_route(&route).await?
                {
                    all.insert(route, checkpoint);
                }
            }
            Ok(all)
        }
        .boxed()
    }

    fn load_routes<'a>(
        &'a self,
        routes: &'a [String],
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>> {
        async move {
            let mut all = HashMap::new();
            for route in routes {
                if let Some(checkpoint) = self.load_route(route).await? {
                    all.insert(route.clone(), checkpoint);
                }
            }
            Ok(all)
        }
        .boxed()
    }

    fn write<'a>(&'a self, route: &'a str, changes: Vec<Change>) -> BoxFuture<'a, Result<()>> {
        self.write_on(route, route, changes).boxed()
    }

    /// Writes on the connection of `owner`'s shard (see [`Self::write_on`]).
    fn write_routes<'a>(
        &'a self,
        owner: &'a str,
        writes: Vec<(String, Vec<Change>)>,
    ) -> BoxFuture<'a, Result<()>> {
        async move {
            for (route, changes) in writes {
                self.write_on(owner, &route, changes).await?;
            }
            Ok(())
        }
        .boxed()
    }
}

impl NatsCheckpointStore {
    /// Applies `changes` to the checkpoint of `route`, on the connection route `owner` writes
    /// on (a route taking over another shard count's records writes them, and removes them
    /// there, on its own shard's term's connection).
    async fn write_on(&self, owner: &str, route: &str, changes: Vec<Change>) -> Result<()> {
        let prefix = escape(route);
        let (_conn, kv) = self.kv_for(owner).await?;
        let kv = &kv;
        futures::stream::iter(changes)
            .map(|(key, entry)| {
                let k = format!("{prefix}.{}", escape(&key));
                async move {
                    match entry {
                        Some(e) => {
                            let v = serde_json::to_vec(&e).expect("strings serialize");
                            kv.put(k, v.into())
                                .await
                                .map(|_| ())
                                .map_err(|e| self.error(e))
                        }
                        None => kv.delete(k).await.map_err(|e| self.error(e)),
                    }
                }
            })
            .buffer_unordered(WRITES_IN_FLIGHT)
            .try_collect::<Vec<()>>()
            .await
            .map(|_| ())
    }
}

impl NatsCheckpointStore {
    /// Every route that holds (or held: a delete marker counts) a [`CLUSTER_KEY`] record.
    async fn routes_with_cluster_key(&self) -> Result<Vec<String>> {
        let (_conn, kv) = self.answered("opening the bucket", self.kv()).await?;
        let prefix = format!("$KV.{}.", self.bucket);
        let suffix = format!(".{}", escape(CLUSTER_KEY));
        let subjects: Vec<(String, usize)> = self
            .answered("listing the routes", async {
                kv.stream
                    .info_with_subjects(format!("{prefix}*{suffix}"))
                    .await
                    .map_err(|e| self.error(e))?
                    .try_collect()
                    .await
                    .map_err(|e| self.error(e))
            })
            .await?;
        Ok(subjects
            .into_iter()
            .filter_map(|(subject, _)| {
                unescape(subject.strip_prefix(&prefix)?.strip_suffix(&suffix)?)
            })
            .collect())
    }

    /// The checkpoint of one route, `None` when the bucket holds nothing for it.
    async fn load_route(&self, route: &str) -> Result<Option<Checkpoint>> {
        let prefix = format!("$KV.{}.{}.", self.bucket, escape(route));
        let mut all = HashMap::new();
        self.read_last(
            &format!("{prefix}>"),
            |subject| Some((route.to_owned(), subject.strip_prefix(&prefix)?.to_owned())),
            &mut all,
        )
        .await?;
        Ok(all.remove(route))
    }

    /// Reads the newest record of every key under `filter` into `into`: `route_key` names
    /// the route and the escaped key of a subject (`None`: not wanted, skipped unread).
    async fn read_last(
        &self,
        filter: &str,
        route_key: impl Fn(&str) -> Option<(String, String)>,
        into: &mut HashMap<String, Checkpoint>,
    ) -> Result<()> {
        use jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
        // The newest record of every key; `num_pending` says how many there are, so the
        // read knows its end (a KV watch would have to guess it from quiet).
        let (_conn, kv) = self.answered("opening the bucket", self.kv()).await?;
        let consumer = self
            .answered("making the reading consumer", async {
                kv.stream
                    .create_consumer(pull::Config {
                        filter_subject: filter.to_owned(),
                        deliver_policy: DeliverPolicy::LastPerSubject,
                        ack_policy: AckPolicy::None,
                        inactive_threshold: std::time::Duration::from_secs(60),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| self.error(e))
            })
            .await?;
        let pending = consumer.cached_info().num_pending;
        if pending == 0 {
            return Ok(());
        }
        let mut messages = self
            .answered("starting the read", async {
                consumer.messages().await.map_err(|e| self.error(e))
            })
            .await?;
        for read in 0..pending {
            let message = self
                .answered(&format!("record {} of {pending}", read + 1), async {
                    messages
                        .next()
                        .await
                        .ok_or_else(|| self.error("the read ended early"))?
                        .map_err(|e| self.error(e))
                })
                .await?;
            let Some((route, raw)) = route_key(message.subject.as_str()) else {
                continue;
            };
            let deleted = message
                .headers
                .as_ref()
                .and_then(|h| h.get("KV-Operation"))
                .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"));
            let checkpoint = into.entry(route.clone()).or_default();
            match unescape(&raw) {
                None => {
                    return Err(self.error(format!(
                        "route {route}: the key of {} cannot be read, so the checkpoint is \
                         incomplete; purge that key to go on",
                        message.subject
                    )));
                }
                Some(key) if deleted => {
                    checkpoint.remove(&key);
                }
                Some(key) => match serde_json::from_slice::<Entry>(&message.payload) {
                    Ok(e) => {
                        checkpoint.insert(key, e);
                    }
                    Err(e) => {
                        return Err(self.error(format!(
                            "route {route}: the record of {key} is corrupt ({e}), so the \
                             checkpoint is incomplete; delete that key to go on (its object \
                             is then published as added)"
                        )));
                    }
                },
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_escape_to_valid_kv_tokens_and_back() {
        for s in ["configmap/out", "ns/my.config", "a_b", "ns/ä", "name"] {
            let e = escape(s);
            assert!(
                e.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '/' | '=' | '_')),
                "{e}"
            );
            assert_eq!(unescape(&e).as_deref(), Some(s));
        }
        assert_eq!(escape("ns/my.config"), "ns/my_2Econfig");
    }
}
