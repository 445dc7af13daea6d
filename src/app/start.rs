//! Starting a built [`App`]: the admin server and its probes, every route's workers and
//! checkpoint writers, the leadership followers and electors, the membership, the informers,
//! and discovery. What it starts is a [`Running`], which [`super::shutdown`] stops in layers.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use tokio::{sync::Mutex, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::{
    App, ShardPart, discovery, health, leadership,
    resources::{Live, Resources},
};
use crate::{
    admin,
    metrics::Metrics,
    pipeline::{self, Route},
    sinks::Sink,
};

/// Two missed bookmarks (about a minute each) and some slack: when `/readyz` calls a running
/// informer silent, unless `kubernetes.watch_stall_timeout` is set.
const SILENT_AFTER: Duration = Duration::from_secs(150);

/// What runs, and the tokens and tasks shutdown stops it with.
pub(super) struct Running {
    pub(super) sinks: Vec<Arc<dyn Sink>>,
    /// Every shard's resources.
    pub(super) resources: Vec<Arc<Mutex<Resources>>>,
    pub(super) grace: Duration,
    pub(super) informers_cancel: CancellationToken,
    pub(super) checkpoints_cancel: CancellationToken,
    pub(super) admin_cancel: CancellationToken,
    /// The admin server, the API probe and the unfinished-work gauges.
    pub(super) admin_tasks: Vec<JoinHandle<()>>,
    /// Stops taking up and handing on shards (the membership goes on renewing).
    pub(super) freeze: CancellationToken,
    pub(super) membership_cancel: CancellationToken,
    /// The membership's task and its campaign's.
    pub(super) membership: Option<(JoinHandle<()>, JoinHandle<()>)>,
    pub(super) discovery_cancel: CancellationToken,
    pub(super) discovery: JoinHandle<()>,
    /// What follows each elector's changes of leadership.
    pub(super) follows: Vec<JoinHandle<()>>,
    /// Each shard's elector (by part index): each its own, since at shutdown a shard's lease is
    /// released only if that shard left nothing undelivered.
    pub(super) electors: Vec<(usize, CancellationToken, JoinHandle<()>)>,
}

impl App {
    /// Starts everything built (see the module docs).
    pub(super) async fn start(mut self) -> Running {
        let informers_cancel = CancellationToken::new();
        let checkpoints_cancel = CancellationToken::new();
        let admin_cancel = CancellationToken::new();
        // What `/readyz` reports of pending resources, kept beside the async lock.
        let pending_notes: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let (readiness, api_ok) = self.readiness(&pending_notes).await;
        let admin_addr = self.admin_addr();
        let admin = admin::serve(
            self.admin,
            self.metrics.clone(),
            readiness,
            health::liveness(self.sinks.clone()),
            admin_cancel.clone(),
        );
        let mut admin_tasks = vec![
            tokio::spawn(async move {
                let _ = admin.await;
            }),
            tokio::spawn(health::probe_api(
                self.client.clone(),
                api_ok,
                self.metrics.clone(),
                admin_cancel.clone(),
            )),
        ];
        for part in &self.parts {
            start_routes(part, &informers_cancel, &checkpoints_cancel, &pending_notes).await;
        }
        let resources: Vec<_> = self.parts.iter().map(|p| p.resources.clone()).collect();
        admin_tasks.push(tokio::spawn(health::update_unfinished_work(
            resources.clone(),
            admin_cancel.clone(),
        )));
        let follows = follow_leadership(&mut self.parts, &self.metrics);
        let elector_cancel = CancellationToken::new();
        let mut electors = Vec::new();
        let mut parts_wiring = Vec::new();
        for (index, part) in self.parts.into_iter().enumerate() {
            if let Some(elector) = part.elector {
                let cancel = elector_cancel.child_token();
                electors.push((index, cancel.clone(), tokio::spawn(elector.run(cancel))));
            }
            parts_wiring.push((part.wiring, part.resources));
        }
        let membership_cancel = CancellationToken::new();
        let freeze = CancellationToken::new();
        let membership = self.membership.map(|(membership, campaigns)| {
            let wanted = membership.subscribe();
            (
                tokio::spawn(membership.run(membership_cancel.clone())),
                tokio::spawn(leadership::campaign(
                    wanted,
                    campaigns,
                    self.metrics.clone(),
                    freeze.clone(),
                )),
            )
        });
        let informers = start_informers(&resources).await;
        let discovery_cancel = CancellationToken::new();
        let grace = parts_wiring[0].0.config.shutdown.grace_period;
        let discovery = tokio::spawn(discovery::follow_discovery(
            parts_wiring,
            pending_notes,
            discovery_cancel.clone(),
        ));
        info!(admin = %admin_addr, informers, "Started");
        Running {
            sinks: self.sinks,
            resources,
            grace,
            informers_cancel,
            checkpoints_cancel,
            admin_cancel,
            admin_tasks,
            freeze,
            membership_cancel,
            membership,
            discovery_cancel,
            discovery,
            follows,
            electors,
        }
    }

    /// What `/readyz` answers, and the flag the API probe keeps for it.
    async fn readiness(
        &self,
        pending_notes: &Arc<std::sync::Mutex<Vec<String>>>,
    ) -> (admin::Readiness, Arc<AtomicBool>) {
        let api_ok = Arc::new(AtomicBool::new(true));
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
        let stall = self
            .parts
            .first()
            .map(|p| p.wiring.config.kubernetes.watch_stall_timeout)
            .unwrap_or_default();
        let readiness = health::readiness(
            self.factory.clone(),
            api_ok.clone(),
            self.sinks.clone(),
            pending_notes.clone(),
            waiting,
            fences,
            self.membership.as_ref().map(|(m, _)| m.claim_wait()),
            if stall.is_zero() { SILENT_AFTER } else { stall },
        );
        (readiness, api_ok)
    }
}

/// Follows each elector's changes of leadership (see [`leadership::follow`]).
fn follow_leadership(parts: &mut [ShardPart], metrics: &Metrics) -> Vec<JoinHandle<()>> {
    let mut follows = Vec::new();
    for part in parts.iter_mut() {
        let Some(elector) = &mut part.elector else {
            continue;
        };
        let shard = part.wiring.shard;
        let handovers = (!shard.is_whole()).then(|| {
            ["acquired", "stopped"].map(|change| {
                metrics
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
    follows
}

/// Starts the workers of every route of `part` and the checkpoint writers of those that resume;
/// from then on, what is wired starts at once.
async fn start_routes(
    part: &ShardPart,
    informers_cancel: &CancellationToken,
    checkpoints_cancel: &CancellationToken,
    pending_notes: &std::sync::Mutex<Vec<String>>,
) {
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

/// Starts every wired resource's informers; returns how many there are.
async fn start_informers(resources: &[Arc<Mutex<Resources>>]) -> usize {
    let mut started = 0;
    for resources in resources {
        let mut resources = resources.lock().await;
        for i in 0..resources.wired.len() {
            resources.start(i, false, &[]).await;
        }
        started += resources
            .wired
            .iter()
            .map(|w| w.informers.len())
            .sum::<usize>();
    }
    started
}
