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

use super::error::Error;
use crate::{
    informer::SharedIndexInformer,
    metrics::Metrics,
    pipeline::checkpoint::{CLUSTER_KEY, Change, Checkpoint, Entry},
    shard::Shard,
    sinks::CheckpointStore,
};

/// One route's resume: its resumer and the checkpointer its workers record into.
pub(super) struct Resume {
    pub(super) resumer: Arc<Resumer>,
    pub(super) checkpointer: Arc<Checkpointer>,
    pub(super) interval: Duration,
    pub(super) family: Family,
}

/// Which kind, sink and shard a route serves: its name is `{base}/{sink}` in single-leader
/// mode and `{base}#{i}-of-{m}/{sink}` with `m` shards. The routes of the same kind and sink
/// under another shard count are its *family*: after a change of `sharding.shards` they hold
/// what consumers have of this route's objects (see [`take_over`]).
#[derive(Debug, Clone)]
pub(super) struct Family {
    pub(super) base: String,
    pub(super) sink: String,
    pub(super) shard: Shard,
}

impl Family {
    /// The shard of `route` when it is of this family under another shard count.
    pub(super) fn sibling(&self, route: &str) -> Option<Shard> {
        let middle = route
            .strip_prefix(self.base.as_str())?
            .strip_suffix(self.sink.as_str())?
            .strip_suffix('/')?;
        let shard = if middle.is_empty() {
            Shard::WHOLE
        } else {
            Shard::from_label(middle.strip_prefix('#')?).filter(|s| s.count > 1)?
        };
        (shard.count != self.shard.count).then_some(shard)
    }
}

/// What a route resumes from once its family's records are taken over.
#[derive(Debug, Default, PartialEq)]
pub(super) struct TakenOver {
    /// The checkpoint to resume from.
    pub(super) checkpoint: Option<Checkpoint>,
    /// The writes that move the records: the winners into the route, and the removal of
    /// every record of this route's shard from the others (with their cluster key once they
    /// hold nothing else).
    pub(super) writes: Vec<(String, Vec<Change>)>,
    /// Entries taken from other routes.
    pub(super) taken: usize,
}

/// Whether checkpoint entry `a` is newer than `b`: a greater resourceVersion (they are
/// etcd revisions, compared as numbers), or the same one pending (a resume re-sends it). An
/// entry whose resourceVersion is not a number is not newer.
fn newer(a: &Entry, b: &Entry) -> bool {
    match (
        a.resource_version.parse::<u64>(),
        b.resource_version.parse::<u64>(),
    ) {
        (Ok(x), Ok(y)) => x > y || (x == y && a.pending && !b.pending),
        _ => false,
    }
}

/// Takes over what the routes of `shard`'s family under other shard counts (`siblings`, their
/// cluster keys removed) hold of its objects, into `own` (this route's checkpoint): per key,
/// the newest entry. A change of `sharding.shards` so loses nothing: a key whose object was
/// deleted while the count changed is in the checkpoint, so its delete is published, and
/// an unchanged object is not replayed. Taking more than needed only costs duplicates (an
/// entry of a key that is gone by now publishes its delete again), never a lost delete.
pub(super) fn take_over(
    route: &str,
    shard: Shard,
    own: Option<Checkpoint>,
    siblings: Vec<(String, Checkpoint)>,
) -> TakenOver {
    if siblings.is_empty() {
        return TakenOver {
            checkpoint: own,
            ..TakenOver::default()
        };
    }
    let had_own = own.is_some();
    let mut merged = own.unwrap_or_default();
    let mut copied: BTreeMap<String, Entry> = BTreeMap::new();
    let mut writes = Vec::new();
    let mut taken = 0;
    for (sibling, entries) in siblings {
        let (ours, rest): (Vec<_>, Vec<_>) = entries
            .into_iter()
            .partition(|(key, _)| shard.holds_key(key));
        let mut removed: Vec<Change> = Vec::new();
        for (key, entry) in ours {
            removed.push((key.clone(), None));
            taken += 1;
            if merged.get(&key).is_none_or(|have| newer(&entry, have)) {
                merged.insert(key.clone(), entry.clone());
                copied.insert(key, entry);
            }
        }
        if rest.is_empty() {
            removed.push((CLUSTER_KEY.to_owned(), None));
        }
        removed.sort_by(|a, b| a.0.cmp(&b.0));
        writes.push((sibling, removed));
    }
    let copied: Vec<Change> = copied.into_iter().map(|(k, e)| (k, Some(e))).collect();
    if !copied.is_empty() {
        // Into the route first: a removal never lands before what it moved.
        writes.insert(0, (route.to_owned(), copied));
    }
    TakenOver {
        // A route with no checkpoint that took nothing over starts as one would: its first
        // list is the objects' initial adds.
        checkpoint: (had_own || taken > 0).then_some(merged),
        writes,
        taken,
    }
}

/// Loads the checkpoints of `routes` (each with its family and checkpointer) from `store`,
/// takes over their families' records (see [`take_over`]) and writes the moves (only while
/// the route's fence is valid: a deposed owner moves nothing). Per route, in order: its
/// checkpoint, or why it cannot resume.
async fn load_taking_over(
    store: &dyn CheckpointStore,
    routes: &[(&str, &Family, &Checkpointer)],
    cluster: &str,
) -> Vec<Result<Option<Checkpoint>, Refusal>> {
    let names: Vec<String> = routes.iter().map(|(r, ..)| (*r).to_owned()).collect();
    let siblings = |name: &str| routes.iter().any(|(_, f, _)| f.sibling(name).is_some());
    let mut loaded = match store.load_family(&names, &siblings).await {
        Ok(loaded) => loaded,
        Err(err) => {
            let why = Refusal::Unreadable(format!("cannot read its checkpoint: {err}"));
            return routes.iter().map(|_| Err(why.clone())).collect();
        }
    };
    let mut out = Vec::new();
    for (route, family, checkpointer) in routes {
        let own = match check_cluster(route, store, loaded.remove(*route), cluster) {
            Ok(own) => own,
            Err(why) => {
                out.push(Err(why));
                continue;
            }
        };
        let mut siblings = Vec::new();
        let mut emptied = Vec::new();
        for (name, checkpoint) in loaded.iter().filter(|(n, _)| family.sibling(n).is_some()) {
            match check_cluster(name, store, Some(checkpoint.clone()), cluster) {
                Ok(Some(c)) if !c.is_empty() => siblings.push((name.clone(), c)),
                // Only its cluster key is left (its records were taken over before).
                Ok(_) if checkpoint.contains_key(CLUSTER_KEY) => emptied.push(name.clone()),
                Ok(_) => {}
                // Not this cluster's: another cluster sharing the store, with another count.
                Err(why) => {
                    warn!(route, other = %name, reason = why.reason(), "Not taking over the checkpoint of another cluster's route")
                }
            }
        }
        siblings.sort_by(|a, b| a.0.cmp(&b.0));
        let others: Vec<String> = siblings.iter().map(|(n, _)| n.clone()).collect();
        let mut taken = take_over(route, family.shard, own, siblings);
        taken.writes.extend(
            emptied
                .into_iter()
                .map(|name| (name, vec![(CLUSTER_KEY.to_owned(), None)])),
        );
        taken.writes.retain(|(_, changes)| !changes.is_empty());
        if !taken.writes.is_empty() {
            if checkpointer.is_fenced() {
                out.push(Err(Refusal::Unreadable(
                    "its lease lapsed while it took over another shard count's checkpoint \
                     records"
                        .into(),
                )));
                continue;
            }
            let writes = taken.writes.iter().map(|(_, c)| c.len()).sum::<usize>();
            if let Err(err) = store.write_routes(route, taken.writes).await {
                out.push(Err(Refusal::Unreadable(format!(
                    "cannot take over the checkpoint records of {} (another shard count's \
                     routes): {err}",
                    others.join(", ")
                ))));
                continue;
            }
            if taken.taken > 0 {
                info!(route, from = ?others, entries = taken.taken, writes, "Took over the checkpoint records of this shard from the routes of another shard count");
            }
        }
        out.push(Ok(taken.checkpoint));
    }
    out
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
        let routes: Vec<(&str, &Family, &Checkpointer)> = group
            .iter()
            .map(|&i| {
                let r = resumes[i];
                (r.checkpointer.route(), &r.family, r.checkpointer.as_ref())
            })
            .collect();
        // No write of these routes lands between the read and `knows` (see there).
        let _writes_held =
            futures::future::join_all(group.iter().map(|&i| resumes[i].checkpointer.hold_writes()))
                .await;
        let started = std::time::Instant::now();
        let loaded = load_taking_over(store.as_ref(), &routes, cluster).await;
        let took = started.elapsed().as_secs_f64();
        for (i, checkpoint) in group.into_iter().zip(loaded) {
            let r = resumes[i];
            let route = r.checkpointer.route();
            match checkpoint {
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
    pub(super) family: Family,
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
            let loaded = load_taking_over(
                store.as_ref(),
                &[(w.resume_route.as_str(), &w.family, w.checkpointer.as_ref())],
                &cluster,
            )
            .await
            .pop()
            .expect("one per route");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(rv: u64) -> Entry {
        Entry {
            uid: format!("uid-{rv}"),
            resource_version: rv.to_string(),
            pending: false,
            kind: None,
        }
    }

    fn family(base: &str, shard: Shard) -> Family {
        Family {
            base: base.into(),
            sink: "team/out".into(),
            shard,
        }
    }

    #[test]
    fn a_routes_family_is_its_kind_and_sink_under_other_shard_counts() {
        let f = family("configmap", Shard { index: 1, count: 3 });
        let s = |index, count| Some(Shard { index, count });
        assert_eq!(f.sibling("configmap/team/out"), Some(Shard::WHOLE));
        assert_eq!(f.sibling("configmap#0-of-2/team/out"), s(0, 2));
        assert_eq!(f.sibling("configmap#11-of-12/team/out"), s(11, 12));
        // The same count is not a sibling (its own shard or a peer's), nor other kinds or
        // sinks, nor malformed names.
        for other in [
            "configmap#1-of-3/team/out",
            "configmap#0-of-3/team/out",
            "configmaps#0-of-2/team/out",
            "configmap#0-of-2/out",
            "configmap#0-of-2/team/out2",
            "configmap#2-of-2/team/out",
            "configmap#x-of-2/team/out",
            "configmap#0-of-1/team/out",
            "all/configmap#0-of-2/team/out",
        ] {
            assert_eq!(f.sibling(other), None, "{other}");
        }
        let whole = family("all/widgets.example.com", Shard::WHOLE);
        assert_eq!(
            whole.sibling("all/widgets.example.com#1-of-2/team/out"),
            s(1, 2)
        );
        assert_eq!(whole.sibling("all/widgets.example.com/team/out"), None);
    }

    /// Two namespaces that fall into different shards of 2.
    fn split_namespaces() -> (String, String) {
        let two = |i| Shard { index: i, count: 2 };
        let pick = |i| {
            (0..)
                .map(|n| format!("ns-{n}"))
                .find(|ns| two(i).holds_namespace(ns))
                .unwrap()
        };
        (pick(0), pick(1))
    }

    #[test]
    fn a_new_shard_count_takes_over_its_keys_newest_first_and_removes_them_there() {
        let (a, b) = split_namespaces();
        let route = "configmap#0-of-2/out";
        let shard = Shard { index: 0, count: 2 };
        // Under 3 shards, then under 1 (left over from an earlier change), and its own.
        let three: Checkpoint = [
            (format!("{a}/x"), entry(10)),
            (format!("{a}/y"), entry(7)),
            (format!("{b}/z"), entry(9)),
        ]
        .into_iter()
        .collect();
        let one: Checkpoint = [(format!("{a}/x"), entry(5)), (format!("{a}/old"), entry(3))]
            .into_iter()
            .collect();
        let own: Checkpoint = [(format!("{a}/y"), entry(8))].into_iter().collect();
        let taken = take_over(
            route,
            shard,
            Some(own),
            vec![
                ("configmap#2-of-3/out".into(), three),
                ("configmap/out".into(), one),
            ],
        );
        let checkpoint = taken.checkpoint.unwrap();
        // Newest per key; the other shard's key is not taken.
        assert_eq!(checkpoint[&format!("{a}/x")], entry(10));
        assert_eq!(checkpoint[&format!("{a}/y")], entry(8));
        assert_eq!(checkpoint[&format!("{a}/old")], entry(3));
        assert!(!checkpoint.contains_key(&format!("{b}/z")));
        assert_eq!(taken.taken, 4);
        // The winners are written into the route first, then removed where they were; a
        // route left with nothing loses its cluster key too.
        assert_eq!(
            taken.writes,
            vec![
                (
                    route.to_owned(),
                    vec![
                        (format!("{a}/old"), Some(entry(3))),
                        (format!("{a}/x"), Some(entry(10))),
                    ]
                ),
                (
                    "configmap#2-of-3/out".to_owned(),
                    vec![(format!("{a}/x"), None), (format!("{a}/y"), None)]
                ),
                (
                    "configmap/out".to_owned(),
                    vec![
                        (CLUSTER_KEY.to_owned(), None),
                        (format!("{a}/old"), None),
                        (format!("{a}/x"), None),
                    ]
                ),
            ]
        );
    }

    #[test]
    fn without_another_count_nothing_moves_and_a_pending_entry_wins_a_tie() {
        let own: Checkpoint = [("ns/a".to_owned(), entry(4))].into_iter().collect();
        let alone = take_over("cm/out", Shard::WHOLE, Some(own.clone()), vec![]);
        assert_eq!(alone.checkpoint, Some(own.clone()));
        assert!(alone.writes.is_empty());
        assert_eq!(
            take_over("cm/out", Shard::WHOLE, None, vec![]).checkpoint,
            None
        );
        // A route with no checkpoint of its own resumes from its family's.
        let pending = Entry {
            pending: true,
            ..entry(4)
        };
        let sibling: Checkpoint = [("ns/a".to_owned(), pending.clone())].into_iter().collect();
        let taken = take_over(
            "cm/out",
            Shard::WHOLE,
            Some(own),
            vec![("cm#1-of-2/out".into(), sibling.clone())],
        );
        assert_eq!(taken.checkpoint.unwrap()["ns/a"], pending);
        let fresh = take_over(
            "cm/out",
            Shard::WHOLE,
            None,
            vec![("cm#1-of-2/out".into(), sibling)],
        );
        assert_eq!(fresh.checkpoint.unwrap()["ns/a"], pending);
        // Nothing of its shard elsewhere either: its first list is initial adds.
        let (a, b) = split_namespaces();
        let elsewhere: Checkpoint = [(format!("{b}/x"), entry(4))].into_iter().collect();
        let none = take_over(
            "cm#0-of-2/out",
            Shard { index: 0, count: 2 },
            None,
            vec![("cm/out".into(), elsewhere)],
        );
        assert_eq!(none.checkpoint, None);
        assert!(!a.is_empty());
    }
}
