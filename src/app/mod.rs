//! Builds the whole service from a [`Config`] and runs it until a shutdown signal.
//!
//! For every resource: discovery, and one shared informer per namespace (or one for all). For
//! every sink the resource is routed to (`sinks` opens them): one route with its workers,
//! fed by one listener on each of those informers (`resources`). `build` resolves the kinds
//! and makes one part per shard; `start` starts them. While it runs, `discovery` wires kinds
//! as they become served, `leadership` switches publishing on and off, and `health` answers
//! `/readyz`. `shutdown` stops it in layers: stop informers (their FIFOs drain into the route
//! queues), drain every queue within the grace period, report what is left per route, write
//! the checkpoints, flush sinks, release the lease (only if nothing was left undelivered:
//! else it expires, and the next leader waits its takeover wait), stop the admin server.

mod build;
mod checkpoints;
mod discovery;
mod error;
mod health;
mod leadership;
mod resources;
mod shutdown;
mod sinks;
mod start;

use std::{collections::HashMap, net::SocketAddr, sync::Arc};

use kube::Client;
use tokio::{net::TcpListener, sync::watch};
use tracing::info;

use crate::{
    config::Config,
    informer::{SharedInformerFactory, factory::WatchOptions},
    leader::{self, FenceCap, LeaderElector, membership::Membership},
    metrics::Metrics,
    sinks::Sink,
};
pub use error::Error;
use resources::{Resources, Wiring};

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

    /// [`build`](Self::build) with `metrics` made beforehand (those [`crate::cluster::client`]
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
        let resolved = build::resolve(&config, &client, &metrics).await?;
        let cluster = build::cluster_identity(&opened, &client).await?;
        let le = &config.leader_election;
        let shards = config.sharding.all();
        let (namespace, identity) = (leader::default_namespace(le), leader::default_identity(le));
        let cap = FenceCap::default();
        let builder = build::Parts {
            config: &config,
            client: &client,
            metrics: &metrics,
            factory: &factory,
            opened: &opened,
            resolved: &resolved,
            cluster: &cluster,
            namespace: &namespace,
            identity: &identity,
            cap: &cap,
        };
        let mut parts = Vec::new();
        let mut campaigns = Vec::new();
        for shard in shards.iter().copied() {
            parts.push(
                builder
                    .part(shard, shards.len() > 1, &mut campaigns)
                    .await?,
            );
        }
        if le.enabled {
            info!(lease = %le.lease_name, namespace = %namespace, identity = %identity, shards = shards.len(), takeover_wait = ?config.takeover_wait(), "Leader election on; standing by");
        } else {
            metrics.leader.set(1);
            build::publish_from_the_start(&opened, &parts).await?;
        }
        let membership = (le.enabled && shards.len() > 1)
            .then(|| (builder.membership(shards.clone()), campaigns));
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

    /// Runs until `shutdown` resolves, then shuts down in layers (see [`shutdown`]).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Report {
        let running = self.start().await;
        shutdown.await;
        running.shut_down().await
    }
}
