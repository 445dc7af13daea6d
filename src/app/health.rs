//! Health: what `/readyz` reports (informers synced, API server reachable, sinks healthy;
//! pending and forbidden kinds as notes), the probe of the API server behind it, and the
//! work queues' unfinished-work gauges.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use kube::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{checkpoints::WaitingRoutes, resources::Resources};
use crate::{admin, informer::SharedInformerFactory, metrics::Metrics, sinks::Sink};

/// How often the API server's health is probed for `/readyz`.
const API_PROBE_PERIOD: Duration = Duration::from_secs(5);

/// What `/healthz` answers: 503 naming every sink that failed for good (liveness then
/// restarts the pod, which resumes from its checkpoints; a leader that stays up would keep the
/// lease and publish nothing).
pub(super) fn liveness(sinks: Vec<Arc<dyn Sink>>) -> admin::Liveness {
    Arc::new(move || {
        let broken: Vec<String> = sinks.iter().filter_map(|s| s.broken()).collect();
        if broken.is_empty() {
            Ok(())
        } else {
            Err(broken)
        }
    })
}

/// What `/readyz` answers: not ready while an informer has not synced (a forbidden one is
/// only noted: it is retried and must not hold the rest back), a route waits for its
/// checkpoint, the API server is unreachable or a sink is unhealthy; `pending` notes the
/// kinds not served yet, and each Lease this replica took over and waits to publish under
/// (`fences`, by Lease name).
#[allow(clippy::too_many_arguments)]
pub(super) fn readiness(
    factory: Arc<SharedInformerFactory>,
    api_ok: Arc<AtomicBool>,
    sinks: Vec<Arc<dyn Sink>>,
    pending: Arc<std::sync::Mutex<Vec<String>>>,
    waiting: Vec<WaitingRoutes>,
    fences: Vec<(String, crate::leader::Fence)>,
    group_wait: Option<(String, crate::leader::membership::ClaimWait)>,
    silent_after: Duration,
) -> admin::Readiness {
    let sharded = group_wait.is_some();
    Arc::new(move || {
        let mut reasons: Vec<String> = waiting
            .iter()
            .flat_map(|w| {
                w.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .map(|(route, why)| format!("route {route} publishes nothing: {why}"))
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut notes = pending.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some((lease, wait)) = &group_wait {
            let until = *wait.lock().unwrap_or_else(|e| e.into_inner());
            let now = tokio::time::Instant::now();
            if let Some(left) = until.filter(|u| *u > now).map(|u| u - now) {
                notes.push(format!(
                    "lease {lease}: the replicas of another shard count or a single leader stopped publishing; claiming shards in {}s, once their messages are delivered or failed (the takeover wait)",
                    left.as_secs_f64().ceil()
                ));
            }
        }
        for (lease, fence) in &fences {
            if let Some(left) = fence.takeover_left() {
                notes.push(format!(
                    "lease {lease}: taken over; publishing in {}s, once the last holder's messages are delivered or failed (the takeover wait)",
                    left.as_secs_f64().ceil()
                ));
            }
        }
        // Sharded, an informer that does not run is of a shard another replica owns (cold
        // standby); otherwise every informer runs.
        // A refusal is noted whether or not the informer synced: RBAC with `list` but not
        // `watch` lets the first list through and then refuses every watch (found against a
        // real API server), so the kind is synced but receives no change.
        for i in factory
            .informers()
            .iter()
            .filter(|i| i.is_spawned() || !sharded)
        {
            match (i.problem(), i.has_synced()) {
                (Some(p), _) if p.starts_with("forbidden") => {
                    notes.push(format!("informer {}: {p}", i.name()));
                }
                (_, true) => {}
                (Some(p), false) => {
                    reasons.push(format!("informer {} has not synced: {p}", i.name()))
                }
                (None, false) => reasons.push(format!("informer {} has not synced", i.name())),
            }
        }
        // A watch heard from neither by an event nor by a bookmark for this long is named
        // (it is restarted after kubernetes.watch_stall_timeout; one that stays silent after
        // that has a problem the restarts do not fix).
        for i in factory.informers().iter().filter(|i| i.is_running()) {
            if let Some(age) = i.last_heard().filter(|a| *a > silent_after) {
                notes.push(format!(
                    "informer {}: nothing heard from the API server (no event or bookmark) for {}s",
                    i.name(),
                    age.as_secs()
                ));
            }
        }
        for name in factory.client_side_shards() {
            notes.push(format!(
                "informer {name}: the API server ignores its shard selector (no ShardedListAndWatch): every object is listed and watched, and filtered here"
            ));
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
}

/// client-go refreshes the unfinished-work gauges of every queue every 500 ms; the watch
/// liveness gauges (`keb_informer_last_event_age_seconds`) go with them.
pub(super) async fn update_unfinished_work(
    resources: Vec<Arc<tokio::sync::Mutex<Resources>>>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {
                for r in &resources {
                    let r = r.lock().await;
                    r.queues().iter().for_each(|q| q.queue().update_unfinished_work());
                    // Watch liveness: seconds since each running informer heard anything.
                    for informer in r.wired.iter().flat_map(|w| w.informers.iter()) {
                        if let Some(age) = informer.last_heard().filter(|_| informer.is_running()) {
                            r.metrics
                                .informer_last_event_age
                                .with_label_values(&[informer.name()])
                                .set(age.as_secs_f64());
                        }
                    }
                }
            }
        }
    }
}

/// Probes the API server every few seconds so that `/readyz` reports an outage even while
/// watches are quiet.
pub(super) async fn probe_api(
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
