//! Shutdown in layers: no more changes of shard ownership or wiring; stop the informers (their
//! FIFOs drain into the route queues); drain every queue within the grace period; write the
//! checkpoints; flush the sinks and end their terms; release each lease whose shard left
//! nothing undelivered (else it expires, and the next owner waits its takeover wait); stop the
//! membership and the admin server.

use tokio::{sync::MutexGuard, task::JoinHandle};
use tracing::{info, warn};

use super::{
    Report,
    resources::{Live, Resources},
    start::Running,
};

/// What draining left: the report, whether each part left nothing undelivered (by part index),
/// and the checkpoint writers still running.
struct Drained {
    report: Report,
    part_clean: Vec<bool>,
    checkpoint_tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Shuts down in layers (see the module docs); returns what was left undelivered.
    pub(super) async fn shut_down(self) -> Report {
        info!(grace_period = ?self.grace, "Shutting down: stopping informers, then draining the queues");
        self.freeze_membership().await;
        // Nothing is wired or unwired from here on.
        self.discovery_cancel.cancel();
        let _ = self.discovery.await;
        let mut locked = Vec::new();
        for resources in &self.resources {
            locked.push(resources.lock().await);
        }
        stop_informers(&locked, &self.informers_cancel).await;
        let drained = drain(&mut locked, self.grace).await;
        // Drained: what the sinks acknowledged goes to the checkpoints, all of it.
        self.checkpoints_cancel.cancel();
        futures::future::join_all(drained.checkpoint_tasks).await;
        write_checkpoints(&locked).await;
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
        self.follows.iter().for_each(|f| f.abort());
        self.sinks.iter().for_each(|s| {
            s.abandon_queued();
            s.end_terms();
        });
        release_leases(self.electors, |index| flushed && drained.part_clean[index]).await;
        if let Some((membership, _)) = self.membership {
            self.membership_cancel.cancel();
            let _ = membership.await;
        }
        self.admin_cancel.cancel();
        futures::future::join_all(self.admin_tasks).await;
        info!("Stopped");
        drained.report
    }

    /// No shard is taken up or handed on from here on: the owned ones drain under their
    /// leases (the membership goes on renewing, so the others do not take them meanwhile).
    async fn freeze_membership(&self) {
        self.freeze.cancel();
        if let Some((_, campaign)) = &self.membership {
            while !campaign.is_finished() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
}

/// Stops every informer; what they passed on reaches the queues before those drain. Routes
/// still waiting for their checkpoint give up.
async fn stop_informers(
    locked: &[MutexGuard<'_, Resources>],
    informers_cancel: &tokio_util::sync::CancellationToken,
) {
    locked.iter().for_each(|r| r.term.cancel());
    informers_cancel.cancel();
    let informers: Vec<_> = locked
        .iter()
        .flat_map(|r| r.wired.iter().flat_map(|w| w.informers.iter().cloned()))
        .collect();
    futures::future::join_all(informers.iter().map(|i| i.stop())).await;
    for resources in locked {
        for w in &resources.wired {
            w.routes.iter().for_each(|r| r.handler.flush());
        }
    }
}

/// Drains every part's queues, all within `grace`.
async fn drain(locked: &mut [MutexGuard<'_, Resources>], grace: std::time::Duration) -> Drained {
    let lives: Vec<Live> = locked
        .iter_mut()
        .map(|r| r.live.take().expect("set at start"))
        .collect();
    let deadline = tokio::time::Instant::now() + grace;
    let parts = futures::future::join_all(lives.into_iter().map(|live| async move {
        let undelivered = live.running.drain(deadline).await;
        (undelivered, live.checkpoint_tasks)
    }))
    .await;
    let mut drained = Drained {
        report: Report::default(),
        part_clean: Vec::new(),
        checkpoint_tasks: Vec::new(),
    };
    for (undelivered, tasks) in parts {
        drained.part_clean.push(undelivered.is_empty());
        drained.report.undelivered.extend(undelivered);
        drained.checkpoint_tasks.extend(tasks);
    }
    drained
}

/// The last write of every checkpoint.
async fn write_checkpoints(locked: &[MutexGuard<'_, Resources>]) {
    for resources in locked {
        for r in resources.resumes() {
            if let Err(err) = r.checkpointer.flush().await {
                warn!(route = %r.checkpointer.route(), error = %err, "Final checkpoint write failed; a restart re-sends what it lacks");
            }
        }
    }
}

/// Releases the lease of each part that is `clean` (drained and flushed: the lease can go to
/// another replica at once); the others' electors stop without releasing.
async fn release_leases(
    electors: Vec<(usize, tokio_util::sync::CancellationToken, JoinHandle<()>)>,
    clean: impl Fn(usize) -> bool,
) {
    let mut released = Vec::new();
    for (index, cancel, elector) in electors {
        if clean(index) {
            cancel.cancel();
            released.push(elector);
        } else {
            // Something may still be on its way: the next owner takes over after the lease
            // expires and its takeover wait, not at once.
            elector.abort();
            warn!("Not releasing a lease: messages were left undelivered or a flush failed");
        }
    }
    futures::future::join_all(released).await;
}
