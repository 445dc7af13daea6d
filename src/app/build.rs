//! Building the service's parts from a config: the kinds each resource selects now, one part
//! per shard (its wiring, its wired resources, the elector of its Lease), the membership that
//! shares shards, and the start without leader election.

use std::{collections::BTreeMap, sync::Arc};

use kube::{Client, discovery::ApiResource};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{
    ShardPart, checkpoints,
    error::Error,
    resources::{Resources, Wiring, kind_name},
    sinks::Opened,
};
use crate::{
    cluster,
    config::Config,
    informer::SharedInformerFactory,
    leader::{Fence, FenceCap, LeaderElector, membership::Membership},
    metrics::Metrics,
    selection::{self, ResolvedResource},
    shard::Shard,
};

/// The kinds the resources select now: `(resource index, kind, namespaced)`, and the resources
/// whose kind is not served (yet), by index, with why.
pub(super) struct Resolved {
    pub(super) kinds: Vec<(usize, ApiResource, bool)>,
    pub(super) pending: BTreeMap<usize, String>,
}

/// Resolves every configured resource (the same for every shard). A kind not served is
/// pending unless `kubernetes.require_all_resources` makes it a start error.
pub(super) async fn resolve(
    config: &Config,
    client: &Client,
    metrics: &Metrics,
) -> Result<Resolved, Error> {
    let mut resolved = Resolved {
        kinds: Vec::new(),
        pending: BTreeMap::new(),
    };
    for (index, r) in config.resources.iter().enumerate() {
        let name = r.effective_name();
        match selection::resolve_all(client, index, r).await {
            Ok(selection) => {
                for ResolvedResource {
                    api_resource,
                    namespaced,
                } in selection.kinds
                {
                    info!(resource = %kind_name(r, &api_resource), plural = %api_resource.plural, namespaced, "Resolved resource");
                    resolved.kinds.push((index, api_resource, namespaced));
                }
                metrics.resource_pending.with_label_values(&[&name]).set(0);
            }
            Err(err @ cluster::Error::NotServed { .. })
                if !config.kubernetes.require_all_resources =>
            {
                resolved.pending.insert(index, err.to_string());
                metrics.resource_pending.with_label_values(&[&name]).set(1);
            }
            Err(err) => return Err(err.into()),
        }
    }
    Ok(resolved)
}

/// The cluster's identity (uid of namespace kube-system) when any sink keeps a checkpoint
/// (kinds that appear later wire their routes then); empty otherwise.
pub(super) async fn cluster_identity(opened: &Opened, client: &Client) -> Result<String, Error> {
    if opened.stores.is_empty() {
        return Ok(String::new());
    }
    let uid = cluster::identity(client).await.map_err(Error::Identity)?;
    info!(cluster = %uid, "Cluster identity (uid of namespace kube-system), recorded in checkpoints");
    Ok(uid)
}

/// What every shard's part is built from.
pub(super) struct Parts<'a> {
    pub(super) config: &'a Arc<Config>,
    pub(super) client: &'a Client,
    pub(super) metrics: &'a Arc<Metrics>,
    pub(super) factory: &'a Arc<SharedInformerFactory>,
    pub(super) opened: &'a Opened,
    pub(super) resolved: &'a Resolved,
    pub(super) cluster: &'a str,
    /// The Lease namespace and this replica's identity in it.
    pub(super) namespace: &'a str,
    pub(super) identity: &'a str,
    /// Sharded: every shard's fence is capped by the group's hold on the single-leader Lease
    /// (see `Membership::hold_group`).
    pub(super) cap: &'a FenceCap,
}

impl Parts<'_> {
    /// Shard `shard`'s part: its wiring, its routes and informers (switched off on a standby),
    /// and with leader election its elector. A sharded elector campaigns while the sender
    /// pushed onto `campaigns` says so.
    pub(super) async fn part(
        &self,
        shard: Shard,
        sharded: bool,
        campaigns: &mut Vec<watch::Sender<bool>>,
    ) -> Result<ShardPart, Error> {
        let le = &self.config.leader_election;
        let (shard_sinks, deliveries) = self.opened.for_shard(shard);
        let fence = le.enabled.then(|| {
            if sharded {
                Fence::capped(self.cap.clone())
            } else {
                Fence::default()
            }
        });
        let wiring = Arc::new(Wiring {
            config: self.config.clone(),
            client: self.client.clone(),
            metrics: self.metrics.clone(),
            factory: self.factory.clone(),
            deliveries,
            stores: self.opened.stores.clone(),
            kafka_sinks: self.opened.kafka_sinks.clone(),
            fence: fence.clone(),
            shard,
        });
        let mut resources = Resources {
            wired: Vec::new(),
            pending: BTreeMap::new(),
            leading: !le.enabled,
            term: CancellationToken::new(),
            cluster: self.cluster.to_owned(),
            waiting: Default::default(),
            metrics: self.metrics.clone(),
            gone_since: Default::default(),
            live: None,
            cold: (!shard.is_whole()).then(|| wiring.clone()),
            term_relists: Vec::new(),
        };
        for (index, api_resource, namespaced) in &self.resolved.kinds {
            let mut wired = wiring
                .wire(*index, api_resource.clone(), *namespaced)
                .await?;
            wiring.add_informers(&mut wired);
            resources.wired.push(wired);
        }
        for (&index, why) in &self.resolved.pending {
            resources
                .pending
                .insert(index, wiring.pending_reason(index, why));
            if shard.index == 0 {
                warn!(resource = %self.config.resources[index].effective_name(), "{}; it starts when the API server serves it", resources.pending[&index]);
            }
        }
        let elector = fence.map(|fence| {
            // A standby holds nothing until it leads.
            resources.wired.iter().for_each(|w| {
                w.informers.iter().for_each(|i| i.deactivate_listeners());
            });
            resources.queues().iter().for_each(|q| q.set_active(false));
            self.elector(shard, fence, campaigns)
        });
        Ok(ShardPart {
            sinks: shard_sinks.into_values().collect(),
            wiring,
            resources: Arc::new(tokio::sync::Mutex::new(resources)),
            elector,
        })
    }

    /// The elector of shard `shard`'s Lease (the leader election's Lease without sharding).
    fn elector(
        &self,
        shard: Shard,
        fence: Fence,
        campaigns: &mut Vec<watch::Sender<bool>>,
    ) -> LeaderElector {
        let (config, le) = (self.config, &self.config.leader_election);
        let gauge = if shard.is_whole() {
            self.metrics.leader.clone()
        } else {
            self.metrics
                .shard_owned
                .with_label_values(&[&shard.label()])
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
            self.client.clone(),
            le,
            self.namespace,
            self.identity.to_owned(),
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
        .takeover_gauge(self.metrics.takeover_wait.with_label_values(&[&lease]));
        if shard.is_whole() {
            elector
        } else {
            let (tx, rx) = watch::channel(false);
            campaigns.push(tx);
            elector.for_lease(lease).campaign_while(rx)
        }
    }

    /// With more than one shard: this replica's membership of the group that shares them.
    pub(super) fn membership(&self, shards: Vec<Shard>) -> Membership {
        let (config, le) = (self.config, &self.config.leader_election);
        let longest = config
            .longest_delivery()
            .map(|(d, ..)| d)
            .unwrap_or_default();
        Membership::new(
            self.client.clone(),
            le,
            self.namespace,
            self.identity.to_owned(),
            shards,
            self.metrics.shard_replicas.clone(),
        )
        .takeover_wait(config.takeover_wait())
        .takeover_gauge(
            self.metrics
                .takeover_wait
                .with_label_values(&[&le.lease_name]),
        )
        .capping(self.cap.clone())
        .delivering_within(le.renew_deadline + longest)
    }
}

/// Without leader election this replica publishes from the start: its transactional sinks
/// begin their term, and every route resumes before the first list.
pub(super) async fn publish_from_the_start(
    opened: &Opened,
    parts: &[ShardPart],
) -> Result<(), Error> {
    // A transactional sink's producer first: it fences an earlier process's, so the
    // checkpoints read next hold everything that process committed.
    for sink in opened.sinks.values() {
        sink.begin_term(Shard::WHOLE, None).await?;
    }
    // A checkpoint of another cluster fails the start; one that cannot be read makes its
    // route wait.
    for part in parts {
        let mut resources = part.resources.lock().await;
        let all: Vec<usize> = (0..resources.wired.len()).collect();
        let (refusals, _) = resources.begin_resumes(&all).await;
        if let Some(err) = checkpoints::start_error(&refusals) {
            return Err(err);
        }
    }
    Ok(())
}
