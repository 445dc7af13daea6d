//! The Reflector: list+watch of one resource into a [`DeltaFifo`], on [`list_watch`] (kube-runtime's
//! watcher state machine with client-go's consistent reads, see that module).
//!
//! The list+watch does what client-go's reflector does on the wire: paged lists (or a
//! streaming watch-list), always consistent reads; watches with bookmarks from the last
//! resourceVersion, a relist after 410 Gone or "Too large resource version", a re-watch without
//! relist when a stream ends, and client-go's backoff (800 ms doubling to 30 s, jittered, reset
//! after 2 min) through kube-runtime's `default_backoff`. This module only turns its events into
//! deltas:
//!
//! | watcher event    | FIFO                                     |
//! |------------------|------------------------------------------|
//! | `Init`           | `begin_list(serving)`                    |
//! | `InitApply(obj)` | `listed(obj)`: it pops at once           |
//! | `InitDone`       | `end_list(rv)`: what the list lacks is deleted |
//! | `Apply(obj)`     | `update(obj)` (the informer decides add/update by the cache) |
//! | `Delete(obj)`    | `delete(obj)`                            |
//!
//! # Recovery
//! Errors are logged, counted, and retried by the watcher with backoff; nothing already in the
//! FIFO or cache is dropped. A list interrupted by an error starts again at the next `Init`;
//! what its first part queued stays (real states at a consistent version), but only a whole
//! list decides what vanished, so a partial one deletes nothing.
//! A refusal (403 Forbidden) is reported with the verb and resource (log, the
//! `forbidden` gauge, [`Reflector::problem`] for `/readyz`) and retried like any error, so a
//! permission granted later takes effect without a restart.
//!
//! A watch that delivers nothing, neither an event nor a bookmark, for
//! `kubernetes.watch_stall_timeout` fails with a read timeout of the client (see
//! `cluster::client`); the watcher then re-watches from the last resourceVersion after its
//! backoff, and the stall is counted in `stalls`. The API server sends a bookmark about every
//! minute on an idle watch, so a healthy quiet watch never trips it.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::{
    Api,
    api::DynamicObject,
    runtime::{WatchStreamExt, watcher},
};

use super::list_watch::{ListWatchConfig, Relists, list_watch};
use prometheus::IntCounter;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{DeltaFifo, ObjectRef, resource_version};

/// Counters a reflector keeps.
#[derive(Clone)]
pub struct ReflectorMetrics {
    /// Watch and list errors (each is followed by a backoff and a retry).
    pub watch_errors: IntCounter,
    /// Lists after the first one.
    pub relists: IntCounter,
    /// Objects received in lists.
    pub listed: IntCounter,
    /// ADDED and MODIFIED watch events (the watcher does not tell them apart).
    pub applied: IntCounter,
    /// DELETED watch events.
    pub deleted: IntCounter,
    /// 1 while the last list or watch was refused (403).
    pub forbidden: prometheus::IntGauge,
    /// Watches restarted because they went silent.
    pub stalls: IntCounter,
}

/// Whether `err` is a read that timed out: the client's stall timeout on a silent watch.
pub(crate) fn is_stall(err: &watcher::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        source = e.source();
    }
    false
}

/// One list+watch loop. See the module docs.
pub struct Reflector {
    name: String,
    api: Api<DynamicObject>,
    config: ListWatchConfig,
    relists: Relists,
    // (request served, FIFO generation) of the last list replaced.
    served: Mutex<(u64, u64)>,
    fifo: Arc<DeltaFifo>,
    metrics: ReflectorMetrics,
    last_sync_resource_version: Mutex<String>,
    problem: Mutex<Option<String>>,
}

impl Reflector {
    /// A reflector named `name` (for logs) that feeds `fifo`.
    pub fn new(
        name: String,
        api: Api<DynamicObject>,
        config: ListWatchConfig,
        fifo: Arc<DeltaFifo>,
        metrics: ReflectorMetrics,
    ) -> Self {
        Self {
            name,
            api,
            config,
            relists: Relists::default(),
            served: Mutex::new((0, 0)),
            fifo,
            metrics,
            last_sync_resource_version: Mutex::new(String::new()),
            problem: Mutex::new(None),
        }
    }

    /// Why the last list or watch failed, until one succeeds again.
    pub fn problem(&self) -> Option<String> {
        self.problem
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_problem(&self, problem: Option<String>) {
        let mut p = self.problem.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_some() || problem.is_some() {
            *p = problem;
        }
    }

    /// What an error says, and whether it is a refusal (403).
    fn describe(&self, err: &watcher::Error) -> (String, bool) {
        let (verb, status) = match err {
            watcher::Error::InitialListFailed(kube::Error::Api(s)) => ("list", Some(s)),
            watcher::Error::WatchStartFailed(kube::Error::Api(s))
            | watcher::Error::WatchFailed(kube::Error::Api(s)) => ("watch", Some(s)),
            watcher::Error::WatchError(s) => ("watch", Some(s)),
            _ => ("", None),
        };
        match status {
            Some(s) if s.code == 403 => (
                format!(
                    "forbidden to {verb} {} (403: {}); grant the service account {verb} on it",
                    self.api.resource_url(),
                    s.message
                ),
                true,
            ),
            _ => (err.to_string(), false),
        }
    }

    /// How long ago the API server was last heard from (a list page, an event, a bookmark);
    /// `None` before the first.
    pub fn last_heard(&self) -> Option<std::time::Duration> {
        self.config.activity.age()
    }

    /// The resourceVersion of the newest state seen: the last list's, or a later watch
    /// event's object's (client-go's `LastSyncResourceVersion`).
    pub fn last_sync_resource_version(&self) -> String {
        self.last_sync_resource_version
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Notes `obj`'s resourceVersion (a watch event's) as the last seen.
    fn seen(&self, obj: ObjectRef) -> ObjectRef {
        *self
            .last_sync_resource_version
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = resource_version(&obj).to_owned();
        obj
    }

    /// Asks the running list+watch to start a new consistent list now (dropping a list in
    /// progress); its `replace` reaches the FIFO like any relist's. Returns the request's
    /// number, for [`served`](Self::served).
    pub fn request_relist(&self) -> u64 {
        self.relists.request()
    }

    /// The newest relist request a list handed to the FIFO has served, and that list's
    /// generation in the FIFO ([`DeltaFifo::replaces`]).
    pub fn served(&self) -> (u64, u64) {
        *self.served.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs until `cancel` fires.
    pub async fn run(&self, cancel: CancellationToken) {
        let stream =
            list_watch(self.api.clone(), self.config.clone(), &self.relists).default_backoff();
        let mut serving = 0;
        futures::pin_mut!(stream);
        // Objects of the list in progress so far.
        let mut listed = 0u64;
        let mut lists = 0u64;
        loop {
            let event = tokio::select! {
                _ = cancel.cancelled() => break,
                // A watch accepted again: a refusal or failure before it is over, though no
                // event may come until something changes.
                _ = self.config.opened.notified() => {
                    self.set_problem(None);
                    self.metrics.forbidden.set(0);
                    continue;
                }
                event = stream.next() => event,
            };
            let Some(event) = event else { break };
            if event.is_ok() {
                self.set_problem(None);
                self.metrics.forbidden.set(0);
            }
            match event {
                Ok(watcher::Event::Init) => {
                    if lists > 0 {
                        self.metrics.relists.inc();
                        info!(informer = %self.name, "Relisting");
                    }
                    lists += 1;
                    listed = 0;
                    serving = self.relists.listing_for();
                    self.fifo.begin_list(serving);
                }
                // A list's items are in no version order: the list's own version counts, at
                // `InitDone`.
                Ok(watcher::Event::InitApply(obj)) => {
                    listed += 1;
                    self.metrics.listed.inc();
                    self.fifo.listed(obj);
                }
                Ok(watcher::Event::InitDone) => {
                    debug!(informer = %self.name, objects = listed, "List complete");
                    // client-go's lastSyncResourceVersion: the list's, not its last item's.
                    let listed_at = self.relists.listed_at();
                    if let Some(rv) = &listed_at {
                        *self
                            .last_sync_resource_version
                            .lock()
                            .unwrap_or_else(|e| e.into_inner()) = rv.to_string();
                    }
                    self.fifo.end_list(listed_at);
                    let generation = self.fifo.replaces().0;
                    *self.served.lock().unwrap_or_else(|e| e.into_inner()) = (serving, generation);
                }
                Ok(watcher::Event::Apply(obj)) => {
                    self.metrics.applied.inc();
                    self.fifo.update(self.seen(obj));
                }
                Ok(watcher::Event::Delete(obj)) => {
                    self.metrics.deleted.inc();
                    self.fifo.delete(self.seen(obj));
                }
                Err(err) => {
                    self.metrics.watch_errors.inc();
                    let (problem, forbidden) = self.describe(&err);
                    if is_stall(&err) {
                        self.metrics.stalls.inc();
                        warn!(informer = %self.name, "Watch delivered neither an event nor a bookmark for kubernetes.watch_stall_timeout; restarting it");
                    } else if forbidden {
                        self.metrics.forbidden.set(1);
                        warn!(informer = %self.name, "{problem}; retrying with backoff");
                    } else {
                        warn!(informer = %self.name, error = %err, "List/watch failed; retrying with backoff");
                    }
                    self.set_problem(Some(problem));
                }
            }
        }
        debug!(informer = %self.name, "Reflector stopped");
    }
}
