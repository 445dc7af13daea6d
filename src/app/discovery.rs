//! Following discovery: keeping the wired kinds in step with what the API server serves as
//! CRDs come and go (which kinds a resource selects is [`crate::selection`]'s).

use std::sync::Arc;

use kube::api::ApiResource;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::resources::{Resources, Wiring, kind_name, route_kind};
use crate::{cluster, pipeline::checkpoint::CLUSTER_KEY, selection::resolve_all};

/// Keeps the wired resources in step with what the API server serves: a pending kind that
/// appears is wired and started (everything from its first list is delivered); a wired kind
/// that discovery has answered is no longer served (its CRD was deleted) for
/// `kubernetes.discovery_grace` has its informers stopped, what they still cache delivered as
/// deleted, and waits as pending again. A failed lookup (a timeout, a 5xx, an aggregated API
/// that is down) stops nothing. Looks again at every change of a CRD (a watch of
/// CustomResourceDefinitions, when the service account may), every
/// `kubernetes.discovery_refresh`, and when a kind's grace ends.
/// Every shard's wiring follows the same discovery: it is looked up once per pass (not once
/// per shard: M times the requests, and shards that could wire different versions for a
/// moment), and each shard is refreshed from that answer in turn.
pub(super) async fn follow_discovery(
    shards: Vec<(Arc<Wiring>, Arc<tokio::sync::Mutex<Resources>>)>,
    notes: Arc<std::sync::Mutex<Vec<String>>>,
    cancel: CancellationToken,
) {
    let wiring = shards[0].0.clone();
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let crds = kube::Api::<kube::api::DynamicObject>::all_with(
        wiring.client.clone(),
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(
                "apiextensions.k8s.io",
                "v1",
                "CustomResourceDefinition",
            ),
            "customresourcedefinitions",
        ),
    );
    let mut crd_events = watcher(crds, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut crd_watch_failed = false;
    let period = wiring.config.kubernetes.discovery_refresh;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut recheck: Option<tokio::time::Instant> = None;
    // Routes whose kind no process wires: looked for once discovery had its grace to answer
    // (an API server's discovery is incomplete for a moment after it starts).
    let mut orphans_due =
        Some(tokio::time::Instant::now() + wiring.config.kubernetes.discovery_grace);
    let mut orphans: Vec<Orphan> = Vec::new();
    let mut orphans_retry = period / 2;
    loop {
        if let Some(at) = orphans_due {
            recheck = Some(recheck.map_or(at, |r| r.min(at)));
        }
        let grace_over = async {
            match recheck {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
            _ = grace_over => {}
            event = crd_events.next() => match event {
                Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => continue,
                Some(Ok(_)) => crd_watch_failed = false,
                // History compacted: the watcher relists by itself; nothing is wrong.
                Some(Err(watcher::Error::WatchError(status))) if status.code == 410 => {
                    debug!(message = %status.message, "CustomResourceDefinition watch expired; relisting");
                    continue;
                }
                Some(Err(err)) => {
                    if !crd_watch_failed {
                        warn!(error = %err, every = ?period, "Cannot watch CustomResourceDefinitions; new and deleted kinds are found by the periodic discovery refresh");
                        crd_watch_failed = true;
                    }
                    continue;
                }
                None => return,
            },
        }
        recheck = None;
        let mut pending = std::collections::BTreeSet::new();
        let mut answers = look_up(&wiring).await;
        let mut looked = tokio::time::Instant::now();
        if orphans_due.is_some_and(|at| looked >= at) {
            let cluster = shards[0].1.lock().await.cluster.clone();
            match find_orphans(&wiring, &answers, &cluster).await {
                Ok(found) => {
                    for o in found {
                        if !orphans.iter().any(|x| {
                            x.index == o.index && same_kind(&x.api_resource, &o.api_resource)
                        }) {
                            orphans.push(o);
                        }
                    }
                    // A resource whose lookup failed was not looked for: again later, less
                    // often each time (a store read each time).
                    orphans_due = answers
                        .iter()
                        .any(|a| matches!(a, Err((false, _))))
                        .then(|| {
                            orphans_retry = (orphans_retry * 2).min(period * 16);
                            looked + orphans_retry
                        });
                }
                Err(err) => {
                    warn!(error = %err, "Cannot look for checkpointed routes of kinds no longer served; looking again at the next refresh");
                    orphans_due = Some(looked + period);
                }
            }
        }
        // Orphans (by position) to look at again at the next pass, and whether each kind is
        // served at some version (asked once per pass).
        let mut keep = std::collections::BTreeSet::new();
        let mut served = std::collections::HashMap::new();
        for (wiring, resources) in &shards {
            let mut resources = resources.lock().await;
            // An answer older than a moment (the lock was held: a checkpoint load, a drain)
            // is asked again: a kind may have come back meanwhile.
            if looked.elapsed() > FRESH_FOR {
                answers = look_up(wiring).await;
                looked = tokio::time::Instant::now();
            }
            keep.extend(
                wire_orphans(wiring, &mut resources, &orphans, &answers, &mut served).await,
            );
            if let Some(at) = refresh(wiring, &mut resources, &answers).await {
                recheck = Some(recheck.map_or(at, |r: tokio::time::Instant| r.min(at)));
            }
            pending.extend(resources.pending.values().cloned());
        }
        // Wired in every shard, or served after all (wired as usual); those whose lookup or
        // wiring failed are looked at again at the next pass.
        let mut position = 0;
        orphans.retain(|_| {
            position += 1;
            keep.contains(&(position - 1))
        });
        *notes.lock().unwrap_or_else(|e| e.into_inner()) = pending.into_iter().collect();
    }
}

/// A kind that a route's checkpoint names (see [`RouteKind`]) and that no process wires:
/// discovery did not serve it when this process started, as after a CRD deleted while no
/// replica published it (none ran, or a rolling update started this one after the deletion).
#[derive(Debug, Clone)]
pub(super) struct Orphan {
    /// The configured resource whose routes it was wired for.
    index: usize,
    api_resource: ApiResource,
    namespaced: bool,
}

/// The kinds of routes that hold checkpointed objects in a sink's store, belong to a
/// configured resource routed to that sink (under any shard count) and are not served now:
/// one read of each store for every shard. Routes of another cluster, and routes written
/// before kinds were recorded, are left alone.
async fn find_orphans(
    wiring: &Wiring,
    answers: &Answers,
    cluster: &str,
) -> Result<Vec<Orphan>, String> {
    let config = &wiring.config;
    let mut found: Vec<Orphan> = Vec::new();
    for (sink, store) in &wiring.stores {
        // (index, base of every kind served now) of the resources routed to this sink whose
        // lookup answered.
        let entries: Vec<(usize, Vec<String>)> = config
            .resources
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                !matches!(answers[*i], Err((false, _)))
                    && config
                        .routes
                        .iter()
                        .any(|rt| rt.resource == r.effective_name() && rt.sinks.contains(sink))
            })
            .map(|(i, r)| {
                let served = match &answers[i] {
                    Ok(selection) => selection
                        .kinds
                        .iter()
                        .map(|k| kind_name(r, &k.api_resource))
                        .collect(),
                    Err(_) => Vec::new(),
                };
                (i, served)
            })
            .collect();
        if entries.is_empty() {
            continue;
        }
        // The resources a route may belong to, by its name alone (the kind its checkpoint
        // records decides, below).
        let candidates = |route: &str| -> Vec<usize> {
            let Some(base) = route_base(route, sink) else {
                return Vec::new();
            };
            entries
                .iter()
                .filter(|(i, served)| {
                    let r = &config.resources[*i];
                    let entry = r.effective_name();
                    let ours = if r.is_wildcard() {
                        base.strip_prefix(entry.as_str())
                            .is_some_and(|rest| rest.starts_with('/'))
                    } else {
                        base == entry
                    };
                    ours && !served.iter().any(|s| s == base)
                })
                .map(|(i, _)| *i)
                .collect()
        };
        let also = |route: &str| !candidates(route).is_empty();
        let loaded = store
            .load_family(&[], &also)
            .await
            .map_err(|e| e.to_string())?;
        for (route, checkpoint) in loaded {
            let Some(identity) = checkpoint.get(CLUSTER_KEY) else {
                continue;
            };
            if !cluster.is_empty() && !identity.uid.is_empty() && identity.uid != cluster {
                continue;
            }
            if checkpoint.len() < 2 {
                continue; // nothing but the identity: nothing to delete
            }
            let Some(kind) = &identity.kind else {
                warn!(route = %route, "A checkpointed route of a kind not served now does not record its kind (written by an older release): its objects' deletes are published when the kind is served again");
                continue;
            };
            let (group, version) = match kind.api_version.split_once('/') {
                Some((g, v)) => (g.to_owned(), v.to_owned()),
                None => (String::new(), kind.api_version.clone()),
            };
            let api_resource = ApiResource {
                group,
                version,
                api_version: kind.api_version.clone(),
                kind: kind.kind.clone(),
                plural: kind.plural.clone(),
            };
            // The resource whose route this is, for the kind it records: the route is named
            // after it, and a fixed entry still names that kind (an entry moved to another
            // kind leaves the old kind's route alone).
            let base = route_base(&route, sink).unwrap_or_default();
            let Some(index) = candidates(&route).into_iter().find(|&i| {
                let r = &config.resources[i];
                let names_it = || {
                    let group = r.api_version.split_once('/').map_or("", |(g, _)| g);
                    group == api_resource.group && r.kind == api_resource.kind
                };
                kind_name(r, &api_resource) == base && (r.is_wildcard() || names_it())
            }) else {
                continue;
            };
            if !found
                .iter()
                .any(|o| o.index == index && same_kind(&o.api_resource, &api_resource))
            {
                found.push(Orphan {
                    index,
                    api_resource,
                    namespaced: kind.namespaced,
                });
            }
        }
    }
    Ok(found)
}

/// The base of `route` (`{base}/{sink}` or `{base}#{i}-of-{m}/{sink}`) when it is a route to
/// `sink`.
fn route_base<'a>(route: &'a str, sink: &str) -> Option<&'a str> {
    crate::shard::split_route(route, sink).map(|(base, _)| base)
}

/// Wires every orphan ([`find_orphans`]) that discovery serves at no version and that is not
/// wired in this shard, as a kind that is gone: its routes resume from their checkpoints (and
/// take over other shard counts') when this replica publishes the shard, and discovery's
/// look completes them as gone (a delete for every checkpointed object) as it does for a
/// kind that went while wired. Returns the positions of the orphans to look at again (their
/// lookup or wiring failed).
async fn wire_orphans(
    wiring: &Wiring,
    resources: &mut Resources,
    orphans: &[Orphan],
    answers: &Answers,
    served: &mut std::collections::HashMap<usize, Option<bool>>,
) -> Vec<usize> {
    let mut again = Vec::new();
    for (position, o) in orphans.iter().enumerate() {
        let wired = resources
            .wired
            .iter()
            .any(|w| w.index == o.index && same_kind(&w.api_resource, &o.api_resource));
        if wired {
            continue;
        }
        match &answers[o.index] {
            // Selected: wired as usual.
            Ok(selection)
                if selection
                    .kinds
                    .iter()
                    .any(|k| same_kind(&k.api_resource, &o.api_resource)) =>
            {
                continue;
            }
            Err((false, _)) => {
                again.push(position);
                continue;
            }
            _ => {}
        }
        // Served at any version (if not selected: excluded, another version pinned) is not
        // gone.
        let is_served = match served.get(&position) {
            Some(known) => *known,
            None => {
                let asked = tokio::time::timeout(
                    FRESH_FOR * 10,
                    served_at(&wiring.client, &o.api_resource),
                )
                .await;
                let known = match asked {
                    Ok(Ok(versions)) => Some(!versions.is_empty()),
                    _ => None,
                };
                served.insert(position, known);
                known
            }
        };
        match is_served {
            Some(false) => {}
            Some(true) => continue,
            None => {
                again.push(position);
                continue;
            }
        }
        let r = &wiring.config.resources[o.index];
        match wiring
            .wire(o.index, o.api_resource.clone(), o.namespaced)
            .await
        {
            Ok(mut w) => {
                w.gone = true;
                resources.wired.push(w);
                let i = resources.wired.len() - 1;
                resources.start(i, true, &[]).await;
                info!(resource = %kind_name(r, &o.api_resource), "A kind no longer served still has checkpointed objects: its routes publish their deletes (its CRD was deleted while no replica published it)");
            }
            Err(err) => {
                warn!(resource = %kind_name(r, &o.api_resource), error = %err, "Cannot wire the routes of a kind no longer served; trying again at the next refresh");
                again.push(position);
            }
        }
    }
    again
}

/// The same kind, at any version: its objects are the same (a CRD serves one set of objects
/// at each of its versions), and so are the kind's routes and checkpoints.
fn same_kind(a: &ApiResource, b: &ApiResource) -> bool {
    a.group == b.group && a.plural == b.plural
}

/// What one look at discovery changes for one configured resource.
#[derive(Debug, PartialEq)]
struct Plan {
    /// Kinds to start watching.
    start: Vec<Start>,
    /// Wired kinds (indices into the wired list) to stop watching.
    stop: Vec<usize>,
}

/// A kind to start watching.
#[derive(Debug, PartialEq)]
enum Start {
    /// A kind wired before (whose routes live on) that is served again: new informers.
    Again(usize),
    /// A kind never wired: new routes and informers.
    New(ApiResource, bool),
    /// A wired kind now served (or preferred) at another version: its informers (if any) stop
    /// without deleting anything, and new ones at this version feed the same routes.
    Switch(usize, ApiResource),
}

/// The changes for `resources[index]` when discovery selects `want` (kind, namespaced) and
/// `wired` holds (resource index, kind, has informers) per wired kind: start what is wanted
/// and not watched, switch what is watched at another version, stop what is watched and no
/// longer wanted at any version.
fn plan(index: usize, want: &[(ApiResource, bool)], wired: &[(usize, &ApiResource, bool)]) -> Plan {
    let mut start = Vec::new();
    for (api_resource, namespaced) in want {
        let found = wired
            .iter()
            .position(|(i, a, _)| *i == index && same_kind(a, api_resource));
        match found {
            Some(i) if wired[i].1.version != api_resource.version => {
                start.push(Start::Switch(i, api_resource.clone()))
            }
            Some(i) if wired[i].2 => {}
            Some(i) => start.push(Start::Again(i)),
            None => start.push(Start::New(api_resource.clone(), *namespaced)),
        }
    }
    let stop = wired
        .iter()
        .enumerate()
        .filter(|(_, (i, a, active))| {
            *i == index && *active && !want.iter().any(|(w, _)| same_kind(w, a))
        })
        .map(|(n, _)| n)
        .collect();
    Plan { start, stop }
}

/// How long one pass's discovery answer is applied to further shards before it is asked again.
const FRESH_FOR: std::time::Duration = std::time::Duration::from_secs(1);

/// What discovery answered for each configured resource (by index), in one pass.
type Answers = Vec<Result<crate::selection::Selection, (bool, String)>>;

/// Looks every configured resource up once: its selection, or whether it is not served
/// (`true`) or the lookup failed (`false`), with the error.
async fn look_up(wiring: &Wiring) -> Answers {
    let mut answers = Vec::new();
    for (index, r) in wiring.config.resources.iter().enumerate() {
        answers.push(resolve_all(&wiring.client, index, r).await.map_err(|err| {
            (
                matches!(err, cluster::Error::NotServed { .. }),
                err.to_string(),
            )
        }));
    }
    answers
}

/// One look at discovery (`answers`, see [`look_up`]) for one shard's resources: see
/// [`follow_discovery`]. A lookup that fails for another reason than "not served" changes
/// nothing (the next one decides); neither does a group whose discovery failed. Returns when
/// to look again for a kind whose grace is not over yet.
pub(super) async fn refresh(
    wiring: &Wiring,
    resources: &mut Resources,
    answers: &Answers,
) -> Option<tokio::time::Instant> {
    let mut recheck: Option<tokio::time::Instant> = None;
    // One answer per configured resource (see `look_up`).
    for (index, answer) in answers.iter().enumerate() {
        if let Some(at) = refresh_resource(wiring, resources, index, answer).await {
            recheck = Some(recheck.map_or(at, |r| r.min(at)));
        }
    }
    recheck
}

/// What discovery answered for one configured resource.
struct Answer {
    /// The kinds it selects, and whether each is namespaced.
    want: Vec<(ApiResource, bool)>,
    /// Groups whose discovery failed: what they would select is unknown, not gone.
    unanswered: Vec<String>,
    /// Why nothing is selected, when the resource is not served.
    not_served: Option<String>,
}

impl Answer {
    /// The answer, or `None` when the lookup failed for another reason than "not served".
    fn of(answer: &Result<crate::selection::Selection, (bool, String)>) -> Option<Self> {
        match answer.clone() {
            Ok(selection) => Some(Self {
                want: selection
                    .kinds
                    .into_iter()
                    .map(|k| (k.api_resource, k.namespaced))
                    .collect(),
                unanswered: selection.unanswered,
                not_served: None,
            }),
            Err((true, not_served)) => Some(Self {
                want: Vec::new(),
                unanswered: Vec::new(),
                not_served: Some(not_served),
            }),
            Err((false, _)) => None,
        }
    }

    fn wants(&self, kind: &ApiResource) -> bool {
        self.want.iter().any(|(a, _)| same_kind(a, kind))
    }
}

/// [`refresh`] for `resources[index]`: applies the [`plan`] of its answer, and keeps its
/// pending reason. Returns when to look again, if a kind's grace is not over yet.
async fn refresh_resource(
    wiring: &Wiring,
    resources: &mut Resources,
    index: usize,
    answer: &Result<crate::selection::Selection, (bool, String)>,
) -> Option<tokio::time::Instant> {
    let name = wiring.config.resources[index].effective_name();
    let Some(answer) = Answer::of(answer) else {
        // One answer for every shard: said once.
        if wiring.shard.index == 0
            && let Err((_, err)) = answer
        {
            warn!(resource = %name, error = %err, "Discovery failed; looking again at the next refresh");
        }
        // Gone must be answered without a break.
        let wired = &resources.wired;
        resources.gone_since.retain(|&i, _| wired[i].index != index);
        return None;
    };
    let wired: Vec<(usize, &ApiResource, bool)> = resources
        .wired
        .iter()
        .map(|w| (w.index, &w.api_resource, !w.informers.is_empty()))
        .collect();
    let Plan { start, stop } = plan(index, &answer.want, &wired);
    // Kinds served (again) are not going.
    for (i, w) in resources.wired.iter().enumerate() {
        if w.index == index && answer.wants(&w.api_resource) {
            resources.gone_since.remove(&i);
        }
    }
    if resources.leading {
        complete_gone_resumes(wiring, resources, index, &answer).await;
    }
    for s in start {
        start_kind(wiring, resources, index, s).await;
    }
    let mut recheck = None;
    let mut version_gone = None;
    let now = tokio::time::Instant::now();
    for i in stop {
        match stop_kind(wiring, resources, i, &answer, now).await {
            Stopped::Not { recheck: Some(at) } => {
                recheck = Some(recheck.map_or(at, |r: tokio::time::Instant| r.min(at)));
            }
            Stopped::Not { recheck: None } => {}
            Stopped::VersionGone(reason) => version_gone = Some(reason),
            Stopped::Gone => {}
        }
    }
    let active = resources
        .wired
        .iter()
        .any(|w| w.index == index && !w.informers.is_empty());
    let pending = wiring.metrics.resource_pending.with_label_values(&[&name]);
    if active {
        resources.pending.remove(&index);
        pending.set(0);
    } else {
        if version_gone.is_none() && answer.not_served.is_some() {
            // Stopped at an earlier pass because its version went: still so while the kind
            // is served at another (asked again: the CRD may have gone meanwhile).
            version_gone = still_served_elsewhere(wiring, resources, index).await;
        }
        let reason = version_gone
            .or(answer.not_served)
            .unwrap_or_else(|| "no kind selected".into());
        resources
            .pending
            .insert(index, wiring.pending_reason(index, &reason));
        pending.set(1);
    }
    recheck
}

/// Kinds of `resources[index]` gone before a resume of theirs began (this replica took the
/// lease or the shard over after its informers stopped), still not served as discovery
/// answers now: no informer of theirs will sync, and their checkpointed objects went with
/// them, so their resumes complete with a delete for every checkpointed key.
async fn complete_gone_resumes(
    wiring: &Wiring,
    resources: &Resources,
    index: usize,
    answer: &Answer,
) {
    for w in resources.wired.iter().filter(|w| {
        w.index == index
            && w.gone
            && !answer.unanswered.contains(&w.api_resource.group)
            && !answer.wants(&w.api_resource)
            && w.routes
                .iter()
                .any(|r| r.resume.as_ref().is_some_and(|r| r.resumer.is_resuming()))
    }) {
        // Deleting is for good: asked again now, under the lock (the pass's answer may
        // predate a CRD created again).
        match served_at(&wiring.client, &w.api_resource).await {
            Ok(versions) if versions.is_empty() => {}
            _ => continue,
        }
        // No informer of the kind ran here (or it stopped before this term's resume began):
        // its objects are found gone at the version of the Lease this replica holds (written
        // at its acquisition or a renewal since, so past anything the last owner published
        // of them), or at a version its informers saw, kept by the resumer, if they did.
        let le = &wiring.config.leader_election;
        let now = if le.enabled {
            let lease = if wiring.shard.is_whole() {
                le.lease_name.clone()
            } else {
                format!("{}-shard-{}", le.lease_name, wiring.shard.label())
            };
            let ns = crate::leader::default_namespace(le);
            crate::cluster::lease_resource_version(&wiring.client, &ns, &lease).await
        } else {
            None
        };
        for resume in w.routes.iter().filter_map(|r| r.resume.as_ref()) {
            if resume.resumer.is_resuming() {
                info!(route = %resume.checkpointer.route(), "Its kind is still not served: every object of its checkpoint is deleted");
                resume.resumer.kind_gone(now.clone());
            }
        }
    }
}

/// Starts watching a kind of `resources[index]` as `start` says.
async fn start_kind(wiring: &Wiring, resources: &mut Resources, index: usize, start: Start) {
    let r = &wiring.config.resources[index];
    let mut switched = None;
    let (i, new, api_resource) = match start {
        Start::Again(i) => {
            // New informers: a resume still running waits for their initial state.
            informers_replaced(&resources.wired[i]);
            (i, false, resources.wired[i].api_resource.clone())
        }
        Start::Switch(i, api_resource) => {
            switched = Some(switch_version(wiring, resources, i, &api_resource).await);
            (i, false, api_resource)
        }
        Start::New(api_resource, namespaced) => {
            match wiring.wire(index, api_resource.clone(), namespaced).await {
                Ok(wired) => {
                    resources.wired.push(wired);
                    (resources.wired.len() - 1, true, api_resource)
                }
                Err(err) => {
                    warn!(resource = %r.effective_name(), error = %err, "Cannot wire a kind now served; retrying at the next refresh");
                    return;
                }
            }
        }
    };
    wiring.add_informers(&mut resources.wired[i]);
    let mut held = Vec::new();
    if let Some((base, h)) = switched {
        held = h;
        hand_over(&resources.wired[i], base, &mut held, &resources.term).await;
    }
    resources.start(i, new, &held).await;
    info!(resource = %kind_name(r, &api_resource), "The API server serves it now; watching (its first list is delivered)");
}

/// What [`stop_kind`] did.
enum Stopped {
    /// Nothing (yet): its group did not answer, discovery failed, or the kind's grace is not
    /// over (then: when it is).
    Not {
        recheck: Option<tokio::time::Instant>,
    },
    /// Its version is no longer served but the kind is, at another: its informers stopped
    /// and nothing was deleted; the reason says so.
    VersionGone(String),
    /// The kind is gone: every resource watching it stopped, what they cached went as
    /// deleted.
    Gone,
}

/// Stops watching `resources.wired[i]`, which discovery no longer selects, once that lasted
/// `kubernetes.discovery_grace`.
async fn stop_kind(
    wiring: &Wiring,
    resources: &mut Resources,
    i: usize,
    answer: &Answer,
    now: tokio::time::Instant,
) -> Stopped {
    let grace = wiring.config.kubernetes.discovery_grace;
    let r = &wiring.config.resources[resources.wired[i].index];
    if answer
        .unanswered
        .contains(&resources.wired[i].api_resource.group)
    {
        // Its group did not answer: unknown is not gone.
        resources.gone_since.remove(&i);
        return Stopped::Not { recheck: None };
    }
    let since = *resources.gone_since.entry(i).or_insert(now);
    if now < since + grace {
        if since == now {
            info!(resource = %kind_name(r, &resources.wired[i].api_resource), ?grace, "Discovery says it is no longer served; stopping it if that lasts");
        }
        return Stopped::Not {
            recheck: Some(since + grace),
        };
    }
    // A version no longer served, of a kind served at another: its objects live on.
    let elsewhere = match served_at(&wiring.client, &resources.wired[i].api_resource).await {
        Ok(versions) => versions,
        Err(err) => {
            warn!(resource = %r.effective_name(), error = %err, "Discovery failed; looking again at the next refresh");
            resources.gone_since.remove(&i);
            return Stopped::Not { recheck: None };
        }
    };
    resources.gone_since.remove(&i);
    if !elsewhere.is_empty() {
        stop_informers(wiring, resources, i).await;
        let wired = &resources.wired[i];
        let reason = version_gone_reason(&wired.api_resource, &elsewhere);
        warn!(resource = %kind_name(r, &wired.api_resource), "{reason}");
        return Stopped::VersionGone(reason);
    }
    kind_gone(wiring, resources, i).await;
    warn!(resource = %kind_name(r, &resources.wired[i].api_resource), "No longer served (its CRD was deleted?): informers stopped");
    Stopped::Gone
}

/// `resources.wired[i]`'s kind is gone. Its objects' deletes came from the watch; what is
/// still cached goes as deleted, to every resource an informer serves (the kind is gone for
/// all of them).
async fn kind_gone(wiring: &Wiring, resources: &mut Resources, i: usize) {
    let gone = resources.wired[i].informers.clone();
    gone.iter().for_each(|i| i.mark_gone());
    futures::future::join_all(gone.iter().map(|i| i.stop())).await;
    for informer in &gone {
        wiring.factory.remove(informer);
    }
    // Every resource holding one of them watches the same kind: it goes as a whole.
    let holders: Vec<usize> = (0..resources.wired.len())
        .filter(|&j| {
            resources.wired[j]
                .informers
                .iter()
                .any(|x| gone.iter().any(|g| Arc::ptr_eq(x, g)))
        })
        .collect();
    for j in holders {
        let rest: Vec<_> = resources.wired[j].informers.clone();
        rest.iter().for_each(|i| i.mark_gone());
        futures::future::join_all(rest.iter().map(|i| i.stop())).await;
        let gone_at = crate::informer::newest_resource_version(
            rest.iter().filter_map(|i| i.last_resource_version()),
        );
        for informer in &rest {
            wiring.factory.remove(informer);
        }
        let w = &mut resources.wired[j];
        w.set_informers(Vec::new());
        w.gone = true;
        // Listeners that were off (a resume waiting for a relist) got no deletes.
        for r in w.routes.iter().filter_map(|r| r.resume.as_ref()) {
            r.resumer.kind_gone(gone_at.clone());
        }
        if j != i {
            resources.gone_since.remove(&j);
        }
    }
}

/// The versions at which the group of `kind` serves its resource now (none: the kind is
/// gone).
/// Why a kind stopped because its version is no longer served waits as pending, while the
/// kind is served at the versions `elsewhere`.
fn version_gone_reason(kind: &ApiResource, elsewhere: &[String]) -> String {
    format!(
        "{}/{} is no longer served, but the kind is, at {elsewhere:?}: its objects live on \
         (nothing is deleted); set api_version to a served version",
        kind.group, kind.version
    )
}

/// The reason of `resources[index]`, stopped (at an earlier pass) because its version is no
/// longer served, while its kind is still served at another version; `None` when it has no
/// such stopped kind, when the kind is gone too, or when discovery fails (the answer's own
/// reason stands then).
async fn still_served_elsewhere(
    wiring: &Wiring,
    resources: &Resources,
    index: usize,
) -> Option<String> {
    for wired in resources.wired.iter().filter(|w| w.index == index) {
        match served_at(&wiring.client, &wired.api_resource).await {
            Ok(elsewhere) if !elsewhere.is_empty() => {
                return Some(version_gone_reason(&wired.api_resource, &elsewhere));
            }
            Ok(_) => {}
            Err(err) => {
                debug!(error = %err, "Discovery failed; the pending reason says what the lookup said");
            }
        }
    }
    None
}

async fn served_at(client: &kube::Client, kind: &ApiResource) -> Result<Vec<String>, kube::Error> {
    let group = match kube::discovery::group(client, &kind.group).await {
        Ok(group) => group,
        Err(kube::Error::Discovery(_)) => return Ok(Vec::new()),
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Vec::new()),
        Err(err) => return Err(err),
    };
    Ok(group
        .versions()
        .filter(|v| {
            group
                .versioned_resources(v)
                .iter()
                .any(|(a, _)| a.plural == kind.plural)
        })
        .map(str::to_owned)
        .collect())
}

/// Stops `resources.wired[i]`'s informers without deleting what they cache (each FIFO drains
/// into the routes first). An informer another wired kind shares runs on for it: only this
/// kind's listeners leave it. Returns, per informer, what its listeners were handed last (its
/// cache once they left it).
async fn stop_informers(
    wiring: &Wiring,
    resources: &mut Resources,
    i: usize,
) -> Vec<Vec<crate::informer::ObjectRef>> {
    let prefixes = resources.wired[i].listener_prefixes();
    let ours =
        |l: &crate::informer::ProcessorListener| prefixes.iter().any(|p| l.name().starts_with(p));
    let mut cached = Vec::new();
    for informer in resources.wired[i].informers.clone() {
        if resources.shared(i, &informer) {
            cached.push(informer.remove_listeners_where(ours));
        } else {
            informer.stop().await;
            wiring.factory.remove(&informer);
            // After the stop: what drained from the FIFO is in the cache too.
            cached.push(informer.indexer().list());
        }
    }
    resources.wired[i].set_informers(Vec::new());
    cached
}

/// New informers replace `wired`'s: a resume still running waits for their initial state.
fn informers_replaced(wired: &super::resources::Wired) {
    for route in &wired.routes {
        if let Some(resume) = &route.resume {
            resume.resumer.informers_replaced(kube::api::TypeMeta {
                api_version: wired.api_resource.api_version.clone(),
                kind: wired.api_resource.kind.clone(),
            });
        }
    }
}

/// Moves wired kind `i` to `api_resource` (the same kind at another version): its informers
/// stop without deleting anything (see [`stop_informers`]), and its routes encode the new
/// version from now on. Returns what the old informers' listeners were handed last (one list
/// per informer), and the listener name prefixes of the routes for which that is not what
/// they passed on (this replica does not lead, a listener of the route was off: a new
/// leader's relist or a checkpoint still to come, or the route's resume is still comparing
/// its first list): those must get a fresh list whole, to compare with their checkpoint.
async fn switch_version(
    wiring: &Wiring,
    resources: &mut Resources,
    i: usize,
    api_resource: &ApiResource,
) -> (Vec<Vec<crate::informer::ObjectRef>>, Vec<String>) {
    let wired = &resources.wired[i];
    let held: Vec<String> = wired
        .routes
        .iter()
        .filter(|r| {
            let prefix = format!("{}@", r.route.queue().name());
            !resources.leading
                || r.resume.as_ref().is_some_and(|r| r.resumer.is_resuming())
                || !wired
                    .informers
                    .iter()
                    .all(|inf| inf.listeners_on_where(|l| l.name().starts_with(prefix.as_str())))
        })
        .map(|r| format!("{}@", r.route.queue().name()))
        .collect();
    let cached = stop_informers(wiring, resources, i).await;
    let wired = &mut resources.wired[i];
    info!(from = %wired.api_resource.version, to = %api_resource.version, kind = %api_resource.kind,
          objects = cached.iter().map(Vec::len).sum::<usize>(), relisted_for = ?held,
          "The kind is served at another version now; following it without deleting anything");
    wired.api_resource = api_resource.clone();
    for route in &wired.routes {
        route
            .route
            .set_encoder(wiring.encoder(&route.sink, api_resource));
        if let Some(resume) = &route.resume {
            resume
                .checkpointer
                .describe_kind(route_kind(api_resource, wired.namespaced));
        }
    }
    informers_replaced(wired);
    (cached, held)
}

/// Starts `wired`'s new informers from `base`, what the informers they replace handed its
/// listeners (one list per informer, in order). One not started yet is seeded with it: its
/// first list is then a relist (client-go's `DeltaFIFO.Replace` against a known cache), which
/// publishes only what changed meanwhile (unchanged objects are resyncs, dropped unless a
/// resync is due; vanished ones are deleted), where a new informer would add everything
/// again; the routes in `held` get that first list whole once it is applied (see
/// [`Resources::start`]). On one another resource already runs, once it has synced, the
/// listeners of the routes not held are switched on with the difference between `base` and
/// its cache; if it does not sync within 10 s (or the term ends) they are held too.
async fn hand_over(
    wired: &super::resources::Wired,
    base: Vec<Vec<crate::informer::ObjectRef>>,
    held: &mut Vec<String>,
    term: &CancellationToken,
) {
    let ours = wired.listener_prefixes();
    for (informer, objects) in wired.informers.iter().zip(base) {
        if !informer.is_spawned() {
            for obj in objects {
                informer
                    .indexer()
                    .upsert(&crate::informer::meta_namespace_key(&obj), obj);
            }
            continue;
        }
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !informer.has_synced()
            && !term.is_cancelled()
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        if !informer.has_synced() || term.is_cancelled() {
            for p in &ours {
                if !held.contains(p) {
                    held.push(p.clone());
                }
            }
            continue;
        }
        informer.activate_listeners_against(objects, |l| {
            ours.iter().any(|p| l.name().starts_with(p.as_str()))
                && !held.iter().any(|p| l.name().starts_with(p.as_str()))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResourceConfig;
    use kube::api::GroupVersionKind;

    fn kind(group: &str, version: &str, kind: &str) -> ApiResource {
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, kind),
            &format!("{}s", kind.to_lowercase()),
        )
    }

    #[test]
    fn a_kind_served_now_starts_and_one_no_longer_served_stops() {
        let (widget, gadget) = (kind("x.io", "v1", "Widget"), kind("x.io", "v1", "Gadget"));
        // Resource 0 watches gadgets; discovery now selects widgets only.
        let wired = [(0, &gadget, true)];
        let p = plan(0, &[(widget.clone(), true)], &wired);
        assert_eq!(p.start, [Start::New(widget.clone(), true)]);
        assert_eq!(p.stop, [0]);
        // Nothing changes while discovery agrees with what is watched.
        let wired = [(0, &widget, true)];
        assert_eq!(
            plan(0, &[(widget.clone(), true)], &wired),
            Plan {
                start: vec![],
                stop: vec![]
            }
        );
    }

    #[test]
    fn a_kind_served_again_reuses_its_routes() {
        let widget = kind("x.io", "v1", "Widget");
        // Wired before, informers stopped when its CRD went: its routes live on.
        let wired = [(0, &widget, false)];
        let p = plan(0, &[(widget.clone(), true)], &wired);
        assert_eq!(p.start, [Start::Again(0)]);
        assert!(p.stop.is_empty());
    }

    #[test]
    fn other_resources_kinds_are_left_alone() {
        let widget = kind("x.io", "v1", "Widget");
        // Resource 1 watches widgets too; resource 0's discovery selects nothing.
        let wired = [(1, &widget, true)];
        assert_eq!(
            plan(0, &[], &wired),
            Plan {
                start: vec![],
                stop: vec![]
            }
        );
        // And resource 0 selecting widgets wires its own routes.
        let p = plan(0, &[(widget.clone(), true)], &wired);
        assert_eq!(p.start, [Start::New(widget, true)]);
    }

    #[test]
    fn a_version_change_switches_the_kind_without_stopping_it() {
        // A CRD's preferred version moving: the same objects, the same routes.
        let (beta, v1) = (
            kind("x.io", "v1beta1", "Widget"),
            kind("x.io", "v1", "Widget"),
        );
        for active in [true, false] {
            let wired = [(0, &beta, active)];
            let p = plan(0, &[(v1.clone(), true)], &wired);
            assert_eq!(p.start, [Start::Switch(0, v1.clone())]);
            assert!(p.stop.is_empty());
        }
    }

    #[test]
    fn a_routes_base_drops_the_sink_and_a_shard_label_only() {
        assert_eq!(route_base("cms/out", "out"), Some("cms"));
        assert_eq!(route_base("cms#2-of-3/out", "out"), Some("cms"));
        assert_eq!(
            route_base("shop/widgets.x.io#0-of-1/out", "out"),
            Some("shop/widgets.x.io")
        );
        // Not a shard label: part of the name.
        assert_eq!(route_base("a#b-of-c/out", "out"), Some("a#b-of-c"));
        assert_eq!(route_base("a#3-of-2/out", "out"), Some("a#3-of-2"));
        // Another sink's route.
        assert_eq!(route_base("cms/team-out", "out"), None);
        assert_eq!(route_base("cms/out", "team/out"), None);
    }

    #[test]
    fn kind_names_of_wildcard_entries_carry_the_resource() {
        let r: ResourceConfig = serde_json::from_value(serde_json::json!(
            {"name": "all", "api_version": "*", "kind": "*"}
        ))
        .unwrap();
        assert_eq!(
            kind_name(&r, &kind("", "v1", "ConfigMap")),
            "all/configmaps"
        );
        assert_eq!(
            kind_name(&r, &kind("x.io", "v1", "Widget")),
            "all/widgets.x.io"
        );
        let one: ResourceConfig = serde_json::from_value(serde_json::json!(
            {"api_version": "x.io/v1", "kind": "Widget"}
        ))
        .unwrap();
        assert_eq!(
            kind_name(&one, &kind("x.io", "v1", "Widget")),
            "widget.x.io"
        );
    }
}
