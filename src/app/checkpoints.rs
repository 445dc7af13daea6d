//! Loading routes' checkpoints when this replica starts publishing, and routes that wait for
//! theirs.
//!
//! A route resumes only from a checkpoint that was read completely and that belongs to this
//! cluster (recorded under [`CLUSTER_KEY`]: the uid of the `kube-system` namespace). A route
//! whose checkpoint cannot be read (the store is down or slow, a read stalled) *waits*: its
//! listeners are off, so it publishes nothing (a replay without the deletes made meanwhile
//! would leave consumers with objects that no longer exist), `/readyz` names it and
//! `keb_checkpoint_waiting{route}` is 1, and a task reads again with backoff (1 s doubling
//! to 30 s) until the load succeeds; then the route's listeners are switched on after a fresh
//! list, as for a new leader. A checkpoint of another cluster is never resumed from: that
//! route waits for good (a start without leader election fails instead), naming both uids.
//! A checkpoint without identity (written before identities were recorded) is adopted.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::pipeline::{Checkpointer, Resumer};

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::Error;
use crate::{
    informer::SharedIndexInformer,
    metrics::Metrics,
    pipeline::checkpoint::{CLUSTER_KEY, Checkpoint},
    sinks::CheckpointStore,
};

/// One route's resume: its resumer and the checkpointer its workers record into.
pub(super) struct Resume {
    pub(super) resumer: Arc<Resumer>,
    pub(super) checkpointer: Arc<Checkpointer>,
    pub(super) interval: Duration,
}

/// Routes waiting for their checkpoint, with the reason (for `/readyz`).
pub(super) type WaitingRoutes = Arc<Mutex<BTreeMap<String, String>>>;

/// Why a route cannot resume.
#[derive(Debug, Clone)]
pub(super) enum Refusal {
    /// The store could not be read completely: read again later.
    Unreadable(String),
    /// The checkpoint belongs to another cluster: never resumed from.
    OtherCluster(String),
}

impl Refusal {
    fn reason(&self) -> &str {
        match self {
            Self::Unreadable(r) | Self::OtherCluster(r) => r,
        }
    }
}

/// Takes the cluster identity out of `checkpoint`: an error when it names another cluster.
fn check_cluster(
    route: &str,
    store: &dyn CheckpointStore,
    checkpoint: Option<Checkpoint>,
    cluster: &str,
) -> Result<Option<Checkpoint>, Refusal> {
    let Some(mut cp) = checkpoint else {
        return Ok(None);
    };
    match cp.remove(CLUSTER_KEY) {
        Some(recorded) if !cluster.is_empty() && recorded.uid != cluster => {
            Err(Refusal::OtherCluster(format!(
                "the checkpoint of route {route} in {} was written for another cluster (kube-system \
             uid {}), not this one ({cluster}): refusing to resume from it. Point the bridge at \
             the right cluster, or give this cluster its own checkpoint (sinks[].kafka.\
             checkpoint_topic, sinks[].nats.checkpoint_bucket, or another file)",
                store.describe(),
                recorded.uid
            )))
        }
        _ => Ok(Some(cp)),
    }
}

/// Loads the checkpoints of `resumes` (one read per store for all its routes) and begins each
/// route's resume. Returns the routes that could not begin (by position in `resumes`).
pub(super) async fn resume_from_checkpoints(
    resumes: &[&Resume],
    metrics: &Metrics,
    cluster: &str,
) -> Vec<(usize, Refusal)> {
    let mut by_store: Vec<(&Arc<dyn CheckpointStore>, Vec<usize>)> = Vec::new();
    for (i, r) in resumes.iter().enumerate() {
        let store = r.checkpointer.store();
        match by_store.iter_mut().find(|(s, _)| Arc::ptr_eq(s, store)) {
            Some((_, group)) => group.push(i),
            None => by_store.push((store, vec![i])),
        }
    }
    let mut refused = Vec::new();
    for (store, group) in by_store {
        let routes: Vec<String> = group
            .iter()
            .map(|&i| resumes[i].checkpointer.route().to_owned())
            .collect();
        // No write of these routes lands between the read and `knows` (see there).
        let _writes_held =
            futures::future::join_all(group.iter().map(|&i| resumes[i].checkpointer.hold_writes()))
                .await;
        let started = std::time::Instant::now();
        let mut loaded = match store.load_routes(&routes).await {
            Ok(loaded) => loaded,
            Err(err) => {
                let why = Refusal::Unreadable(format!("cannot read its checkpoint: {err}"));
                refused.extend(group.iter().map(|&i| (i, why.clone())));
                continue;
            }
        };
        let took = started.elapsed().as_secs_f64();
        for i in group {
            let r = resumes[i];
            let route = r.checkpointer.route();
            match check_cluster(route, store.as_ref(), loaded.remove(route), cluster) {
                Ok(checkpoint) => {
                    metrics
                        .checkpoint_load_seconds
                        .with_label_values(&[route])
                        .set(took);
                    metrics
                        .checkpoint_waiting
                        .with_label_values(&[route])
                        .set(0);
                    begin(r, checkpoint, cluster, store.as_ref(), took);
                }
                Err(why) => refused.push((i, why)),
            }
        }
    }
    refused
}

fn begin(
    r: &Resume,
    checkpoint: Option<Checkpoint>,
    cluster: &str,
    store: &dyn CheckpointStore,
    took: f64,
) {
    let route = r.checkpointer.route();
    match &checkpoint {
        Some(c) => info!(route, keys = c.len(), seconds = took, "Checkpoint loaded"),
        None => info!(
            route,
            store = %store.describe(),
            "No checkpoint yet: the initial list is published as initial adds"
        ),
    }
    if !cluster.is_empty() {
        r.checkpointer.record_cluster(cluster);
    }
    r.checkpointer.knows(checkpoint.as_ref());
    r.resumer.begin(checkpoint);
}

/// What a waiting route needs to retry on its own.
pub(super) struct Waiter {
    pub(super) resume_route: String,
    pub(super) resumer: Arc<crate::pipeline::Resumer>,
    pub(super) checkpointer: Arc<crate::pipeline::Checkpointer>,
    /// Its listeners' name prefix (`{queue}@`).
    pub(super) listeners: String,
    /// Its kind's informers, followed: a version switch may replace them while it waits.
    pub(super) informers: tokio::sync::watch::Receiver<Vec<Arc<SharedIndexInformer>>>,
}

/// Marks `w`'s route as waiting for `why` and, unless its checkpoint is of another cluster,
/// reads it again with backoff until it loads (then begins the resume and switches the route's
/// listeners on after a fresh list) or `term` ends.
pub(super) fn wait_for_checkpoint(
    w: Waiter,
    why: Refusal,
    cluster: String,
    term: CancellationToken,
    waiting: WaitingRoutes,
    metrics: Arc<Metrics>,
) {
    let route = w.resume_route.clone();
    mark_waiting(&waiting, &metrics, &route, Some(why.reason()));
    if let Refusal::OtherCluster(reason) = &why {
        error!(route = %route, "{reason}");
        return;
    }
    warn!(route = %route, reason = why.reason(), "The route publishes nothing until its checkpoint loads; retrying with backoff");
    let (waiting, metrics) = (waiting.clone(), metrics.clone());
    tokio::spawn(async move {
        let mut delay = Duration::from_secs(1);
        loop {
            tokio::select! {
                _ = term.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            let store = w.checkpointer.store().clone();
            // No write lands between the read and `knows` (see there).
            let writes_held = w.checkpointer.hold_writes().await;
            let started = std::time::Instant::now();
            let loaded = match store.load(&w.resume_route).await {
                Ok(cp) => check_cluster(&w.resume_route, store.as_ref(), cp, &cluster),
                Err(err) => Err(Refusal::Unreadable(format!(
                    "cannot read its checkpoint: {err}"
                ))),
            };
            let mark =
                |reason: Option<&str>| mark_waiting(&waiting, &metrics, &w.resume_route, reason);
            match loaded {
                Ok(checkpoint) => {
                    if term.is_cancelled() {
                        return;
                    }
                    let took = started.elapsed().as_secs_f64();
                    metrics
                        .checkpoint_load_seconds
                        .with_label_values(&[&w.resume_route])
                        .set(took);
                    w.checkpointer.knows(checkpoint.as_ref());
                    drop(writes_held);
                    w.resumer.begin(checkpoint.clone());
                    if !cluster.is_empty() {
                        w.checkpointer.record_cluster(&cluster);
                    }
                    info!(route = %w.resume_route, keys = checkpoint.as_ref().map_or(0, HashMap::len), "Checkpoint loaded after waiting; resuming");
                    mark(None);
                    // Each informer on its own: one that cannot list holds back only itself.
                    let prefix = &w.listeners;
                    let informers = w.informers.borrow().clone();
                    futures::future::join_all(informers.iter().map(|informer| {
                        informer.activate_listeners_after_relist(&term, |l| {
                            l.name().starts_with(prefix)
                        })
                    }))
                    .await;
                    return;
                }
                // The term ended meanwhile: its waiting entries are gone; so is this task.
                Err(_) if term.is_cancelled() => return,
                Err(Refusal::OtherCluster(reason)) => {
                    error!(route = %w.resume_route, "{reason}");
                    mark(Some(&reason));
                    return;
                }
                Err(Refusal::Unreadable(reason)) => {
                    warn!(route = %w.resume_route, reason = %reason, retry_in = ?delay, "Checkpoint still unreadable");
                    mark(Some(&reason));
                    delay = (delay * 2).min(Duration::from_secs(30));
                }
            }
        }
    });
}

/// Records whether `route` waits for its checkpoint, and why (`/readyz`, the gauge).
fn mark_waiting(waiting: &WaitingRoutes, metrics: &Metrics, route: &str, reason: Option<&str>) {
    let mut all = waiting.lock().unwrap_or_else(|e| e.into_inner());
    match reason {
        Some(r) => all.insert(route.to_owned(), r.to_owned()),
        None => all.remove(route),
    };
    metrics
        .checkpoint_waiting
        .with_label_values(&[route])
        .set(reason.is_some() as i64);
}

/// The start's error for a checkpoint of another cluster (without leader election).
pub(super) fn start_error(refusals: &[Refusal]) -> Option<Error> {
    refusals.iter().find_map(|why| match why {
        Refusal::OtherCluster(reason) => Some(Error::OtherCluster(reason.clone())),
        Refusal::Unreadable(_) => None,
    })
}
