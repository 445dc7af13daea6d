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
mod error;
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
use tokio::{net::TcpListener, sync::watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    admin, cluster,
    config::Config,
    informer::{SharedInformerFactory, factory::WatchOptions},
    leader::{self, LeaderElector, membership::Membership},
    metrics::Metrics,
    pipeline::{self, Route},
    selection::{self, ResolvedResource},
    sinks::Sink,
};
pub use error::Error;
use resources::{Live, Resources, Wiring, kind_name};

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
    /// One per shard (one without sharding).
    parts: Vec<ShardPart>,
    sinks: Vec<Arc<dyn Sink>>,
    admin: TcpListener,
    /// With more than one shard: this replica's membership, and what it campaigns for.
    membership: Option<(Membership, Vec<watch::Sender<bool>>)>,
}

/// `kubernetes.watch_stall_timeout` of the config the parts were built from.
fn parts_config_stall(parts: &[ShardPart]) -> std::time::Duration {
    parts
        .first()
        .map(|p| p.wiring.config.kubernetes.watch_stall_timeout)
        .unwrap_or_default()
}

/// One shard's part of the service: its routes and informers, and (with leader election)
/// the elector of its Lease. Without sharding there is one part, for the whole keyspace, on
/// the leader election's Lease.
struct ShardPart {
    /// The sinks as this shard's routes use them (see [`crate::sinks::Sink::shard_view`]).
    sinks: Vec<Arc<dyn crate::sinks::Sink>>,
    wiring: Arc<Wiring>,
    resources: Arc<tokio::sync::Mutex<Resources>>,
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
                max_concurrent_lists: k.max_concurrent_lists,
            },
            metrics.clone(),
        ));
        let opened = sinks::open(&config, &metrics).await?;
        // Which kinds each resource selects now (the same for every shard).
        let mut resolved = Vec::new();
        let mut pending = BTreeMap::new();
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
                        resolved.push((index, api_resource, namespaced));
                    }
                    metrics.resource_pending.with_label_values(&[&name]).set(0);
                }
                Err(err @ cluster::Error::NotServed { .. })
                    if !config.kubernetes.require_all_resources =>
                {
                    pending.insert(index, err.to_string());
                    metrics.resource_pending.with_label_values(&[&name]).set(1);
                }
                Err(err) => return Err(err.into()),
            }
        }
        // Any sink with a checkpoint (kinds that appear later wire their routes then).
        let cluster = if opened.stores.is_empty() {
            String::new()
        } else {
            let uid = cluster::identity(&client).await.map_err(Error::Identity)?;
            info!(cluster = %uid, "Cluster identity (uid of namespace kube-system), recorded in checkpoints");
            uid
        };
        let le = &config.leader_election;
        let shards = config.sharding.all();
        let (namespace, identity) = (leader::default_namespace(le), leader::default_identity(le));
        let mut parts = Vec::new();
        let mut campaigns = Vec::new();
        // Sharded: every shard's fence is capped by the group's hold on the single-leader
        // Lease (see `Membership::hold_group`).
        let cap = crate::leader::FenceCap::default();
        for shard in shards.iter().copied() {
            let (shard_sinks, deliveries) = opened.for_shard(shard);
            let fence = le.enabled.then(|| {
                if shards.len() > 1 {
                    crate::leader::Fence::capped(cap.clone())
                } else {
                    crate::leader::Fence::default()
                }
            });
            let wiring = Arc::new(Wiring {
                config: config.clone(),
                client: client.clone(),
                metrics: metrics.clone(),
                factory: factory.clone(),
                deliveries,
                stores: opened.stores.clone(),
                kafka_sinks: opened.kafka_sinks.clone(),
                fence: fence.clone(),
                shard,
            });
            let mut resources = Resources {
                wired: Vec::new(),
                pending: BTreeMap::new(),
                leading: !le.enabled,
                term: CancellationToken::new(),
                cluster: cluster.clone(),
                waiting: Default::default(),
                metrics: metrics.clone(),
                gone_since: Default::default(),
                live: None,
                cold: (!shard.is_whole()).then(|| wiring.clone()),
                term_relists: Vec::new(),
            };
            for (index, api_resource, namespaced) in &resolved {
                let mut wired = wiring
                    .wire(*index, api_resource.clone(), *namespaced)
                    .await?;
                wiring.add_informers(&mut wired);
                resources.wired.push(wired);
            }
            for (&index, why) in &pending {
                resources
                    .pending
                    .insert(index, wiring.pending_reason(index, why));
            }
            let elector = fence.map(|fence| {
                // A standby holds nothing until it leads.
                resources.wired.iter().for_each(|w| {
                    w.informers.iter().for_each(|i| i.deactivate_listeners());
                });
                resources.queues().iter().for_each(|q| q.set_active(false));
                let gauge = if shard.is_whole() {
                    metrics.leader.clone()
                } else {
                    metrics.shard_owned.with_label_values(&[&shard.label()])
                };
                let longest = config
                    .longest_delivery()
                    .map(|(d, ..)| d)
                    .unwrap_or_default();
                let lease = if shard.is_whole() {
                    le.lease_name.clone()
                } else {
                    format!("{}-shard-{}", le.lease_name, shard.label())
                };
                let elector = LeaderElector::new(
                    client.clone(),
                    le,
                    &namespace,
                    identity.clone(),
                    fence,
                    config.takeover_wait(),
                    gauge,
                )
                .delivering_within(le, longest)
                .announcing_transactions(
                    le,
                    config.transactional_ids(shard),
                    config.longest_unfenced_delivery(),
                )
                .takeover_gauge(metrics.takeover_wait.with_label_values(&[&lease]));
                if shard.is_whole() {
                    elector
                } else {
                    let (tx, rx) = watch::channel(false);
                    campaigns.push(tx);
                    elector.for_lease(lease).campaign_while(rx)
                }
            });
            for (&index, why) in &resources.pending {
                if shard.index == 0 {
                    warn!(resource = %config.resources[index].effective_name(), "{why}; it starts when the API server serves it");
                }
            }
            parts.push(ShardPart {
                sinks: shard_sinks.into_values().collect(),
                wiring,
                resources: Arc::new(tokio::sync::Mutex::new(resources)),
                elector,
            });
        }
        if le.enabled {
            info!(lease = %le.lease_name, namespace = %namespace, identity = %identity, shards = shards.len(), takeover_wait = ?config.takeover_wait(), "Leader election on; standing by");
        } else {
            metrics.leader.set(1);
            // A transactional sink's producer first: it fences an earlier process's, so the
            // checkpoints read next hold everything that process committed.
            for sink in opened.sinks.values() {
                sink.begin_term(crate::shard::Shard::WHOLE, None).await?;
            }
            // This replica publishes from the start: resume before the first list. A checkpoint
            // of another cluster fails the start; one that cannot be read makes its route wait.
            for part in &parts {
                let mut resources = part.resources.lock().await;
                let all: Vec<usize> = (0..resources.wired.len()).collect();
                let (refusals, _) = resources.begin_resumes(&all).await;
                if let Some(err) = checkpoints::start_error(&refusals) {
                    return Err(err);
                }
            }
        }
        let membership = (le.enabled && shards.len() > 1).then(|| {
            (
                Membership::new(
                    client.clone(),
                    le,
                    &namespace,
                    identity.clone(),
                    shards.clone(),
                    metrics.shard_replicas.clone(),
                )
                .takeover_wait(config.takeover_wait())
                .takeover_gauge(metrics.takeover_wait.with_label_values(&[&le.lease_name]))
                .capping(cap.clone())
                .delivering_within(
                    le.renew_deadline
                        + config
                            .longest_delivery()
                            .map(|(d, ..)| d)
                            .unwrap_or_default(),
                ),
                campaigns,
            )
        });
        let address = config.admin.address;
        let admin = TcpListener::bind(address)
            .await
            .map_err(|cause| Error::Admin { address, cause })?;
        Ok(Self {
            client,
            metrics,
            factory,
            parts,
            sinks: opened.sinks.into_values().collect(),
            admin,
            membership,
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
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Report {
        let informers_cancel = CancellationToken::new();
        let admin_cancel = CancellationToken::new();
        let api_ok = Arc::new(AtomicBool::new(true));
        // What `/readyz` reports of pending resources, kept beside the async lock.
        let pending_notes: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let mut waiting = Vec::new();
        for part in &self.parts {
            waiting.push(part.resources.lock().await.waiting.clone());
        }
        let fences = self
            .parts
            .iter()
            .filter_map(|p| p.elector.as_ref())
            .map(|e| (e.lease_name().to_owned(), e.fence()))
            .collect();
        let readiness = health::readiness(
            self.factory.clone(),
            api_ok.clone(),
            self.sinks.clone(),
            pending_notes.clone(),
            waiting,
            fences,
            self.membership.as_ref().map(|(m, _)| m.claim_wait()),
            {
                // Two missed bookmarks (about a minute each) and some slack, or the stall
                // timeout when it is set.
                let stall = parts_config_stall(&self.parts);
                if stall.is_zero() {
                    std::time::Duration::from_secs(150)
                } else {
                    stall
                }
            },
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
        for part in &self.parts {
            let mut resources = part.resources.lock().await;
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
            let mut notes = pending_notes.lock().unwrap_or_else(|e| e.into_inner());
            if notes.is_empty() {
                *notes = resources.pending.values().cloned().collect();
            }
        }
        let all_resources: Vec<_> = self.parts.iter().map(|p| p.resources.clone()).collect();
        let gauges = tokio::spawn(health::update_unfinished_work(
            all_resources.clone(),
            admin_cancel.clone(),
        ));
        let elector_cancel = CancellationToken::new();
        let mut electors = Vec::new();
        let mut follows = Vec::new();
        for part in self.parts.iter_mut() {
            let Some(elector) = &mut part.elector else {
                continue;
            };
            let shard = part.wiring.shard;
            let handovers = (!shard.is_whole()).then(|| {
                ["acquired", "stopped"].map(|change| {
                    self.metrics
                        .shard_handovers
                        .with_label_values(&[&shard.label(), change])
                })
            });
            // A shard handed on drains like a shutdown does, and for no longer.
            let limit = part.wiring.config.shutdown.grace_period;
            follows.push(leadership::follow(
                elector,
                part.resources.clone(),
                part.sinks.clone(),
                shard,
                handovers,
                limit,
            ));
        }
        let mut parts_wiring = Vec::new();
        for (index, part) in self.parts.into_iter().enumerate() {
            if let Some(elector) = part.elector {
                // Each its own: at shutdown a shard's lease is released only if that shard
                // left nothing undelivered.
                let cancel = elector_cancel.child_token();
                electors.push((index, cancel.clone(), tokio::spawn(elector.run(cancel))));
            }
            parts_wiring.push((part.wiring, part.resources));
        }
        let membership_cancel = CancellationToken::new();
        let freeze = CancellationToken::new();
        let membership = self.membership.map(|(membership, campaigns)| {
            let wanted = membership.subscribe();
            let metrics = self.metrics.clone();
            (
                tokio::spawn(membership.run(membership_cancel.clone())),
                tokio::spawn(leadership::campaign(
                    wanted,
                    campaigns,
                    metrics,
                    freeze.clone(),
                )),
            )
        });
        let mut informers_started = 0;
        for resources in &all_resources {
            let mut resources = resources.lock().await;
            for i in 0..resources.wired.len() {
                resources.start(i, false, &[]).await;
            }
            informers_started += resources
                .wired
                .iter()
                .map(|w| w.informers.len())
                .sum::<usize>();
        }
        let discovery_cancel = CancellationToken::new();
        let grace = parts_wiring[0].0.config.shutdown.grace_period;
        let discovery = tokio::spawn(discovery::follow_discovery(
            parts_wiring,
            pending_notes,
            discovery_cancel.clone(),
        ));
        info!(admin = %admin_addr, informers = informers_started, "Started");

        shutdown.await;
        info!(grace_period = ?grace, "Shutting down: stopping informers, then draining the queues");
        // No shard is taken up or handed on from here on: the owned ones drain under their
        // leases (membership goes on renewing, so the others do not take them meanwhile).
        freeze.cancel();
        if let Some((_, campaign)) = &membership {
            while !campaign.is_finished() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
        // Nothing is wired or unwired from here on.
        discovery_cancel.cancel();
        let _ = discovery.await;
        let mut locked = Vec::new();
        for resources in &all_resources {
            locked.push(resources.lock().await);
        }
        // Routes still waiting for their checkpoint give up.
        locked.iter().for_each(|r| r.term.cancel());
        informers_cancel.cancel();
        let informers: Vec<_> = locked
            .iter()
            .flat_map(|r| r.wired.iter().flat_map(|w| w.informers.iter().cloned()))
            .collect();
        futures::future::join_all(informers.iter().map(|i| i.stop())).await;
        // What the informers passed on reaches the queues before they drain.
        for resources in &locked {
            for w in &resources.wired {
                w.routes.iter().for_each(|r| r.handler.flush());
            }
        }
        let lives: Vec<Live> = locked
            .iter_mut()
            .map(|r| r.live.take().expect("set at start"))
            .collect();
        let deadline = tokio::time::Instant::now() + grace;
        let mut report = Report::default();
        let mut checkpoint_tasks = Vec::new();
        let drained = futures::future::join_all(lives.into_iter().map(|live| async move {
            let undelivered = live.running.drain(deadline).await;
            (undelivered, live.checkpoint_tasks)
        }))
        .await;
        let mut part_clean = Vec::new();
        for (undelivered, tasks) in drained {
            part_clean.push(undelivered.is_empty());
            report.undelivered.extend(undelivered);
            checkpoint_tasks.extend(tasks);
        }
        // Drained: what the sinks acknowledged goes to the checkpoints, all of it.
        checkpoints_cancel.cancel();
        futures::future::join_all(checkpoint_tasks).await;
        for resources in &locked {
            for r in resources.resumes() {
                if let Err(err) = r.checkpointer.flush().await {
                    warn!(route = %r.checkpointer.route(), error = %err, "Final checkpoint write failed; a restart re-sends what it lacks");
                }
            }
        }
        drop(locked);
        let mut flushed = true;
        for sink in &self.sinks {
            if let Err(err) = sink.flush().await {
                warn!(sink = %sink.name(), error = %err, "Flush at shutdown failed");
                flushed = false;
            }
        }
        // Nothing of this process may reach a broker after the next leader's messages (the
        // followers first: one starting a term would make a transactional producer again).
        follows.iter().for_each(|f| f.abort());
        self.sinks.iter().for_each(|s| {
            s.abandon_queued();
            s.end_terms();
        });
        let mut released = Vec::new();
        for (index, cancel, elector) in electors {
            if flushed && part_clean[index] {
                // Drained and flushed: now the lease can go to another replica at once.
                cancel.cancel();
                released.push(elector);
            } else {
                // Something may still be on its way: the next owner takes over after the
                // lease expires and its takeover wait, not at once.
                elector.abort();
                warn!("Not releasing a lease: messages were left undelivered or a flush failed");
            }
        }
        futures::future::join_all(released).await;
        if let Some((membership, _)) = membership {
            membership_cancel.cancel();
            let _ = membership.await;
        }
        admin_cancel.cancel();
        let _ = admin_task.await;
        let _ = probe.await;
        let _ = gauges.await;
        info!("Stopped");
        report
    }
}
