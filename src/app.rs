//! Builds the whole service from a [`Config`] and runs it until a shutdown signal.
//!
//! For every resource: discovery, and one shared informer per namespace (or one for all). For
//! every sink the resource is routed to: one route queue with its workers, fed by one
//! listener on each of those informers. Shutdown goes in layers: stop informers (their FIFOs
//! drain into the route queues), drain every queue within the grace period
//! (`shut_down_with_drain`), report what is left per route, flush sinks, stop the admin server.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use kube::{
    Client,
    api::{ApiResource, TypeMeta},
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    admin,
    cluster::{self, ResolvedResource},
    config::{Config, EventType, ResourceConfig, SinkType},
    informer::{
        InformerKey, NotificationHandler, ProcessorListener, SharedIndexInformer,
        SharedInformerFactory, factory::WatchOptions,
    },
    leader::{self, LeaderElector},
    message::{Encoder, object_transform},
    metrics::Metrics,
    pipeline::{
        self, Budget, CheckpointStore, Checkpointer, Delivery, Resumer, Route, RouteQueue,
        checkpoint::FileCheckpointStore,
        filter::{self, FilterMetrics, RouteFilter},
        resume,
    },
    sinks::{
        self, Sink,
        kafka::{KafkaCheckpointStore, KafkaSink},
        nats::{NatsCheckpointStore, NatsMode, NatsSink},
        stdout::StdoutSink,
    },
    workqueue::{
        TokenBucket,
        rate_limiter::{RetrySettings, controller_rate_limiter},
    },
};

/// How often the API server's health is probed for `/readyz`.
const API_PROBE_PERIOD: Duration = Duration::from_secs(5);

/// Errors building or running the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A resource could not be resolved.
    #[error(transparent)]
    Cluster(#[from] cluster::Error),
    /// A sink could not be opened.
    #[error("sinks: {0}")]
    Sink(#[from] sinks::Error),
    /// A route's checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] pipeline::checkpoint::Error),
    /// The admin address could not be bound.
    #[error("cannot listen on admin address {address}: {source}")]
    Admin {
        /// The configured address.
        address: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What shutdown left behind.
#[derive(Debug, Default)]
pub struct Report {
    /// Notifications not delivered when shutdown ended, per route (`resource/sink`).
    pub undelivered: HashMap<String, usize>,
}

/// A built, not yet running service.
pub struct App {
    client: Client,
    metrics: Arc<Metrics>,
    factory: Arc<SharedInformerFactory>,
    wiring: Arc<Wiring>,
    resources: Arc<tokio::sync::Mutex<Resources>>,
    sinks: Vec<Arc<dyn Sink>>,
    admin: TcpListener,
    elector: Option<LeaderElector>,
}

/// One route's resume: its resumer and the checkpointer its workers record into.
struct Resume {
    resumer: Arc<Resumer>,
    checkpointer: Arc<Checkpointer>,
    interval: Duration,
}

/// Loads the checkpoints of `resumes`, one read per store for all its routes, and starts
/// each route's resume. A store that cannot be read fails the start (`fail_fast`), or else
/// is logged and its routes replay the whole cache (a new leader must publish something).
async fn resume_from_checkpoints(
    resumes: &[&Resume],
    metrics: &Metrics,
    fail_fast: bool,
) -> Result<(), Error> {
    let mut by_store: Vec<(&Arc<dyn CheckpointStore>, Vec<&Resume>)> = Vec::new();
    for &r in resumes {
        let store = r.checkpointer.store();
        match by_store.iter_mut().find(|(s, _)| Arc::ptr_eq(s, store)) {
            Some((_, group)) => group.push(r),
            None => by_store.push((store, vec![r])),
        }
    }
    for (store, group) in by_store {
        let routes: Vec<String> = group
            .iter()
            .map(|r| r.checkpointer.route().to_owned())
            .collect();
        let started = std::time::Instant::now();
        let mut loaded = match store.load_routes(&routes).await {
            Ok(loaded) => loaded,
            Err(err) if fail_fast => return Err(err.into()),
            Err(err) => {
                warn!(error = %err, "Cannot load the checkpoint; replaying the whole cache instead");
                group.iter().for_each(|r| r.resumer.begin(None));
                continue;
            }
        };
        let took = started.elapsed().as_secs_f64();
        for r in group {
            let route = r.checkpointer.route();
            metrics
                .checkpoint_load_seconds
                .with_label_values(&[route])
                .set(took);
            let checkpoint = loaded.remove(route);
            match &checkpoint {
                Some(c) => info!(route, keys = c.len(), seconds = took, "Checkpoint loaded"),
                None => info!(
                    route,
                    store = %store.describe(),
                    "No checkpoint yet: the initial list is published as initial adds"
                ),
            }
            r.resumer.begin(checkpoint);
        }
    }
    Ok(())
}

/// What wiring a configured resource takes, at build or later when its kind appears.
struct Wiring {
    config: Arc<Config>,
    client: Client,
    metrics: Arc<Metrics>,
    factory: Arc<SharedInformerFactory>,
    deliveries: HashMap<String, (Arc<Delivery>, Arc<Budget>)>,
    stores: HashMap<String, Arc<dyn CheckpointStore>>,
    kafka_sinks: HashMap<String, Arc<KafkaSink>>,
}

/// One route of a wired resource.
struct WiredRoute {
    route: Arc<Route>,
    workers: usize,
    /// What its listeners hand notifications to: the queue, or the resumer in front of it.
    handler: Arc<dyn NotificationHandler>,
    /// The types its listeners pass on (all of them with a resumer, which filters after).
    accepted: Vec<EventType>,
    resume: Option<Resume>,
}

/// A configured resource whose kind was resolved. Its routes live as long as the process
/// (across a CRD's deletion and re-creation); its informers while the kind is served.
struct Wired {
    index: usize,
    api_resource: ApiResource,
    namespaced: bool,
    routes: Vec<WiredRoute>,
    informers: Vec<Arc<SharedIndexInformer>>,
    cancel: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// The resources: wired, and pending (not served yet, by index, with the reason). Changes
/// (a kind appears or goes, leadership changes) happen under its lock, one at a time.
struct Resources {
    wired: Vec<Wired>,
    pending: BTreeMap<usize, String>,
    leading: bool,
    /// Set once the app runs: what is wired from then on starts at once.
    live: Option<Live>,
}

/// What runs once the app runs.
struct Live {
    running: pipeline::Running,
    checkpoint_tasks: Vec<tokio::task::JoinHandle<()>>,
    informers_cancel: CancellationToken,
    checkpoints_cancel: CancellationToken,
}

impl Resources {
    fn resumes(&self) -> Vec<&Resume> {
        self.wired
            .iter()
            .flat_map(|w| w.routes.iter().filter_map(|r| r.resume.as_ref()))
            .collect()
    }

    fn queues(&self) -> Vec<Arc<RouteQueue>> {
        self.wired
            .iter()
            .flat_map(|w| w.routes.iter().map(|r| r.route.queue().clone()))
            .collect()
    }
}

impl Wiring {
    /// The route queues, resumers and checkpointers of `resources[index]` (resolved as
    /// `api_resource`), without informers.
    async fn wire(
        &self,
        index: usize,
        api_resource: ApiResource,
        namespaced: bool,
    ) -> Result<Wired, Error> {
        let (config, metrics) = (&self.config, &self.metrics);
        let r = &config.resources[index];
        let entry = r.effective_name();
        let name = kind_name(r, &api_resource);
        let namespaces = if r.namespaces.is_empty() {
            1
        } else {
            r.namespaces.len()
        };
        let rules = filter::Rules::of(r)
            .map_err(|e| sinks::Error::Setup(format!("resources[{index}].filter: {e}")))?
            .map(Arc::new);
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
            let route_name = format!("{name}/{sink_name}");
            let labels = [name.as_str(), sink_name.as_str()];
            let retry = &sink_cfg.retry;
            let queue = Arc::new(RouteQueue::new(
                route_name.clone(),
                Box::new(controller_rate_limiter(RetrySettings {
                    base: retry.base_delay,
                    max: retry.max_delay,
                    qps: retry.qps,
                    burst: retry.burst,
                })),
                metrics.workqueue.for_queue(&route_name),
                budget.clone(),
                metrics.listener_buffered.with_label_values(&labels),
                metrics.listener_coalesced.with_label_values(&labels),
            ));
            // The filter stage, when the resource filters, sits right in front of the queue.
            let front: Arc<dyn NotificationHandler> = match &rules {
                Some(rules) => Arc::new(RouteFilter::new(
                    route_name.clone(),
                    rules.clone(),
                    queue.clone(),
                    r.events.contains(&EventType::Deleted),
                    FilterMetrics {
                        filtered: filter::REASONS.map(|reason| {
                            metrics.filtered.with_label_values(&[
                                name.as_str(),
                                sink_name.as_str(),
                                reason,
                            ])
                        }),
                        errors: metrics
                            .filter_errors
                            .with_label_values(&[name.as_str(), sink_name.as_str()]),
                    },
                )),
                None => queue.clone(),
            };
            let store = self.stores.get(sink_name.as_str()).cloned();
            // With resume, the listeners pass everything to the resumer, which compares
            // the initial state with the checkpoint and applies the type filter after.
            let resumer = store.as_ref().map(|_| {
                Arc::new(Resumer::new(
                    route_name.clone(),
                    front.clone(),
                    &r.events,
                    TypeMeta {
                        api_version: api_resource.api_version.clone(),
                        kind: api_resource.kind.clone(),
                    },
                    namespaces,
                    resume::OUTCOMES.map(|o| {
                        metrics
                            .resume_objects
                            .with_label_values(&[route_name.as_str(), o])
                    }),
                ))
            });
            let (handler, accepted): (Arc<dyn NotificationHandler>, &[EventType]) = match &resumer {
                Some(r) => (r.clone(), &EventType::ALL),
                None => (front.clone(), &r.events),
            };
            let encoder = Encoder::new(
                &config.cluster,
                &api_resource,
                &config.message,
                sink_cfg.encoding(),
            );
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
            let mut route = Route::new(name.clone(), queue, encoder, delivery.clone(), metrics);
            let resume = match (store, resumer) {
                (Some(store), Some(resumer)) => {
                    let checkpointer = Arc::new(Checkpointer::new(
                        route_name.clone(),
                        store,
                        metrics.checkpoint_lag.with_label_values(&[&route_name]),
                        metrics
                            .checkpoint_write_failures
                            .with_label_values(&[&route_name]),
                    ));
                    route = route.with_checkpointer(checkpointer.clone());
                    Some(Resume {
                        resumer,
                        checkpointer,
                        interval: sink_cfg.checkpoint_interval,
                    })
                }
                _ => None,
            };
            routes.push(WiredRoute {
                route: Arc::new(route),
                workers: sink_cfg.workers,
                handler,
                accepted: accepted.to_vec(),
                resume,
            });
        }
        Ok(Wired {
            index,
            api_resource,
            namespaced,
            routes,
            informers: Vec::new(),
            cancel: CancellationToken::new(),
            tasks: Vec::new(),
        })
    }

    /// New informers for `wired` (one per namespace, or one for all), each with a listener
    /// for every route; not started.
    fn add_informers(&self, wired: &mut Wired) {
        let r = &self.config.resources[wired.index];
        let api_resource = &wired.api_resource;
        let transform = object_transform(api_resource, &self.config.message);
        let namespaces: Vec<Option<String>> = if r.namespaces.is_empty() {
            vec![None]
        } else {
            r.namespaces.iter().cloned().map(Some).collect()
        };
        wired.informers = namespaces
            .into_iter()
            .map(|namespace| {
                let key = InformerKey {
                    group: api_resource.group.clone(),
                    version: api_resource.version.clone(),
                    plural: api_resource.plural.clone(),
                    namespace,
                    label_selector: r.label_selector.clone(),
                    field_selector: r.effective_field_selector(wired.namespaced),
                };
                self.factory
                    .informer_for(api_resource, key, Some(transform.clone()))
            })
            .collect();
        for route in &wired.routes {
            for informer in &wired.informers {
                let listener = ProcessorListener::new(
                    format!("{}@{}", route.route.queue().name(), informer.name()),
                    &route.accepted,
                    r.resync(),
                    route.handler.clone(),
                );
                informer
                    .add_listener(Arc::new(listener))
                    .expect("informers start after their listeners are added");
            }
        }
    }

    fn pending_reason(&self, index: usize, reason: &str) -> String {
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
    /// its informers. A standby's new listeners and queues start off.
    async fn start(&mut self, i: usize, routes_too: bool, metrics: &Metrics) {
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
                let resumes: Vec<&Resume> = wired
                    .routes
                    .iter()
                    .filter_map(|r| r.resume.as_ref())
                    .collect();
                // Without fail_fast it cannot fail: a store it cannot read replays.
                let _ = resume_from_checkpoints(&resumes, metrics, false).await;
            }
        } else {
            wired
                .informers
                .iter()
                .for_each(|i| i.deactivate_listeners());
            wired
                .routes
                .iter()
                .for_each(|r| r.route.queue().set_active(false));
        }
        wired.cancel = live.informers_cancel.child_token();
        wired.tasks = wired
            .informers
            .iter()
            .filter_map(|i| i.spawn(wired.cancel.clone()))
            .collect();
    }
}

impl App {
    /// Resolves resources, creates informers, route queues, listeners and sinks, and binds the
    /// admin port.
    pub async fn build(config: Config, client: Client) -> Result<Self, Error> {
        Self::build_with_metrics(config, client, Arc::new(Metrics::new())).await
    }

    /// [`build`](Self::build) with `metrics` made beforehand (those [`cluster::client`]
    /// counts its requests in).
    pub async fn build_with_metrics(
        config: Config,
        client: Client,
        metrics: Arc<Metrics>,
    ) -> Result<Self, Error> {
        let config = Arc::new(config);
        let k = &config.kubernetes;
        let factory = Arc::new(SharedInformerFactory::new(
            client.clone(),
            WatchOptions {
                page_size: k.page_size,
                streaming_list: k.streaming_list,
                watch_timeout_seconds: k.watch_timeout_seconds,
            },
            metrics.clone(),
        ));
        let mut sinks: HashMap<String, Arc<dyn Sink>> = HashMap::new();
        let mut kafka_sinks: HashMap<String, Arc<KafkaSink>> = HashMap::new();
        let mut nats_sinks: HashMap<String, Arc<NatsSink>> = HashMap::new();
        for s in &config.sinks {
            let sink: Arc<dyn Sink> = match s.kind {
                SinkType::Stdout => {
                    let path = s.stdout.as_ref().and_then(|o| o.path.as_deref());
                    Arc::new(StdoutSink::open(&s.name, path).await?)
                }
                SinkType::Nats => {
                    let sink = Arc::new(
                        NatsSink::connect(&s.name, s.nats.as_ref().expect("validated")).await?,
                    );
                    nats_sinks.insert(s.name.clone(), sink.clone());
                    sink
                }
                SinkType::Kafka => {
                    let cfg = s.kafka.as_ref().expect("validated");
                    let sink = Arc::new(KafkaSink::connect(&s.name, cfg).await?);
                    kafka_sinks.insert(s.name.clone(), sink.clone());
                    sink
                }
            };
            sinks.insert(s.name.clone(), sink);
        }
        let mut stores: HashMap<String, Arc<dyn CheckpointStore>> = HashMap::new();
        for s in config.sinks.iter().filter(|s| s.resume) {
            let store: Option<Arc<dyn CheckpointStore>> = match s.kind {
                SinkType::Stdout => s
                    .stdout
                    .as_ref()
                    .and_then(|o| o.path.as_deref())
                    .map(|path| Arc::new(FileCheckpointStore::beside(path)) as _),
                SinkType::Kafka => {
                    let cfg = s.kafka.as_ref().expect("validated");
                    let sink = &kafka_sinks[&s.name];
                    Some(Arc::new(
                        KafkaCheckpointStore::open(&s.name, cfg, sink).await?,
                    ))
                }
                SinkType::Nats => {
                    let cfg = s.nats.as_ref().expect("validated");
                    match cfg.mode {
                        NatsMode::Jetstream => {
                            let sink = &nats_sinks[&s.name];
                            Some(Arc::new(
                                NatsCheckpointStore::open(&s.name, cfg, sink).await?,
                            ))
                        }
                        NatsMode::Core => None,
                    }
                }
            };
            match store {
                Some(store) => {
                    info!(sink = %s.name, checkpoint = %store.describe(), "Resume on");
                    stores.insert(s.name.clone(), store);
                }
                None => info!(sink = %s.name, kind = ?s.kind,
                    "Resume off: this sink keeps no checkpoint (plain standard output, or core NATS)"),
            }
        }
        let mut deliveries = HashMap::new();
        for s in &config.sinks {
            let delivery = Delivery {
                sink: sinks[&s.name].clone(),
                dead_letter: s.dead_letter.as_ref().map(|d| sinks[d].clone()),
                publish_limit: s
                    .rate_limit
                    .as_ref()
                    .map(|l| TokenBucket::new(l.qps, l.burst)),
                max_retries: s.retry.max_retries,
            };
            deliveries.insert(
                s.name.clone(),
                (Arc::new(delivery), Arc::new(Budget::new(s.max_pending))),
            );
        }
        let wiring = Arc::new(Wiring {
            config: config.clone(),
            client: client.clone(),
            metrics: metrics.clone(),
            factory: factory.clone(),
            deliveries,
            stores,
            kafka_sinks,
        });
        let mut resources = Resources {
            wired: Vec::new(),
            pending: BTreeMap::new(),
            leading: !config.leader_election.enabled,
            live: None,
        };
        for (index, r) in config.resources.iter().enumerate() {
            let name = r.effective_name();
            match cluster::resolve_all(&client, index, r).await {
                Ok(kinds) => {
                    for ResolvedResource {
                        api_resource,
                        namespaced,
                    } in kinds
                    {
                        info!(resource = %kind_name(r, &api_resource), plural = %api_resource.plural, namespaced, "Resolved resource");
                        let mut wired = wiring.wire(index, api_resource, namespaced).await?;
                        wiring.add_informers(&mut wired);
                        resources.wired.push(wired);
                    }
                    metrics.resource_pending.with_label_values(&[&name]).set(0);
                }
                Err(err @ cluster::Error::NotServed { .. })
                    if !config.kubernetes.require_all_resources =>
                {
                    let reason = wiring.pending_reason(index, &err.to_string());
                    warn!(resource = %name, "{reason}; it starts when the API server serves it");
                    resources.pending.insert(index, reason);
                    metrics.resource_pending.with_label_values(&[&name]).set(1);
                }
                Err(err) => return Err(err.into()),
            }
        }
        let le = &config.leader_election;
        let elector = if le.enabled {
            let (namespace, identity) =
                (leader::default_namespace(le), leader::default_identity(le));
            info!(lease = %le.lease_name, namespace = %namespace, identity = %identity, "Leader election on; standing by");
            // A standby holds nothing until it leads.
            factory
                .informers()
                .iter()
                .for_each(|i| i.deactivate_listeners());
            resources.queues().iter().for_each(|q| q.set_active(false));
            Some(LeaderElector::new(
                client.clone(),
                le,
                &namespace,
                identity,
                metrics.leader.clone(),
            ))
        } else {
            metrics.leader.set(1);
            // This replica publishes from the start: resume before the first list.
            resume_from_checkpoints(&resources.resumes(), &metrics, true).await?;
            None
        };
        let address = config.admin.address;
        let admin = TcpListener::bind(address)
            .await
            .map_err(|source| Error::Admin { address, source })?;
        Ok(Self {
            client,
            metrics,
            factory,
            wiring,
            resources: Arc::new(tokio::sync::Mutex::new(resources)),
            sinks: sinks.into_values().collect(),
            admin,
            elector,
        })
    }

    /// The address the admin server listens on (useful with port 0).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .expect("bound listener has an address")
    }

    /// The informer factory.
    pub fn factory(&self) -> &Arc<SharedInformerFactory> {
        &self.factory
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Runs until `shutdown` resolves, then shuts down in layers (see the module docs).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Report {
        let informers_cancel = CancellationToken::new();
        let admin_cancel = CancellationToken::new();
        let api_ok = Arc::new(AtomicBool::new(true));
        // What `/readyz` reports of pending resources, kept beside the async lock.
        let pending_notes: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let readiness: admin::Readiness = {
            let factory = self.factory.clone();
            let api_ok = api_ok.clone();
            let sinks = self.sinks.clone();
            let pending_notes = pending_notes.clone();
            Arc::new(move || {
                let mut reasons = Vec::new();
                let mut notes = pending_notes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                for i in factory.informers().iter().filter(|i| !i.has_synced()) {
                    match i.problem() {
                        // Refused: reported, retried, and not a reason to hold the rest back.
                        Some(p) if p.starts_with("forbidden") => {
                            notes.push(format!("informer {}: {p}", i.name()));
                        }
                        Some(p) => {
                            reasons.push(format!("informer {} has not synced: {p}", i.name()))
                        }
                        None => reasons.push(format!("informer {} has not synced", i.name())),
                    }
                }
                if !api_ok.load(Ordering::Relaxed) {
                    reasons.push("the Kubernetes API server is unreachable".into());
                }
                reasons.extend(sinks.iter().filter_map(|s| s.health().err()));
                if reasons.is_empty() {
                    Ok(notes)
                } else {
                    Err(reasons)
                }
            })
        };
        let admin_addr = self.admin_addr();
        let admin_task = tokio::spawn(admin::serve(
            self.admin,
            self.metrics.clone(),
            readiness,
            admin_cancel.clone(),
        ));
        let probe = tokio::spawn(probe_api(
            self.client.clone(),
            api_ok,
            self.metrics.clone(),
            admin_cancel.clone(),
        ));
        let checkpoints_cancel = CancellationToken::new();
        {
            let mut resources = self.resources.lock().await;
            let routes: Vec<(Arc<Route>, usize)> = resources
                .wired
                .iter()
                .flat_map(|w| w.routes.iter().map(|r| (r.route.clone(), r.workers)))
                .collect();
            let checkpoint_tasks = resources
                .resumes()
                .iter()
                .map(|r| {
                    tokio::spawn(
                        r.checkpointer
                            .clone()
                            .run(r.interval, checkpoints_cancel.clone()),
                    )
                })
                .collect();
            resources.live = Some(Live {
                running: pipeline::start(&routes),
                checkpoint_tasks,
                informers_cancel: informers_cancel.clone(),
                checkpoints_cancel: checkpoints_cancel.clone(),
            });
            *pending_notes.lock().unwrap_or_else(|e| e.into_inner()) =
                resources.pending.values().cloned().collect();
        }
        let gauges = tokio::spawn(update_unfinished_work(
            self.resources.clone(),
            admin_cancel.clone(),
        ));
        let elector_cancel = CancellationToken::new();
        let election = self.elector.map(|elector| {
            let mut leading = elector.subscribe();
            let (resources, metrics) = (self.resources.clone(), self.metrics.clone());
            // The elector reports changes of leadership only (renewals are silent); a
            // change seen late may hide a lost-and-regained lease, which is a change too.
            let follow = tokio::spawn(async move {
                while leading.changed().await.is_ok() {
                    let now = *leading.borrow_and_update();
                    let mut resources = resources.lock().await;
                    resources.leading = now;
                    // Every change ends a term: listeners stop and routes drop what they
                    // hold (a worker drops what it took), so nothing of the old term is
                    // published after the new one's replay.
                    let informers: Vec<_> = resources
                        .wired
                        .iter()
                        .flat_map(|w| w.informers.iter().cloned())
                        .collect();
                    let queues = resources.queues();
                    informers.iter().for_each(|i| i.deactivate_listeners());
                    queues.iter().for_each(|q| q.set_active(false));
                    if now {
                        // With resume, the cache is compared with what the last leader's
                        // sink acknowledged (its checkpoint); else it is replayed whole.
                        for r in resources.resumes() {
                            // What this replica's sink acknowledged in an earlier term and
                            // has not written yet belongs in the checkpoint it compares with.
                            if let Err(err) = r.checkpointer.flush().await {
                                warn!(route = %r.checkpointer.route(), error = %err, "Checkpoint write failed before resuming; those objects may be re-sent");
                            }
                        }
                        // Without fail_fast it cannot fail: a store it cannot read replays.
                        let _ =
                            resume_from_checkpoints(&resources.resumes(), &metrics, false).await;
                        // Consumers get the state this replica follows from here on,
                        // including what changed while no replica led: each cached object
                        // once, and what the first list has not cached yet comes from it.
                        queues.iter().for_each(|q| q.set_active(true));
                        let replayed: usize =
                            informers.iter().map(|i| i.activate_listeners()).sum();
                        info!(objects = replayed, "Leading: replayed the cache");
                    }
                }
            });
            (tokio::spawn(elector.run(elector_cancel.clone())), follow)
        });
        let informers_started = {
            let mut resources = self.resources.lock().await;
            for i in 0..resources.wired.len() {
                resources.start(i, false, &self.metrics).await;
            }
            resources
                .wired
                .iter()
                .map(|w| w.informers.len())
                .sum::<usize>()
        };
        let discovery_cancel = CancellationToken::new();
        let discovery = tokio::spawn(follow_discovery(
            self.wiring.clone(),
            self.resources.clone(),
            pending_notes,
            discovery_cancel.clone(),
        ));
        info!(admin = %admin_addr, informers = informers_started, "Started");

        shutdown.await;
        let grace = self.wiring.config.shutdown.grace_period;
        info!(grace_period = ?grace, "Shutting down: stopping informers, then draining the queues");
        // Nothing is wired or unwired from here on.
        discovery_cancel.cancel();
        let _ = discovery.await;
        let mut resources = self.resources.lock().await;
        informers_cancel.cancel();
        let tasks: Vec<_> = resources
            .wired
            .iter_mut()
            .flat_map(|w| w.tasks.drain(..))
            .collect();
        futures::future::join_all(tasks).await;
        let live = resources.live.take().expect("set at start");
        let report = Report {
            undelivered: live
                .running
                .drain(tokio::time::Instant::now() + grace)
                .await,
        };
        // Drained: what the sinks acknowledged goes to the checkpoints, all of it.
        live.checkpoints_cancel.cancel();
        futures::future::join_all(live.checkpoint_tasks).await;
        for r in resources.resumes() {
            if let Err(err) = r.checkpointer.flush().await {
                warn!(route = %r.checkpointer.route(), error = %err, "Final checkpoint write failed; a restart re-sends what it lacks");
            }
        }
        drop(resources);
        // Drained: now the lease can go to a standby.
        elector_cancel.cancel();
        if let Some((elector, follow)) = election {
            let _ = elector.await;
            follow.abort();
        }
        for sink in &self.sinks {
            if let Err(err) = sink.flush().await {
                warn!(sink = %sink.name(), error = %err, "Flush at shutdown failed");
            }
        }
        admin_cancel.cancel();
        let _ = admin_task.await;
        let _ = probe.await;
        let _ = gauges.await;
        info!("Stopped");
        report
    }
}

/// Keeps the wired resources in step with what the API server serves: a pending kind that
/// appears is wired and started (everything from its first list is delivered); a wired kind
/// that is no longer served (its CRD was deleted) has its informers stopped, what they still
/// cache delivered as deleted, and waits as pending again. Looks again at every change of a
/// CRD (a watch of CustomResourceDefinitions, when the service account may) and every
/// `kubernetes.discovery_refresh`.
async fn follow_discovery(
    wiring: Arc<Wiring>,
    resources: Arc<tokio::sync::Mutex<Resources>>,
    notes: Arc<std::sync::Mutex<Vec<String>>>,
    cancel: CancellationToken,
) {
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
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
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
        let mut resources = resources.lock().await;
        refresh(&wiring, &mut resources).await;
        *notes.lock().unwrap_or_else(|e| e.into_inner()) =
            resources.pending.values().cloned().collect();
    }
}

/// The name of a wired kind in its routes' queues, metrics and checkpoints: the entry's
/// name, and for a `kind: "*"` entry `/` and the kind's resource (`configmaps`,
/// `widgets.example.com`).
fn kind_name(r: &ResourceConfig, api_resource: &ApiResource) -> String {
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

fn same_kind(a: &ApiResource, b: &ApiResource) -> bool {
    a.group == b.group && a.version == b.version && a.plural == b.plural
}

/// One look at discovery: see [`follow_discovery`]. A lookup that fails for another reason
/// than "not served" changes nothing (the next one decides).
async fn refresh(wiring: &Wiring, resources: &mut Resources) {
    let config = &wiring.config;
    let metrics = &wiring.metrics;
    for (index, r) in config.resources.iter().enumerate() {
        let name = r.effective_name();
        let (want, not_served) = match cluster::resolve_all(&wiring.client, index, r).await {
            Ok(kinds) => (
                kinds
                    .into_iter()
                    .map(|k| (k.api_resource, k.namespaced))
                    .collect::<Vec<_>>(),
                None,
            ),
            Err(err @ cluster::Error::NotServed { .. }) => (Vec::new(), Some(err.to_string())),
            Err(err) => {
                warn!(resource = %name, error = %err, "Discovery failed; looking again at the next refresh");
                continue;
            }
        };
        for (api_resource, namespaced) in &want {
            let found = resources
                .wired
                .iter()
                .position(|w| w.index == index && same_kind(&w.api_resource, api_resource));
            let (i, new) = match found {
                Some(i) if !resources.wired[i].informers.is_empty() => continue,
                Some(i) => (i, false),
                None => match wiring.wire(index, api_resource.clone(), *namespaced).await {
                    Ok(wired) => {
                        resources.wired.push(wired);
                        (resources.wired.len() - 1, true)
                    }
                    Err(err) => {
                        warn!(resource = %name, error = %err, "Cannot wire a kind now served; retrying at the next refresh");
                        continue;
                    }
                },
            };
            wiring.add_informers(&mut resources.wired[i]);
            resources.start(i, new, metrics).await;
            info!(resource = %kind_name(r, api_resource), "The API server serves it now; watching (its first list is delivered)");
        }
        for i in 0..resources.wired.len() {
            let wired = &mut resources.wired[i];
            if wired.index != index
                || wired.informers.is_empty()
                || want.iter().any(|(a, _)| same_kind(a, &wired.api_resource))
            {
                continue;
            }
            // Its objects' deletes came from the watch; what is still cached goes as deleted.
            wired.informers.iter().for_each(|i| i.mark_gone());
            wired.cancel.cancel();
            futures::future::join_all(wired.tasks.drain(..)).await;
            for informer in wired.informers.drain(..) {
                wiring.factory.remove(&informer);
            }
            warn!(resource = %kind_name(r, &wired.api_resource), "No longer served (its CRD was deleted?): informers stopped");
        }
        let active = resources
            .wired
            .iter()
            .any(|w| w.index == index && !w.informers.is_empty());
        if active {
            resources.pending.remove(&index);
            metrics.resource_pending.with_label_values(&[&name]).set(0);
        } else {
            let reason = not_served.unwrap_or_else(|| "no kind selected".into());
            resources
                .pending
                .insert(index, wiring.pending_reason(index, &reason));
            metrics.resource_pending.with_label_values(&[&name]).set(1);
        }
    }
}

/// client-go refreshes the unfinished-work gauges of every queue every 500 ms.
async fn update_unfinished_work(
    resources: Arc<tokio::sync::Mutex<Resources>>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {
                let queues = resources.lock().await.queues();
                queues.iter().for_each(|q| q.queue().update_unfinished_work());
            }
        }
    }
}

/// Probes the API server every few seconds so that `/readyz` reports an outage even while
/// watches are quiet.
async fn probe_api(
    client: Client,
    ok: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(API_PROBE_PERIOD);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let reachable = matches!(
            tokio::time::timeout(API_PROBE_PERIOD, client.apiserver_version()).await,
            Ok(Ok(_))
        );
        if ok.swap(reachable, Ordering::Relaxed) != reachable {
            if reachable {
                info!("Kubernetes API server reachable again");
            } else {
                warn!(
                    "Kubernetes API server unreachable; informers retry with backoff, the cache is kept"
                );
            }
        }
        metrics.api_reachable.set(reachable as i64);
    }
}
