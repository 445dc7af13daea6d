//! The checkpoint store contract: where a sink keeps what its routes acknowledged, per object
//! key (`key → (uid, resourceVersion)`), so that a restart or a new leader resumes from it.
//! Each sink that can hold one implements [`CheckpointStore`] beside its own code (a file
//! beside a file sink, a compacted Kafka topic, a JetStream KV bucket); the pipeline's
//! `Checkpointer` records acknowledgements and writes them through it.

use std::collections::HashMap;

use futures::{FutureExt, future::BoxFuture};
use serde::{Deserialize, Serialize};

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
    /// A replica writes checkpoints only while its lease is valid.
    #[error("not leading: a replica writes checkpoints only while its lease is valid")]
    NotLeading,
}

/// The key under which a route's checkpoint records the cluster it belongs to (the uid of
/// its `kube-system` namespace) as the entry's uid. No object has this key: `:` is not allowed
/// in names.
pub const CLUSTER_KEY: &str = ":cluster";

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
    /// Handed over, not acknowledged yet (an intent: consumers may or may not have it). A
    /// resume publishes the object again even at the same resourceVersion, and its delete
    /// when it is gone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pending: bool,
    /// On the [`CLUSTER_KEY`] record only: the kind the route publishes (see [`RouteKind`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<RouteKind>,
}

/// The kind a route publishes, recorded with its cluster identity ([`CLUSTER_KEY`]): a
/// replica that starts after the kind stopped being served (its CRD deleted while nobody
/// published it) cannot learn it from discovery, yet must publish the deletes of the objects
/// the checkpoint holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteKind {
    /// `group/version`, or `version` for the core group.
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    /// The kind, `Widget`.
    pub kind: String,
    /// The resource, `widgets`.
    pub plural: String,
    /// Whether its objects live in namespaces.
    pub namespaced: bool,
}

/// A loaded checkpoint: entries by `namespace/name`.
pub type Checkpoint = HashMap<String, Entry, crate::FastHash>;

/// One change to write: `None` removes the key.
pub type Change = (String, Option<Entry>);

/// Where a sink keeps its routes' checkpoints.
pub trait CheckpointStore: Send + Sync {
    /// The store, for logs and errors (a file path, a topic, a bucket).
    fn describe(&self) -> String;

    /// The checkpoints of `routes` and of every other route whose name `also` accepts, read
    /// together; a route the store holds nothing for is absent. A record of one of them that
    /// cannot be read makes the load an error naming the route and key (the checkpoint
    /// would be incomplete, and a resume from it would lose or invent deletes). A store that
    /// cannot list its routes cheaply (NATS) finds the others by their [`CLUSTER_KEY`]
    /// record.
    fn load_family<'a>(
        &'a self,
        routes: &'a [String],
        also: &'a (dyn Fn(&str) -> bool + Send + Sync),
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>>;

    /// The checkpoints of `routes`, read together (see [`Self::load_family`]).
    fn load_routes<'a>(
        &'a self,
        routes: &'a [String],
    ) -> BoxFuture<'a, Result<HashMap<String, Checkpoint>>> {
        self.load_family(routes, &|_| false)
    }

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

    /// Applies each route's changes durably, in order, on behalf of route `owner` (a
    /// transactional store writes them all in `owner`'s transaction, so that they land
    /// together or not at all): how a route takes over the records of routes that no longer
    /// run (another shard count's) and removes them there.
    fn write_routes<'a>(
        &'a self,
        owner: &'a str,
        writes: Vec<(String, Vec<Change>)>,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = owner;
        async move {
            for (route, changes) in writes {
                self.write(&route, changes).await?;
            }
            Ok(())
        }
        .boxed()
    }
}
