//! Builds the whole service from a [`Config`] and runs it until a shutdown signal.
//!
//! For every resource: discovery, and one shared informer per namespace (or one for all). For
//! every sink the resource is routed to: one route queue with its workers, fed by one
//! listener on each of those informers. Shutdown goes in layers: stop informers (their FIFOs
//! drain into the route queues), drain every queue within the grace period
//! (`shut_down_with_drain`), report what is left per route, flush sinks, stop the admin server.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use kube::{Client, api::TypeMeta};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    admin,
    cluster::{self, ResolvedResource},
    config::{Config, EventType, SinkType},
    informer::{
        InformerKey, NotificationHandler, ProcessorListener, SharedInformerFactory,
        factory::WatchOptions,
    },
    leader::{self, LeaderElector},
    message::{Encoder, object_transform},
    metrics::Metrics,
    pipeline::{
        self, Budget, CheckpointStore, Checkpointer, Delivery, Resumer, Route, RouteQueue,
        checkpoint::FileCheckpointStore, resume,
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
    config: Config,
    client: Client,
    metrics: Arc<Metrics>,
    factory: Arc<SharedInformerFactory>,
    routes: Vec<(Arc<Route>, usize)>,
    sinks: Vec<Arc<dyn Sink>>,
    admin: TcpListener,
    elector: Option<LeaderElector>,
    resumes: Arc<Vec<Resume>>,
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
    resumes: &[Resume],
    metrics: &Metrics,
    fail_fast: bool,
) -> Result<(), Error> {
    let mut by_store: Vec<(&Arc<dyn CheckpointStore>, Vec<&Resume>)> = Vec::new();
    for r in resumes {
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
        let mut deliveries: HashMap<&str, (Arc<Delivery>, Arc<Budget>)> = HashMap::new();
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
                s.name.as_str(),
                (Arc::new(delivery), Arc::new(Budget::new(s.max_pending))),
            );
        }
        let mut routes = Vec::new();
        let mut resumes = Vec::new();
        for (index, r) in config.resources.iter().enumerate() {
            let ResolvedResource {
                api_resource,
                namespaced,
            } = cluster::resolve(&client, index, r).await?;
            let name = r.effective_name();
            info!(resource = %name, plural = %api_resource.plural, namespaced, "Resolved resource");
            let transform = object_transform(&api_resource, &config.message);
            let namespaces: Vec<Option<String>> = if r.namespaces.is_empty() {
                vec![None]
            } else {
                r.namespaces.iter().cloned().map(Some).collect()
            };
            let informers: Vec<_> = namespaces
                .into_iter()
                .map(|namespace| {
                    let key = InformerKey {
                        group: api_resource.group.clone(),
                        version: api_resource.version.clone(),
                        plural: api_resource.plural.clone(),
                        namespace,
                        label_selector: r.label_selector.clone(),
                        field_selector: r.field_selector.clone(),
                    };
                    factory.informer_for(&api_resource, key, Some(transform.clone()))
                })
                .collect();
            let sink_names = config
                .routes
                .iter()
                .filter(|rt| rt.resource == name)
                .flat_map(|rt| &rt.sinks);
            for sink_name in sink_names {
                let sink_cfg = config
                    .sinks
                    .iter()
                    .find(|s| &s.name == sink_name)
                    .expect("validated");
                let (delivery, budget) = &deliveries[sink_name.as_str()];
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
                let store = stores.get(sink_name.as_str()).cloned();
                // With resume, the listeners pass everything to the resumer, which compares
                // the initial state with the checkpoint and applies the type filter after.
                let resumer = store.as_ref().map(|_| {
                    Arc::new(Resumer::new(
                        route_name.clone(),
                        queue.clone(),
                        &r.events,
                        TypeMeta {
                            api_version: api_resource.api_version.clone(),
                            kind: api_resource.kind.clone(),
                        },
                        informers.len(),
                        resume::OUTCOMES.map(|o| {
                            metrics
                                .resume_objects
                                .with_label_values(&[route_name.as_str(), o])
                        }),
                    ))
                });
                let (handler, accepted): (Arc<dyn NotificationHandler>, &[EventType]) =
                    match &resumer {
                        Some(r) => (r.clone(), &EventType::ALL),
                        None => (queue.clone(), &r.events),
                    };
                for informer in &informers {
                    let listener = ProcessorListener::new(
                        format!("{route_name}@{}", informer.name()),
                        accepted,
                        r.resync(),
                        handler.clone(),
                    );
                    informer
                        .add_listener(Arc::new(listener))
                        .expect("informers start after build");
                }
                let encoder = Encoder::new(
                    &config.cluster,
                    &api_resource,
                    &config.message,
                    sink_cfg.encoding(),
                );
                if let (Some(kafka), Some(topics_cfg)) = (
                    kafka_sinks.get(sink_name.as_str()),
                    sink_cfg
                        .kafka
                        .as_ref()
                        .and_then(|k| k.create_topics.as_ref()),
                ) {
                    let topics = kafka.topics_for(&encoder.sample_message(), &r.namespaces).ok_or_else(|| {
                        sinks::Error::Setup(format!(
                            "sink {sink_name}: create_topics needs topics known at start, but the topic \
                             template uses {{namespace}} and resource {name:?} watches all namespaces"
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
                let mut route =
                    Route::new(name.clone(), queue, encoder, delivery.clone(), &metrics);
                if let (Some(store), Some(resumer)) = (store, resumer) {
                    let checkpointer = Arc::new(Checkpointer::new(
                        route_name.clone(),
                        store,
                        metrics.checkpoint_lag.with_label_values(&[&route_name]),
                        metrics
                            .checkpoint_write_failures
                            .with_label_values(&[&route_name]),
                    ));
                    route = route.with_checkpointer(checkpointer.clone());
                    resumes.push(Resume {
                        resumer,
                        checkpointer,
                        interval: sink_cfg.checkpoint_interval,
                    });
                }
                routes.push((Arc::new(route), sink_cfg.workers));
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
            routes.iter().for_each(|(r, _)| r.queue().set_active(false));
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
            resume_from_checkpoints(&resumes, &metrics, true).await?;
            None
        };
        let address = config.admin.address;
        let admin = TcpListener::bind(address)
            .await
            .map_err(|source| Error::Admin { address, source })?;
        Ok(Self {
            config,
            client,
            metrics,
            factory,
            routes,
            sinks: sinks.into_values().collect(),
            admin,
            elector,
            resumes: Arc::new(resumes),
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
        let readiness: admin::Readiness = {
            let factory = self.factory.clone();
            let api_ok = api_ok.clone();
            let sinks = self.sinks.clone();
            Arc::new(move || {
                let mut reasons: Vec<String> = factory
                    .informers()
                    .iter()
                    .filter(|i| !i.has_synced())
                    .map(|i| format!("informer {} has not synced", i.name()))
                    .collect();
                if !api_ok.load(Ordering::Relaxed) {
                    reasons.push("the Kubernetes API server is unreachable".into());
                }
                reasons.extend(sinks.iter().filter_map(|s| s.health().err()));
                if reasons.is_empty() {
                    Ok(())
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
        let queues: Vec<Arc<RouteQueue>> =
            self.routes.iter().map(|(r, _)| r.queue().clone()).collect();
        let gauges = tokio::spawn(update_unfinished_work(queues.clone(), admin_cancel.clone()));
        let running = pipeline::start(&self.routes);
        let checkpoints_cancel = CancellationToken::new();
        let checkpoint_tasks: Vec<_> = self
            .resumes
            .iter()
            .map(|r| {
                tokio::spawn(
                    r.checkpointer
                        .clone()
                        .run(r.interval, checkpoints_cancel.clone()),
                )
            })
            .collect();
        let elector_cancel = CancellationToken::new();
        let election = self.elector.map(|elector| {
            let mut leading = elector.subscribe();
            let (queues, factory) = (queues.clone(), self.factory.clone());
            let (resumes, metrics) = (self.resumes.clone(), self.metrics.clone());
            // The elector reports changes of leadership only (renewals are silent); a
            // change seen late may hide a lost-and-regained lease, which is a change too.
            let follow = tokio::spawn(async move {
                while leading.changed().await.is_ok() {
                    let now = *leading.borrow_and_update();
                    // Every change ends a term: listeners stop and routes drop what they
                    // hold (a worker drops what it took), so nothing of the old term is
                    // published after the new one's replay.
                    let informers = factory.informers();
                    informers.iter().for_each(|i| i.deactivate_listeners());
                    queues.iter().for_each(|q| q.set_active(false));
                    if now {
                        // With resume, the cache is compared with what the last leader's
                        // sink acknowledged (its checkpoint); else it is replayed whole.
                        for r in resumes.iter() {
                            // What this replica's sink acknowledged in an earlier term and
                            // has not written yet belongs in the checkpoint it compares with.
                            if let Err(err) = r.checkpointer.flush().await {
                                warn!(route = %r.checkpointer.route(), error = %err, "Checkpoint write failed before resuming; those objects may be re-sent");
                            }
                        }
                        // Without fail_fast it cannot fail: a store it cannot read replays.
                        let _ = resume_from_checkpoints(&resumes, &metrics, false).await;
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
        let informer_tasks = self.factory.start(&informers_cancel);
        info!(admin = %admin_addr, informers = informer_tasks.len(), routes = queues.len(), "Started");

        shutdown.await;
        let grace = self.config.shutdown.grace_period;
        info!(grace_period = ?grace, "Shutting down: stopping informers, then draining the queues");
        informers_cancel.cancel();
        futures::future::join_all(informer_tasks).await;
        let report = Report {
            undelivered: running.drain(tokio::time::Instant::now() + grace).await,
        };
        // Drained: what the sinks acknowledged goes to the checkpoints, all of it.
        checkpoints_cancel.cancel();
        futures::future::join_all(checkpoint_tasks).await;
        for r in self.resumes.iter() {
            if let Err(err) = r.checkpointer.flush().await {
                warn!(route = %r.checkpointer.route(), error = %err, "Final checkpoint write failed; a restart re-sends what it lacks");
            }
        }
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

/// client-go refreshes the unfinished-work gauges of every queue every 500 ms.
async fn update_unfinished_work(queues: Vec<Arc<RouteQueue>>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => queues.iter().for_each(|q| q.queue().update_unfinished_work()),
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
