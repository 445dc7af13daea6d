//! Following leadership: only the leader publishes. Every change of leadership ends a term;
//! becoming leader relists every informer (a consistent list, as a restart does: a standby's
//! watch may lag or be stalled), compares the result with what the last leader's sinks
//! acknowledged (the checkpoints) and publishes what changed, or replays it where there is no
//! checkpoint.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::resources::Resources;
use crate::{
    leader::{Handover, LeaderElector},
    pipeline::{Checkpointer, RouteQueue},
};

impl Resources {
    /// Applies a change of leadership: `leading` is the new state. Every change ends a term:
    /// listeners stop, routes drop what they hold (a worker drops what it took), and
    /// checkpointers drop what they did not write (see
    /// [`crate::pipeline::Checkpointer::end_term`]), so that nothing of the old term is
    /// published or written after the new one began. Becoming leader (after the takeover
    /// wait, see [`crate::leader::takeover_wait`]) loads the checkpoints, starts each route's
    /// resume, switches the routes on, and each informer's listeners with a fresh list of it:
    /// the one [`Self::relist_for_term`] asked for, handed from the cache at once when it is
    /// in already (a long takeover wait), else a new one streamed into them as its pages
    /// arrive (see [`SharedIndexInformer::activate_listeners_after_relist_since`]), so that
    /// the first changes are published from its first page. Either way each object is handed
    /// over once. The deletes of what vanished come once the list is whole. An informer whose
    /// list fails publishes nothing more of its kind until a list succeeds or the term ends.
    ///
    /// [`SharedIndexInformer::activate_listeners_after_relist_since`]: crate::informer::SharedIndexInformer::activate_listeners_after_relist_since
    pub(super) async fn set_leading(&mut self, leading: bool) {
        self.leading = leading;
        // Ends the last term's pending switch-ons before anything is switched off.
        self.term.cancel();
        self.term = CancellationToken::new();
        self.clear_waiting();
        // Each once: several resources may share one.
        let mut informers: Vec<Arc<crate::informer::SharedIndexInformer>> = Vec::new();
        for informer in self.wired.iter().flat_map(|w| w.informers.iter()) {
            if !informers.iter().any(|i| Arc::ptr_eq(i, informer)) {
                informers.push(informer.clone());
            }
        }
        let queues = self.queues();
        informers.iter().for_each(|i| i.deactivate_listeners());
        queues.iter().for_each(|q| q.set_active(false));
        self.resumes().iter().for_each(|r| {
            r.checkpointer.end_term();
            r.resumer.term_ended();
        });
        // Asked for in an ended term, or now (below) for this one.
        let mut relists = std::mem::take(&mut self.term_relists);
        if !leading {
            informers.iter().for_each(|i| i.forget_relist_requests());
            // Another replica's shard from now on: nothing of it stays cached here.
            self.recycle_informers().await;
            return;
        }
        // The takeover wait is over (see `follow`): the last leader's messages and checkpoint
        // writes have landed before this one reads or publishes anything.
        // Routes whose checkpoint cannot be used wait, their listeners off (see checkpoints).
        let all: Vec<usize> = (0..self.wired.len()).collect();
        let (_, waiting) = self.begin_resumes(&all).await;
        // Consumers get the state this replica follows from here on, including what changed
        // while no replica led: each cached object once, and what the first list has not
        // cached yet comes from it.
        queues.iter().for_each(|q| q.set_active(true));
        info!(
            informers = informers.len(),
            "Leading: relisting every informer before comparing with the checkpoints"
        );
        let waiting = Arc::new(waiting);
        for informer in informers {
            let (term, waiting) = (self.term.clone(), waiting.clone());
            let asked = relists
                .iter()
                .position(|(i, _)| Arc::ptr_eq(i, &informer))
                .map(|at| relists.swap_remove(at).1);
            tokio::spawn(async move {
                let not_waiting = |l: &crate::informer::ProcessorListener| {
                    !waiting.iter().any(|p| l.name().starts_with(p))
                };
                if let Some(objects) = informer
                    .activate_listeners_after_relist_since(&term, not_waiting, asked)
                    .await
                {
                    info!(informer = %informer.name(), objects, "Leading: relisted; handed the listed state to the routes");
                }
            });
        }
        // With cold standby they did not run: their first list is the fresh one.
        if self.cold.is_some() {
            self.spawn_informers();
        }
    }
}

impl Resources {
    /// A term is about to begin here: every running informer lists again from now on, while
    /// the sinks' terms begin and the takeover wait and the checkpoint reads go on, and
    /// [`Self::set_leading`] hands the cache over at once where such a list is in by then (a
    /// long takeover wait); where it is still running (transactions fenced the last leader
    /// at once), the routes get what it popped so far from the cache and the rest as it
    /// pops. An informer not running yet (a cold standby's, spawned by `set_leading`) is
    /// asked for its first list, so that spawning it does not race the ask into a second
    /// one. Any list begun after the term began will do: the last leader handed nothing
    /// over after its fence ended, which was before this replica could take the lease, so
    /// such a list is at least as new as anything it published (what changes later reaches
    /// the cache through the watch before the listeners are switched on, and is handed over
    /// with it).
    pub(super) fn relist_for_term(&mut self) {
        let mut relists: Vec<(Arc<crate::informer::SharedIndexInformer>, u64)> = Vec::new();
        for informer in self.wired.iter().flat_map(|w| w.informers.iter()) {
            // Once each: an informer that several resources share would drop the list it
            // began for the first ask.
            if relists.iter().any(|(i, _)| Arc::ptr_eq(i, informer)) {
                continue;
            }
            relists.push((informer.clone(), informer.request_relist()));
        }
        self.term_relists = relists;
    }
}

/// A shard's route queues to drain and checkpointers to write when it is handed on.
type Draining = (Vec<Arc<RouteQueue>>, Vec<Arc<Checkpointer>>);

impl Resources {
    /// The first step of handing this shard on (see [`hand_over`]): ends the term's pending
    /// switch-ons and switches every listener off, so that nothing more reaches the routes,
    /// and runs out what stages in front of the queues hold. From here on the shard counts
    /// as not leading: what discovery wires or switches meanwhile stays off. Returns the
    /// queues to drain and the checkpointers to write; `None` when this replica publishes
    /// nothing (standing by, or still in its takeover wait).
    fn stop_feeding(&mut self) -> Option<Draining> {
        if !self.leading {
            return None;
        }
        self.leading = false;
        self.term.cancel();
        self.term = CancellationToken::new();
        self.clear_waiting();
        for w in &self.wired {
            w.informers.iter().for_each(|i| i.deactivate_listeners());
        }
        for w in &self.wired {
            w.routes.iter().for_each(|r| r.handler.flush());
        }
        let checkpointers = self
            .resumes()
            .iter()
            .map(|r| r.checkpointer.clone())
            .collect();
        Some((self.queues(), checkpointers))
    }
}

/// Hands a shard on: stops feeding its routes, waits until they settled everything they
/// held (within `limit`, and while the lease's fence holds), writes their checkpoints, and
/// ends the term's queues. `true` when nothing this replica handed over is still on its way
/// and the checkpoints hold all of it: the lease may be released and the next owner start at
/// once.
async fn hand_over(
    resources: &tokio::sync::Mutex<Resources>,
    (sinks, shard): (&[Arc<dyn crate::sinks::Sink>], crate::shard::Shard),
    fence: &crate::leader::Fence,
    limit: std::time::Duration,
) -> bool {
    let Some((queues, checkpointers)) = resources.lock().await.stop_feeding() else {
        return true;
    };
    let deadline = tokio::time::Instant::now() + limit;
    while queues.iter().any(|q| q.held() > 0) {
        if tokio::time::Instant::now() >= deadline || !fence.is_held() {
            let held: usize = queues.iter().map(|q| q.held()).sum();
            warn!(
                held,
                "Handing a shard on: notifications still unsettled; the lease expires instead"
            );
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    for checkpointer in &checkpointers {
        // A lapsed cap (sharded: the group's hold unconfirmed for a moment) holds the write
        // back: waited out within the limit, while the lease is held.
        let flushed = loop {
            while !fence.is_valid() {
                if tokio::time::Instant::now() >= deadline || !fence.is_held() {
                    warn!(
                        "Handing a shard on: the lease's fence did not become valid again; the lease expires instead"
                    );
                    return false;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            match tokio::time::timeout_at(deadline, checkpointer.flush()).await {
                Ok(Err(crate::pipeline::checkpoint::Error::NotLeading)) if fence.is_held() => {}
                other => break other,
            }
        };
        match flushed {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                warn!(route = %checkpointer.route(), error = %err, "Handing a shard on: the checkpoint write failed; the lease expires instead");
                return false;
            }
            Err(_) => {
                warn!(route = %checkpointer.route(), "Handing a shard on: the checkpoint write did not finish in time; the lease expires instead");
                return false;
            }
        }
    }
    // A transactional sink's open transaction holds what was settled without a message (and
    // the cluster's identity): committed before the next owner reads the checkpoint.
    for sink in sinks {
        match tokio::time::timeout_at(deadline, sink.commit_term(shard)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                warn!(sink = %sink.name(), error = %err, "Handing a shard on: the commit failed; the lease expires instead");
                return false;
            }
            Err(_) => {
                warn!(sink = %sink.name(), "Handing a shard on: the commit did not finish in time; the lease expires instead");
                return false;
            }
        }
    }
    // Nothing of the ending term is published from here on (the elector ends it next); a
    // route wired meanwhile must hold nothing either.
    let resources = resources.lock().await;
    let all = resources.queues();
    if all.iter().any(|q| q.held() > 0) {
        warn!(
            "Handing a shard on: notifications arrived while the checkpoints were written; the lease expires instead"
        );
        return false;
    }
    all.iter().for_each(|q| q.set_active(false));
    info!(
        routes = queues.len(),
        "Handing a shard on: everything handed over was settled and checkpointed"
    );
    true
}

/// Follows `elector`'s changes of leadership until it stops. The elector reports changes
/// only (renewals are silent); a change seen late may hide a lost-and-regained lease, which
/// is a change too.
/// Losing leadership also drops what the sinks still queue of the ended term (see
/// [`crate::sinks::Sink::abandon_queued`]): the new leader's messages must not be followed by
/// older ones.
/// Becoming leader begins the sinks' terms (see [`begin_term`]) and waits the takeover wait,
/// without holding the resources (shutdown and discovery go on meanwhile); a loss during it
/// is the next change.
/// With sharding, `handovers` counts this shard's changes of owner (`acquired`, `stopped`),
/// and the elector's requests to hand the shard on are answered (see [`hand_over`]; `limit`
/// bounds the drain): after a clean one, the sinks' queues are left alone (nothing of this
/// shard is in them, and the other shards' messages are).
pub(super) fn follow(
    elector: &mut LeaderElector,
    resources: Arc<tokio::sync::Mutex<Resources>>,
    sinks: Vec<Arc<dyn crate::sinks::Sink>>,
    shard: crate::shard::Shard,
    handovers: Option<[prometheus::IntCounter; 2]>,
    limit: std::time::Duration,
) -> JoinHandle<()> {
    let mut leading = elector.subscribe();
    let fence = elector.fence();
    let terms = elector.terms();
    let mut requests = handovers.is_some().then(|| elector.handovers());
    let mut deposals = elector.deposals();
    tokio::spawn(async move {
        // The last term ended with a clean hand-over: nothing of it is in the sinks.
        let mut drained = false;
        // What the last change seen said: leading, and the terms begun by then; and whether
        // this replica published in the term that began (not if it ended in its takeover
        // wait).
        let mut seen = (false, 0u64);
        let mut published = false;
        loop {
            let request = async {
                match requests.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            // A change first: a request or a deposal that waited behind it may be for an
            // ended term.
            let next: Option<Handover> = tokio::select! {
                biased;
                changed = leading.changed() => match changed {
                    Ok(()) => None,
                    Err(_) => break,
                },
                Some(deposal) = deposals.recv() => {
                    // The lost term's producers are fenced by the holder's, unless a term
                    // began here since.
                    let term = terms.load(std::sync::atomic::Ordering::SeqCst);
                    if deposal.term == term && !*leading.borrow() {
                        sinks
                            .iter()
                            .for_each(|s| s.deposed(shard, &deposal.holder, deposal.takeable_from));
                    }
                    continue;
                }
                Some(answer) = request => Some(answer),
                else => break,
            };
            match next {
                None => {
                    // The count is read after the value: a later term can only make it larger
                    // (and the queues go, which is always safe).
                    let now = *leading.borrow_and_update();
                    let term = terms.load(std::sync::atomic::Ordering::SeqCst);
                    // A term of this shard ended with messages maybe still in the sinks: one
                    // seen ending undrained, or one not seen at all (a loss and a regain as one
                    // change). A plain acquisition leaves the sinks alone: the other shards'
                    // messages are in them.
                    let missed = term > seen.1 + u64::from(now) || (now && seen.0);
                    let abandon = if now {
                        missed
                    } else {
                        missed || (published && !drained)
                    };
                    drained = false;
                    seen = (now, term);
                    published = follow_change(
                        now,
                        &mut leading,
                        &resources,
                        (&sinks, shard),
                        &handovers,
                        &fence,
                        !abandon,
                    )
                    .await;
                }
                // Asked in a term that ended since (the elector gave up waiting): nothing to do.
                Some(answer) if answer.is_closed() => {}
                Some(answer) => {
                    drained = hand_over(&resources, (&sinks, shard), &fence, limit).await;
                    let _ = answer.send(drained);
                }
            }
        }
    })
}

/// Applies one change of leadership (see [`follow`]); `drained`: nothing of an ended term of
/// this shard can be in the sinks (it ended with a clean hand-over, it published nothing, or
/// it was abandoned already), so their queues are left alone. Returns whether this replica
/// publishes from now on.
async fn follow_change(
    now: bool,
    leading: &mut tokio::sync::watch::Receiver<bool>,
    resources: &tokio::sync::Mutex<Resources>,
    (sinks, shard): (&[Arc<dyn crate::sinks::Sink>], crate::shard::Shard),
    handovers: &Option<[prometheus::IntCounter; 2]>,
    fence: &crate::leader::Fence,
    drained: bool,
) -> bool {
    if let Some(counters) = &handovers {
        counters[usize::from(!now)].inc();
    }
    // Every change ends a term (a loss and a regain can arrive as one change), and
    // before waiting for the lock (a resume may hold it): the queue goes now, unless
    // the term ended drained.
    if !drained {
        sinks.iter().for_each(|s| s.abandon_queued());
    }
    // The shard's transactions of the last term go, drained or not (a drained term committed
    // everything; the next one makes a producer of its own).
    sinks.iter().for_each(|s| s.end_term(shard));
    if now {
        // The last term ends before the wait: nothing of it is published meanwhile. The
        // routes count as resuming from here (`keb_route_resuming`): what changed while no
        // replica published is not out until the wait, the term's start and the resume are.
        let mut r = resources.lock().await;
        r.set_leading(false).await;
        r.relist_for_term();
        r.resumes().iter().for_each(|r| r.resumer.term_began());
        drop(r);
        // The sinks' terms begin at once, the takeover wait after: a transactional producer
        // fences the last holder's when it starts, ending its open transaction (which holds
        // `read_committed` readers back) instead of leaving it to the broker's timeout, and
        // once every sink began, the wait owes those transactions nothing: it shortens to
        // what the elector allowed for that (see
        // `crate::leader::LeaderElector::announcing_transactions`). Until then the full wait
        // stands (the lease is not released during it). Nothing is published before the
        // fence is valid.
        let takeover = fence.takeover_token();
        let begun = begin_term(sinks, shard, leading, fence).await;
        if begun && let Some(left) = fence.holder_fenced(takeover) {
            info!(left = ?left, "This term's producers fenced the last leader's transactions: what is left of the takeover wait is for its other messages");
        }
        // A lapse ends a wait without a change when the renewal lands just after
        // it: wait again while the elector still says leading.
        let mut valid = begun && fence.wait_valid().await;
        while begun && !valid && still_leading(leading) {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            valid = fence.wait_valid().await;
        }
        if !valid {
            // Lost meanwhile: nothing of this term was published.
            warn!("Lost the lease before publishing anything of the term");
            sinks.iter().for_each(|s| {
                s.abandon_queued();
                s.end_term(shard);
            });
            term_ended(resources).await;
            return false;
        }
    }
    resources.lock().await.set_leading(now).await;
    now
}

/// Whether the elector still says leading, and nothing changed since it was read.
fn still_leading(leading: &tokio::sync::watch::Receiver<bool>) -> bool {
    *leading.borrow() && !leading.has_changed().unwrap_or(true)
}

/// A term that began at the lease's acquisition ended before its routes were switched on:
/// none of them resumes (`keb_route_resuming` back to 0).
async fn term_ended(resources: &tokio::sync::Mutex<Resources>) {
    let mut resources = resources.lock().await;
    for (informer, _) in std::mem::take(&mut resources.term_relists) {
        informer.forget_relist_requests();
    }
    resources
        .resumes()
        .iter()
        .for_each(|r| r.resumer.term_ended());
}

/// Starts the term of every sink (see [`crate::sinks::Sink::begin_term`]; its transactions,
/// producer or connection), while the lease is held, its takeover wait under way or not: a
/// transactional producer fences the last leader's before the checkpoints are read, so what
/// that one committed is in them and what it had not is aborted. A failure is tried again
/// every second while this replica leads; the checkpoints are read (and anything published)
/// only once every sink has started. Returns `false` when the lease was lost first.
async fn begin_term(
    sinks: &[Arc<dyn crate::sinks::Sink>],
    shard: crate::shard::Shard,
    leading: &tokio::sync::watch::Receiver<bool>,
    fence: &crate::leader::Fence,
) -> bool {
    for sink in sinks {
        let mut warned = false;
        loop {
            // Only a lost lease ends the term: a lapse (the renewal lands just after the
            // deadline) is waited out, and a lapsed cap (sharded: the group's hold
            // unconfirmed for a moment) does not stop it.
            if !still_leading(leading) {
                return false;
            }
            if fence.held_until().is_none() {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
            match sink.begin_term(shard, Some(fence.clone())).await {
                Ok(()) => break,
                Err(e) => {
                    if !warned {
                        warn!(sink = %sink.name(), error = %e, "Could not start the shard's term on this sink (its transactions, producer or connection); trying again every second (nothing of the shard is published meanwhile)");
                        warned = true;
                    }
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        }
    }
    // The lease may have gone while a producer was made (its fence outlived by a slow broker).
    still_leading(leading)
}

/// Turns the shards assigned to this replica (see [`crate::leader::membership`]) into what each
/// shard's elector campaigns for, and keeps `keb_leader` at 1 while this replica owns any
/// shard.
/// When `freeze` fires (shutdown), it stops campaigning for the shards this replica does not
/// own and follows no more changes: the owned ones drain under their leases.
pub(super) async fn campaign(
    mut wanted: tokio::sync::watch::Receiver<std::collections::BTreeSet<u32>>,
    campaigns: Vec<tokio::sync::watch::Sender<bool>>,
    metrics: Arc<crate::metrics::Metrics>,
    freeze: CancellationToken,
) {
    let owned = |s: usize| {
        metrics
            .shard_owned
            .with_label_values(&[&crate::shard::Shard {
                index: s as u32,
                count: campaigns.len() as u32,
            }
            .label()])
            .get()
            == 1
    };
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        let mine = wanted.borrow_and_update().clone();
        for (index, tx) in campaigns.iter().enumerate() {
            tx.send_if_modified(|c| {
                let want = mine.contains(&(index as u32));
                std::mem::replace(c, want) != want
            });
        }
        metrics.leader.set((0..campaigns.len()).any(owned) as i64);
        tokio::select! {
            _ = freeze.cancelled() => break,
            changed = wanted.changed() => if changed.is_err() { break },
            _ = tick.tick() => {}
        }
    }
    for (index, tx) in campaigns.iter().enumerate() {
        if !owned(index) {
            tx.send_replace(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::{
        app::{
            checkpoints::Resume,
            resources::{Wired, WiredRoute},
        },
        informer::{Notification, NotificationKind, testing::obj},
        message::{Encoder, Encoding, MessageConfig},
        pipeline::{
            Delivery, RouteBuilder,
            route::{DEFAULT_MAX_BYTES_IN_FLIGHT, DEFAULT_MAX_OBJECTS_IN_FLIGHT},
        },
        sinks::{
            CheckpointStore,
            stdout::{FileCheckpointStore, StdoutSink},
        },
    };
    use kube::api::{ApiResource, GroupVersionKind, TypeMeta};
    use std::collections::BTreeMap;

    /// Resources with one wired ConfigMap route to a file sink with a checkpoint, no
    /// informers (none is needed to follow leadership), standing by.
    async fn standby(dir: &std::path::Path, metrics: &Arc<Metrics>) -> Resources {
        let configmaps = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("", "v1", "ConfigMap"),
            "configmaps",
        );
        let out = dir.join("out.jsonl");
        let sink = Arc::new(StdoutSink::open("out", Some(&out)).await.unwrap());
        let delivery = Arc::new(Delivery {
            sink,
            dead_letter: None,
            publish_limit: None,
            max_retries: None,
            in_flight: Delivery::in_flight(
                DEFAULT_MAX_OBJECTS_IN_FLIGHT,
                DEFAULT_MAX_BYTES_IN_FLIGHT,
            ),
        });
        let encoder = Encoder::new(
            "c",
            &configmaps,
            &MessageConfig::default(),
            Encoding::Structured,
        );
        let store: Arc<dyn CheckpointStore> = Arc::new(FileCheckpointStore::beside(&out));
        let built = RouteBuilder::new("configmap", "out", encoder, delivery, metrics)
            .checkpoint(Some(store))
            .resume(
                TypeMeta {
                    api_version: "v1".into(),
                    kind: "ConfigMap".into(),
                },
                1,
            )
            .build();
        built.route.queue().set_active(false);
        let wired = Wired {
            index: 0,
            api_resource: configmaps,
            namespaced: true,
            routes: vec![WiredRoute {
                route: built.route,
                workers: 1,
                handler: built.handler,
                sink: "out".into(),
                resume: Some(Resume {
                    resumer: built.resumer.unwrap(),
                    checkpointer: built.checkpointer.unwrap(),
                    interval: std::time::Duration::from_secs(1),
                    family: crate::app::checkpoints::Family {
                        base: "configmap".into(),
                        sink: "out".into(),
                        shard: crate::shard::Shard::WHOLE,
                    },
                }),
            }],
            current: tokio::sync::watch::Sender::new(Vec::new()),
            informers: Vec::new(),
            gone: false,
        };
        Resources {
            wired: vec![wired],
            pending: BTreeMap::new(),
            leading: false,
            term: Default::default(),
            cluster: "this-cluster".into(),
            waiting: Default::default(),
            metrics: metrics.clone(),
            gone_since: Default::default(),
            live: None,
            cold: None,
            term_relists: Vec::new(),
        }
    }

    fn add(name: &str, rv: &str) -> Notification {
        Notification::new(NotificationKind::Add {
            obj: obj("ns", name, rv),
            is_initial_list: false,
        })
    }

    #[tokio::test]
    async fn a_standby_holds_nothing_and_a_term_end_drops_what_the_checkpoint_did_not_get() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::new());
        let mut resources = standby(dir.path(), &metrics).await;
        let route = resources.wired[0].routes[0].route.clone();
        let checkpointer = resources.resumes()[0].checkpointer.clone();
        // Standing by: what reaches the route is dropped.
        route.queue().push(add("a", "1"));
        assert_eq!(route.queue().held(), 0);
        resources.set_leading(true).await;
        assert!(resources.leading && route.queue().is_active());
        let store = FileCheckpointStore::beside(&dir.path().join("out.jsonl"));
        // Acknowledged in this term and written: kept.
        checkpointer.record("ns/a", &add("a", "1"));
        checkpointer.flush().await.unwrap();
        // Acknowledged, not written when the term ends: never written by a later term (a
        // newer leader may have written the key since).
        checkpointer.record("ns/b", &add("b", "2"));
        resources.set_leading(false).await;
        resources.set_leading(true).await;
        checkpointer.flush().await.unwrap();
        let written = store.load("configmap/out").await.unwrap().expect("written");
        assert_eq!(written["ns/a"].resource_version, "1");
        assert!(!written.contains_key("ns/b"), "{written:?}");
        route.queue().push(add("b", "2"));
        assert_eq!(
            route.queue().held(),
            1,
            "a leader's route takes notifications"
        );
        // Losing the lease ends the term: what the route held is dropped.
        resources.set_leading(false).await;
        assert!(!resources.leading && !route.queue().is_active());
        assert_eq!(route.queue().held(), 0);
    }

    #[tokio::test]
    async fn an_unreadable_checkpoint_makes_the_route_wait_until_it_loads() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::new());
        let mut resources = standby(dir.path(), &metrics).await;
        // A directory where the checkpoint file should be: reading it fails.
        let path = dir.path().join("out.jsonl.checkpoint");
        std::fs::create_dir(&path).unwrap();
        let (refusals, waiting) = resources.begin_resumes(&[0]).await;
        assert!(matches!(
            refusals[..],
            [super::super::checkpoints::Refusal::Unreadable(_)]
        ));
        assert_eq!(waiting, ["configmap/out@"]);
        let gauge = metrics
            .checkpoint_waiting
            .with_label_values(&["configmap/out"]);
        assert_eq!(gauge.get(), 1);
        let reason = resources.waiting.lock().unwrap()["configmap/out"].clone();
        assert!(reason.contains("cannot read its checkpoint"), "{reason}");
        // The store comes back: the next attempt (after 1 s) loads it.
        std::fs::remove_dir(&path).unwrap();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while gauge.get() == 1 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(gauge.get(), 0);
        assert!(resources.waiting.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_checkpoint_of_another_cluster_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::new());
        let mut resources = standby(dir.path(), &metrics).await;
        let checkpointer = resources.resumes()[0].checkpointer.clone();
        checkpointer.record_cluster("other-cluster");
        checkpointer.record("ns/a", &add("a", "1"));
        checkpointer.flush().await.unwrap();
        let (refusals, _) = resources.begin_resumes(&[0]).await;
        let err = super::super::checkpoints::start_error(&refusals)
            .expect("refused")
            .to_string();
        assert!(
            err.contains("other-cluster") && err.contains("this-cluster"),
            "{err}"
        );
        // Its own cluster's checkpoint (or one without identity) is resumed from, and the
        // identity is written with the next batch.
        resources.cluster = "other-cluster".into();
        resources.waiting.lock().unwrap().clear();
        let (refusals, _) = resources.begin_resumes(&[0]).await;
        assert!(refusals.is_empty());
    }
}
