//! Builds the whole service from a [`Config`] and runs it until a shutdown signal.
//!
//! For every resource: discovery, and one shared informer per namespace (or one for all). For
//! every sink the resource is routed to (`sinks` opens them): one route with its workers,
//! fed by one listener on each of those informers (`resources`). While it runs, `discovery` wires kinds as they
//! become served, `leadership` switches publishing on and off, and `health` answers
//! `/readyz`. Shutdown goes in layers: stop informers (their FIFOs drain into the route
//! queues), drain every queue within the grace period (`shut_down_with_drain`), report what is
//! left per route, write the checkpoints, flush sinks, release the lease (only if nothing
//! was left undelivered: else it expires, and the next leader waits its takeover wait), stop
//! the admin server.

mod checkpoints;
mod discovery;
mod health;
mod leadership;
mod resources;
mod sinks;

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{Arc, atomic::AtomicBool},
};

use kube::Client;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    admin, cluster,
    config::Config,
    informer::{SharedInformerFactory, factory::WatchOptions},
    leader::{self, LeaderElector},
    metrics::Metrics,
    pipeline::{self, Route, filter},
    selection::{self, ResolvedResource},
    sinks::Sink,
};
use resources::{Live, Resources, Wiring, kind_name};
use sinks::Opened;

/// Errors building or running the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A resource could not be resolved.
    #[error(transparent)]
    Cluster(#[from] cluster::Error),
    /// A sink could not be opened.
    #[error("sinks: {0}")]
    Sink(#[from] crate::sinks::Error),
    /// A route's checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] pipeline::checkpoint::Error),
    /// A route's checkpoint was written for another cluster.
    #[error("{0}")]
    OtherCluster(String),
    /// The cluster's identity could not be read (routes with a checkpoint need it).
    #[error("cluster identity: {0}")]
    Identity(String),
    /// A resource's filter settings do not compile (the config check catches this first).
    #[error("filter: {0}")]
    Filter(#[from] filter::Error),
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
        let Opened {
            sinks,
            kafka_sinks,
            stores,
            deliveries,
        } = sinks::open(&config).await?;
        let fence = config
            .leader_election
            .enabled
            .then(crate::leader::Fence::default);
        let wiring = Arc::new(Wiring {
            config: config.clone(),
            client: client.clone(),
            metrics: metrics.clone(),
            factory: factory.clone(),
            deliveries,
            stores,
            kafka_sinks,
            fence: fence.clone(),
        });
        let mut resources = Resources {
            wired: Vec::new(),
            pending: BTreeMap::new(),
            leading: !config.leader_election.enabled,
            term: CancellationToken::new(),
            cluster: String::new(),
            waiting: Default::default(),
            metrics: metrics.clone(),
            gone_since: Default::default(),
            live: None,
        };
        for (index, r) in config.resources.iter().enumerate() {
            let name = r.effective_name();
            match selection::resolve_all(&client, index, r).await {
                Ok(selection) => {
                    for ResolvedResource {
                        api_resource,
                        namespaced,
                    } in selection.kinds
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
        // Any sink with a checkpoint (kinds that appear later wire their routes then).
        if !wiring.stores.is_empty() {
            resources.cluster = cluster::identity(&client).await.map_err(Error::Identity)?;
            info!(cluster = %resources.cluster, "Cluster identity (uid of namespace kube-system), recorded in checkpoints");
        }
        let le = &config.leader_election;
        let elector = if le.enabled {
            let (namespace, identity) =
                (leader::default_namespace(le), leader::default_identity(le));
            info!(lease = %le.lease_name, namespace = %namespace, identity = %identity, takeover_wait = ?config.takeover_wait(), "Leader election on; standing by");
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
                fence.clone().expect("leader election on"),
                config.takeover_wait(),
                metrics.leader.clone(),
            ))
        } else {
            metrics.leader.set(1);
            // This replica publishes from the start: resume before the first list. A checkpoint
            // of another cluster fails the start; one that cannot be read makes its route wait.
            let all: Vec<usize> = (0..resources.wired.len()).collect();
            let (refusals, _) = resources.begin_resumes(&all).await;
            if let Some(err) = checkpoints::start_error(&refusals) {
                return Err(err);
            }
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
        let waiting = self.resources.lock().await.waiting.clone();
        let readiness = health::readiness(
            self.factory.clone(),
            api_ok.clone(),
            self.sinks.clone(),
            pending_notes.clone(),
            waiting,
        );
        let admin_addr = self.admin_addr();
        let admin_task = tokio::spawn(admin::serve(
            self.admin,
            self.metrics.clone(),
            readiness,
            health::liveness(self.sinks.clone()),
            admin_cancel.clone(),
        ));
        let probe = tokio::spawn(health::probe_api(
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
        let gauges = tokio::spawn(health::update_unfinished_work(
            self.resources.clone(),
            admin_cancel.clone(),
        ));
        let elector_cancel = CancellationToken::new();
        let election = self.elector.map(|elector| {
            let follow = leadership::follow(&elector, self.resources.clone(), self.sinks.clone());
            (tokio::spawn(elector.run(elector_cancel.clone())), follow)
        });
        let informers_started = {
            let mut resources = self.resources.lock().await;
            for i in 0..resources.wired.len() {
                resources.start(i, false, &[]).await;
            }
            resources
                .wired
                .iter()
                .map(|w| w.informers.len())
                .sum::<usize>()
        };
        let discovery_cancel = CancellationToken::new();
        let discovery = tokio::spawn(discovery::follow_discovery(
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
        // Routes still waiting for their checkpoint give up.
        resources.term.cancel();
        informers_cancel.cancel();
        let informers: Vec<_> = resources
            .wired
            .iter()
            .flat_map(|w| w.informers.iter().cloned())
            .collect();
        futures::future::join_all(informers.iter().map(|i| i.stop())).await;
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
        let mut clean = report.undelivered.is_empty();
        for sink in &self.sinks {
            if let Err(err) = sink.flush().await {
                warn!(sink = %sink.name(), error = %err, "Flush at shutdown failed");
                clean = false;
            }
        }
        // Nothing of this process may reach a broker after the next leader's messages.
        self.sinks.iter().for_each(|s| s.abandon_queued());
        if let Some((elector, follow)) = election {
            follow.abort();
            if clean {
                // Drained and flushed: now the lease can go to a standby at once.
                elector_cancel.cancel();
                let _ = elector.await;
            } else {
                // Something may still be on its way: the standby takes over after the lease
                // expires and its takeover wait, not at once.
                elector.abort();
                warn!("Not releasing the lease: messages were left undelivered or a flush failed");
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
