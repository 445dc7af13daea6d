//! The wired resources: for each configured resource whose kind is served, its routes (one
//! per sink, built by [`RouteBuilder`]) and its informers, and how they start.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use kube::{
    Client,
    api::{ApiResource, TypeMeta},
};
use tokio_util::sync::CancellationToken;

use super::{
    Error,
    checkpoints::{
        Family, Refusal, Resume, Waiter, WaitingRoutes, resume_from_checkpoints,
        wait_for_checkpoint,
    },
};
use crate::{
    config::{Config, ResourceConfig},
    informer::{
        EventType, InformerKey, NotificationHandler, ProcessorListener, SharedIndexInformer,
        SharedInformerFactory,
    },
    message::{Encoder, object_transform},
    metrics::Metrics,
    pipeline::{
        self, Budget, Delivery, Route, RouteBuilder, RouteQueue, checkpoint::RouteKind, filter,
    },
    shard::Shard,
    sinks::{self, CheckpointStore, kafka::KafkaSink},
    workqueue::rate_limiter::RetrySettings,
};

/// What a route of `api_resource` records of its kind in its checkpoint.
pub(super) fn route_kind(api_resource: &ApiResource, namespaced: bool) -> RouteKind {
    RouteKind {
        api_version: api_resource.api_version.clone(),
        kind: api_resource.kind.clone(),
        plural: api_resource.plural.clone(),
        namespaced,
    }
}

/// The name of a wired kind in its routes' queues, metrics and checkpoints: the entry's
/// name, and for a `kind: "*"` entry `/` and the kind's resource (`configmaps`,
/// `widgets.example.com`).
pub(super) fn kind_name(r: &ResourceConfig, api_resource: &ApiResource) -> String {
    let entry = r.effective_name();
    if !r.is_wildcard() {
        return entry;
    }
    if api_resource.group.is_empty() {
        format!("{entry}/{}", api_resource.plural)
    } else {
        format!("{entry}/{}.{}", api_resource.plural, api_resource.group)
    }
}

/// What wiring a configured resource takes, at build or later when its kind appears.
pub(super) struct Wiring {
    pub(super) config: Arc<Config>,
    pub(super) client: Client,
    pub(super) metrics: Arc<Metrics>,
    pub(super) factory: Arc<SharedInformerFactory>,
    pub(super) deliveries: HashMap<String, (Arc<Delivery>, Arc<Budget>)>,
    pub(super) stores: HashMap<String, Arc<dyn CheckpointStore>>,
    pub(super) kafka_sinks: HashMap<String, Arc<KafkaSink>>,
    /// With leader election: the lease's local validity, checked before each hand-over.
    pub(super) fence: Option<crate::leader::Fence>,
    /// The shard these routes and informers serve ([`Shard::WHOLE`] without sharding).
    pub(super) shard: Shard,
}

/// One route of a wired resource.
pub(super) struct WiredRoute {
    pub(super) route: Arc<Route>,
    pub(super) workers: usize,
    /// What its listeners hand notifications to: the queue, or the stages in front of it.
    pub(super) handler: Arc<dyn NotificationHandler>,
    /// The sink's name.
    pub(super) sink: String,
    pub(super) resume: Option<Resume>,
}

/// A configured resource whose kind was resolved. Its routes live as long as the process
/// (across a CRD's deletion and re-creation); its informers while the kind is served.
pub(super) struct Wired {
    pub(super) index: usize,
    pub(super) api_resource: ApiResource,
    pub(super) namespaced: bool,
    pub(super) routes: Vec<WiredRoute>,
    /// Its informers now (change them with [`Wired::set_informers`]).
    pub(super) informers: Vec<Arc<SharedIndexInformer>>,
    /// Follows `informers`, for tasks that outlive a change of them (a route waiting for its
    /// checkpoint switches on the informers of the moment it loads).
    pub(super) current: tokio::sync::watch::Sender<Vec<Arc<SharedIndexInformer>>>,
    /// Its kind is gone (discovery stopped its informers: its CRD was deleted) until it is
    /// served again. A resume that begins meanwhile (this replica became leader, or took the
    /// shard, after the kind went) completes as gone at discovery's next look that still
    /// finds the kind unserved: a delete for every checkpointed key.
    pub(super) gone: bool,
}

impl Wired {
    /// A wired kind without informers.
    pub(super) fn new(
        index: usize,
        api_resource: ApiResource,
        namespaced: bool,
        routes: Vec<WiredRoute>,
    ) -> Self {
        Self {
            index,
            api_resource,
            namespaced,
            routes,
            informers: Vec::new(),
            current: tokio::sync::watch::Sender::new(Vec::new()),
            gone: false,
        }
    }

    pub(super) fn set_informers(&mut self, informers: Vec<Arc<SharedIndexInformer>>) {
        self.current.send_replace(informers.clone());
        self.informers = informers;
    }

    /// The listener name prefixes (`{route}@`) of its routes.
    pub(super) fn listener_prefixes(&self) -> Vec<String> {
        self.routes
            .iter()
            .map(|r| format!("{}@", r.route.queue().name()))
            .collect()
    }
}

/// The resources: wired, and pending (not served yet, by index, with the reason). Changes
/// (a kind appears or goes, leadership changes) happen under its lock, one at a time.
pub(super) struct Resources {
    pub(super) wired: Vec<Wired>,
    pub(super) pending: BTreeMap<usize, String>,
    pub(super) leading: bool,
    /// The leadership term: cancelled when it ends (switch-ons still waiting for a relist,
    /// and routes waiting for their checkpoint, give up).
    pub(super) term: CancellationToken,
    /// The cluster's identity (uid of namespace kube-system), recorded in checkpoints; empty
    /// when no route has one.
    pub(super) cluster: String,
    /// Routes waiting for their checkpoint, and why.
    pub(super) waiting: WaitingRoutes,
    pub(super) metrics: Arc<Metrics>,
    /// Wired kinds (by index) that discovery answered are gone, since when: they stop once
    /// that lasted `kubernetes.discovery_grace`.
    pub(super) gone_since: HashMap<usize, tokio::time::Instant>,
    /// Set once the app runs: what is wired from then on starts at once.
    pub(super) live: Option<Live>,
    /// With more than one shard, a replica caches only the shards it owns: its informers run
    /// while it leads the shard, and when it stops they stop, their caches go, and this
    /// wiring makes fresh ones (not running) for the next term. `None`: informers always run
    /// (single-leader mode: standbys keep warm caches).
    pub(super) cold: Option<Arc<Wiring>>,
    /// The relists asked for as this replica's term began (see `relist_for_term`), by
    /// informer: becoming leader hands the cache over at once where one is in already.
    pub(super) term_relists: Vec<(Arc<SharedIndexInformer>, u64)>,
}

/// What runs once the app runs.
pub(super) struct Live {
    pub(super) running: pipeline::Running,
    pub(super) checkpoint_tasks: Vec<tokio::task::JoinHandle<()>>,
    pub(super) informers_cancel: CancellationToken,
    pub(super) checkpoints_cancel: CancellationToken,
}

impl Resources {
    /// Begins the resumes of the routes of `self.wired[i]` for every `i` in `which` from their
    /// checkpoints. A route whose checkpoint cannot be used waits (see [`super::checkpoints`]):
    /// its listeners are switched off here and switched on by its own task once the
    /// checkpoint loads. Returns the refusals, and the listener name prefixes of the waiting
    /// routes (not to be switched on by the caller).
    pub(super) async fn begin_resumes(&mut self, which: &[usize]) -> (Vec<Refusal>, Vec<String>) {
        let at: Vec<(usize, usize)> = which
            .iter()
            .flat_map(|&w| {
                self.wired[w]
                    .routes
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.resume.is_some())
                    .map(move |(r, _)| (w, r))
            })
            .collect();
        let resumes: Vec<&Resume> = at
            .iter()
            .map(|&(w, r)| self.wired[w].routes[r].resume.as_ref().expect("filtered"))
            .collect();
        resumes.iter().for_each(|r| r.resumer.term_began());
        let refused = resume_from_checkpoints(&resumes, &self.metrics, &self.cluster).await;
        let mut prefixes = Vec::new();
        let mut refusals = Vec::new();
        for (i, why) in refused {
            let (w, r) = at[i];
            let wired = &self.wired[w];
            let route = &wired.routes[r];
            let resume = route.resume.as_ref().expect("filtered");
            let prefix = format!("{}@", route.route.queue().name());
            wired
                .informers
                .iter()
                .for_each(|i| i.deactivate_listeners_where(|l| l.name().starts_with(&prefix)));
            wait_for_checkpoint(
                Waiter {
                    resume_route: resume.checkpointer.route().to_owned(),
                    resumer: resume.resumer.clone(),
                    checkpointer: resume.checkpointer.clone(),
                    listeners: prefix.clone(),
                    informers: wired.current.subscribe(),
                    family: resume.family.clone(),
                },
                why.clone(),
                self.cluster.clone(),
                self.term.clone(),
                self.waiting.clone(),
                self.metrics.clone(),
            );
            prefixes.push(prefix);
            refusals.push(why);
        }
        (refusals, prefixes)
    }

    /// The listener name prefixes (`{route}@`) of the routes waiting for their checkpoint.
    pub(super) fn waiting_prefixes(&self) -> Vec<String> {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .map(|route| format!("{route}@"))
            .collect()
    }

    /// Forgets which routes wait (their tasks end with the term): the next term's resumes
    /// decide again.
    pub(super) fn clear_waiting(&self) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        for route in waiting.keys() {
            self.metrics
                .checkpoint_waiting
                .with_label_values(&[route])
                .set(0);
        }
        waiting.clear();
    }

    pub(super) fn resumes(&self) -> Vec<&Resume> {
        self.wired
            .iter()
            .flat_map(|w| w.routes.iter().filter_map(|r| r.resume.as_ref()))
            .collect()
    }

    pub(super) fn queues(&self) -> Vec<Arc<RouteQueue>> {
        self.wired
            .iter()
            .flat_map(|w| w.routes.iter().map(|r| r.route.queue().clone()))
            .collect()
    }
}

impl Wiring {
    /// The routes (queues, filters, resumers and checkpointers) of `resources[index]`
    /// (resolved as `api_resource`), without informers.
    pub(super) async fn wire(
        &self,
        index: usize,
        api_resource: ApiResource,
        namespaced: bool,
    ) -> Result<Wired, Error> {
        let (config, metrics) = (&self.config, &self.metrics);
        let r = &config.resources[index];
        let entry = r.effective_name();
        let name = self.route_kind_name(r, &api_resource);
        let informers = r.namespaces.len().max(1);
        let rules = filter::Rules::new(&r.filter_settings())?.map(Arc::new);
        let mut routes = Vec::new();
        let sink_names = config
            .routes
            .iter()
            .filter(|rt| rt.resource == entry)
            .flat_map(|rt| &rt.sinks);
        for sink_name in sink_names {
            let sink_cfg = config
                .sinks
                .iter()
                .find(|s| &s.name == sink_name)
                .expect("validated");
            let (delivery, budget) = &self.deliveries[sink_name.as_str()];
            let retry = &sink_cfg.retry;
            let encoder = self.encoder(sink_name, &api_resource);
            if let (Some(kafka), Some(topics_cfg)) = (
                self.kafka_sinks.get(sink_name.as_str()),
                sink_cfg
                    .kafka
                    .as_ref()
                    .and_then(|k| k.create_topics.as_ref()),
            ) {
                let topics = kafka
                    .topics_for(&encoder.sample_message(), &r.namespaces)
                    .ok_or_else(|| {
                        sinks::Error::Setup(format!(
                            "sink {sink_name}: create_topics needs topics known at start, but the \
                             topic template uses {{namespace}} and resource {name:?} watches all \
                             namespaces"
                        ))
                    })?;
                kafka
                    .create_topics(
                        &topics,
                        topics_cfg.partitions,
                        topics_cfg.replication_factor,
                    )
                    .await?;
            }
            let built = RouteBuilder::new(&name, sink_name, encoder, delivery.clone(), metrics)
                .budget(budget.clone())
                .retry(RetrySettings {
                    base: retry.base_delay,
                    max: retry.max_delay,
                    qps: retry.qps,
                    burst: retry.burst,
                })
                .events(&r.events)
                .fence(self.fence.clone())
                .filter(rules.clone())
                .checkpoint(self.stores.get(sink_name.as_str()).cloned())
                .resume(
                    TypeMeta {
                        api_version: api_resource.api_version.clone(),
                        kind: api_resource.kind.clone(),
                    },
                    informers,
                )
                .build();
            // Both or neither: a checkpointer without a resumer would record acknowledgements
            // that no writer task of the app ever writes.
            debug_assert_eq!(built.resumer.is_some(), built.checkpointer.is_some());
            let resume = match (built.resumer, built.checkpointer) {
                (Some(resumer), Some(checkpointer)) => Some(Resume {
                    checkpointer: {
                        checkpointer.describe_kind(route_kind(&api_resource, namespaced));
                        checkpointer
                    },
                    resumer,
                    interval: sink_cfg.checkpoint_interval,
                    family: Family {
                        base: kind_name(r, &api_resource),
                        sink: sink_name.clone(),
                        shard: self.shard,
                    },
                }),
                _ => None,
            };
            routes.push(WiredRoute {
                route: built.route,
                workers: sink_cfg.workers,
                handler: built.handler,
                sink: sink_name.clone(),
                resume,
            });
        }
        Ok(Wired::new(index, api_resource, namespaced, routes))
    }

    /// New informers for `wired` (one per namespace, or one for all), each with a listener
    /// for every route; not started.
    pub(super) fn add_informers(&self, wired: &mut Wired) {
        let r = &self.config.resources[wired.index];
        let api_resource = &wired.api_resource;
        let transform = object_transform(api_resource, &self.config.message);
        let namespaces: Vec<Option<String>> = if r.namespaces.is_empty() {
            vec![None]
        } else {
            r.namespaces.iter().cloned().map(Some).collect()
        };
        let informers: Vec<_> = namespaces
            .iter()
            .cloned()
            .map(|namespace| {
                let key = InformerKey {
                    group: api_resource.group.clone(),
                    version: api_resource.version.clone(),
                    plural: api_resource.plural.clone(),
                    namespace,
                    label_selector: r.label_selector.clone(),
                    field_selector: r.effective_field_selector(wired.namespaced),
                    shard: Some(self.shard),
                };
                self.factory
                    .informer_for(api_resource, key, Some(transform.clone()))
            })
            .collect();
        wired.set_informers(informers);
        wired.gone = false;
        for route in &wired.routes {
            for (informer, namespace) in wired.informers.iter().zip(&namespaces) {
                let listener = ProcessorListener::new(
                    format!("{}@{}", route.route.queue().name(), informer.name()),
                    &EventType::ALL,
                    r.resync(),
                    route.handler.clone(),
                )
                .for_namespace(namespace.clone());
                // On an informer already running (shared with another resource), the listener
                // starts off and `start` switches it on.
                informer.add_listener(Arc::new(listener));
            }
        }
    }

    /// The name of a wired kind in its routes (see [`kind_name`]), with the shard when there
    /// are several (`configmap#3-of-12`): each shard's routes have their own queue, metrics
    /// and checkpoint.
    pub(super) fn route_kind_name(&self, r: &ResourceConfig, api_resource: &ApiResource) -> String {
        let name = kind_name(r, api_resource);
        if self.shard.is_whole() {
            name
        } else {
            format!("{name}#{}", self.shard.label())
        }
    }

    /// The encoder of routes of `api_resource` to sink `sink`.
    pub(super) fn encoder(&self, sink: &str, api_resource: &ApiResource) -> Encoder {
        let sink_cfg = self
            .config
            .sinks
            .iter()
            .find(|s| s.name == sink)
            .expect("validated");
        Encoder::new(
            &self.config.cluster,
            api_resource,
            &self.config.message,
            sink_cfg.encoding(),
        )
    }

    pub(super) fn pending_reason(&self, index: usize, reason: &str) -> String {
        let r = &self.config.resources[index];
        format!(
            "resource {} ({} {}) is pending: {reason}",
            r.effective_name(),
            r.api_version,
            r.kind
        )
    }
}

impl Resources {
    /// Starts `self.wired[i]` when the app runs: its routes' workers and checkpoint writers
    /// (unless already running), the resume of its routes when this replica publishes, and
    /// its informers. A standby's new listeners and queues start off. When leading, its
    /// routes' listeners that are off (on an informer another resource already runs), and
    /// those of the routes `held` names (listener name prefixes: routes that must compare a
    /// fresh list, after a version switch), are switched on once a fresh list of their
    /// informer is in its cache (each object handed over once); those of routes waiting for
    /// their checkpoint stay off (their own task switches them on).
    pub(super) async fn start(&mut self, i: usize, routes_too: bool, held: &[String]) {
        let leading = self.leading;
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let wired = &mut self.wired[i];
        if routes_too {
            let routes: Vec<(Arc<Route>, usize)> = wired
                .routes
                .iter()
                .map(|r| (r.route.clone(), r.workers))
                .collect();
            live.running.add(&routes);
            for r in wired.routes.iter().filter_map(|r| r.resume.as_ref()) {
                live.checkpoint_tasks.push(tokio::spawn(
                    r.checkpointer
                        .clone()
                        .run(r.interval, live.checkpoints_cancel.clone()),
                ));
            }
        }
        if leading {
            if routes_too {
                self.begin_resumes(&[i]).await;
            }
            let waiting = self.waiting_prefixes();
            let ours = self.wired[i].listener_prefixes();
            let matches = |l: &ProcessorListener, ps: &[String]| {
                ps.iter().any(|p| l.name().starts_with(p.as_str()))
            };
            for informer in &self.wired[i].informers {
                // New informers (not running yet) register listeners on.
                informer.deactivate_listeners_where(|l| matches(l, &waiting) || matches(l, held));
                let switch_on = |l: &ProcessorListener| matches(l, &ours) && !matches(l, &waiting);
                if informer.listeners_on_where(switch_on) {
                    continue;
                }
                let (informer, term) = (informer.clone(), self.term.clone());
                let (ours, waiting) = (ours.clone(), waiting.clone());
                tokio::spawn(async move {
                    let which = |l: &ProcessorListener| {
                        ours.iter().any(|p| l.name().starts_with(p.as_str()))
                            && !waiting.iter().any(|p| l.name().starts_with(p.as_str()))
                    };
                    informer.activate_listeners_after_relist(&term, which).await;
                });
            }
        } else {
            let wired = &self.wired[i];
            wired
                .informers
                .iter()
                .for_each(|i| i.deactivate_listeners());
            // New queues start off. Those of routes wired before are off already, or still
            // drain a hand-over, which switches them off at its end: switching them now would
            // end their term under the acknowledgements in flight (see `Route::record`).
            if routes_too {
                wired
                    .routes
                    .iter()
                    .for_each(|r| r.route.queue().set_active(false));
            }
        }
        let Some(live) = self.live.as_ref() else {
            return;
        };
        if !leading && self.cold.is_some() {
            // Not this replica's shard now: its informers start when it is.
            return;
        }
        for informer in &self.wired[i].informers {
            informer.spawn(&live.informers_cancel);
        }
    }

    /// With cold standby (see [`Resources::cold`]): stops every informer, drops its cache,
    /// and wires fresh ones that do not run yet.
    pub(super) async fn recycle_informers(&mut self) {
        let Some(wiring) = self.cold.clone() else {
            return;
        };
        let mut informers: Vec<Arc<SharedIndexInformer>> = Vec::new();
        for w in &self.wired {
            for i in &w.informers {
                if !informers.iter().any(|x| Arc::ptr_eq(x, i)) {
                    informers.push(i.clone());
                }
            }
        }
        if informers.iter().all(|i| !i.is_spawned()) {
            return;
        }
        futures::future::join_all(informers.iter().map(|i| i.stop())).await;
        for informer in &informers {
            wiring.factory.remove(informer);
            self.metrics
                .informer_cached_objects
                .with_label_values(&[informer.name()])
                .set(0);
            self.metrics
                .informer_synced
                .with_label_values(&[informer.name()])
                .set(0);
            // Its liveness series went with `factory.remove` (a frozen age would look healthy).
        }
        for w in self.wired.iter_mut() {
            if !w.informers.is_empty() {
                wiring.add_informers(w);
                w.informers.iter().for_each(|i| i.deactivate_listeners());
            }
        }
    }

    /// With cold standby: starts the informers that do not run yet.
    pub(super) fn spawn_informers(&self) {
        let Some(live) = self.live.as_ref() else {
            return;
        };
        for w in &self.wired {
            for informer in &w.informers {
                informer.spawn(&live.informers_cancel);
            }
        }
    }

    /// Whether another wired kind than `self.wired[i]` holds `informer` (one informer serves
    /// every resource with the same kind, version, namespace and selectors).
    pub(super) fn shared(&self, i: usize, informer: &Arc<SharedIndexInformer>) -> bool {
        self.wired
            .iter()
            .enumerate()
            .any(|(j, w)| j != i && w.informers.iter().any(|x| Arc::ptr_eq(x, informer)))
    }
}
