//! Delivery: listener → route queue → N workers → encoder → sink, per (resource, sink).
//!
//! # Contract (what consumers may rely on)
//! - **At least once**: a notification is settled only when the sink accepted it or failed
//!   it for good. Retriable failures go back through the rate-limited work queue
//!   (per-key exponential backoff plus an overall token bucket) until they succeed, or until
//!   `max_retries` if set.
//! - **Per-object order, the newest state last**: one key is never handled by two workers at
//!   once, a key's notifications are published in informer order, a failed one before any
//!   later one, and one message of a key is in flight at a time (the next is handed over once
//!   the previous one is acknowledged), so a retry never stores an older state after a newer
//!   one, in either consumer model ("last message wins", "deduplicate by id, then last wins").
//! - **Bounded memory**: see [`RouteQueue`]: at the sink's cap updates are coalesced; deletes
//!   and the newest state are never dropped.
//! - **Final failures** (an object that cannot be encoded, a message the sink can never take)
//!   are logged with the object key, counted in `keb_sink_failed_total`, and, when the sink has
//!   a dead-letter sink, recorded there as a small reference (id, key, reason, size).

pub mod checkpoint;
pub mod filter;
pub mod resume;
pub mod route;
pub mod route_queue;
pub mod worker;

use std::{collections::HashMap, sync::Arc, time::Duration};

use tokio::task::JoinHandle;
use tracing::warn;

pub use checkpoint::{CheckpointStore, Checkpointer};
pub use resume::Resumer;
pub use route::{BuiltRoute, RouteBuilder};
pub use route_queue::{Budget, RouteQueue};
pub use worker::{Delivery, InFlight, Route};

/// Routes whose workers are running.
pub struct Running {
    routes: Vec<(Arc<Route>, Vec<JoinHandle<()>>)>,
}

/// Starts `workers` workers for each route.
pub fn start(routes: &[(Arc<Route>, usize)]) -> Running {
    Running {
        routes: routes
            .iter()
            .map(|(r, n)| (r.clone(), r.spawn_workers(*n)))
            .collect(),
    }
}

impl Running {
    /// Starts `workers` workers for each of `routes` too.
    pub fn add(&mut self, routes: &[(Arc<Route>, usize)]) {
        self.routes
            .extend(routes.iter().map(|(r, n)| (r.clone(), r.spawn_workers(*n))));
    }

    /// Drains every route queue (`shut_down_with_drain`) until `deadline`, then stops the
    /// workers (aborting any still stuck in a publish) and returns what each route still
    /// holds, by route name. Call it once the informers have stopped feeding the queues.
    pub async fn drain(mut self, deadline: tokio::time::Instant) -> HashMap<String, usize> {
        // First the queues keep running until they hold nothing: a key waiting out a retry
        // delay is not being processed, and a draining work queue would drop it.
        let settled = async {
            while self.routes.iter().any(|(r, _)| r.queue().held() > 0) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout_at(deadline, settled).await;
        let drains = self.routes.iter().map(|(r, _)| {
            tokio::time::timeout_at(deadline, r.queue().queue().shut_down_with_drain())
        });
        futures::future::join_all(drains).await;
        // Every queue shuts down now (releasing drains that timed out); the workers get one
        // short shared moment to finish, and those still stuck in a publish are aborted.
        // Waiting on them one by one would add that moment per worker (1024 workers: ~100 s).
        let mut handles = Vec::new();
        for (route, h) in &self.routes {
            route.queue().queue().shut_down();
            handles.extend(h.iter().map(|h| h.abort_handle()));
        }
        let workers = self.routes.iter_mut().flat_map(|(_, h)| h.drain(..));
        let _ = tokio::time::timeout(
            Duration::from_millis(100),
            futures::future::join_all(workers),
        )
        .await;
        handles.iter().for_each(|h| h.abort());
        let mut left = HashMap::new();
        for (route, _) in &self.routes {
            let held = route.queue().held();
            if held > 0 {
                warn!(route = %route.queue().name(), undelivered = held, "Shutdown left notifications undelivered");
                left.insert(route.queue().name().to_owned(), held);
            }
        }
        left
    }
}
