//! The Reflector: list+watch of one resource into a [`DeltaFifo`], on `kube::runtime::watcher`.
//!
//! The watcher already does what client-go's reflector does on the wire: paged lists (or a
//! streaming watch-list), watches with bookmarks from the last resourceVersion, a relist after
//! 410 Gone, a re-watch without relist when a stream ends, and client-go's backoff (800 ms
//! doubling to 30 s, jittered, reset after 2 min) through `default_backoff`. This module only
//! turns its events into deltas:
//!
//! | watcher event    | FIFO                                     |
//! |------------------|------------------------------------------|
//! | `Init`           | start collecting a (re)list              |
//! | `InitApply(obj)` | collect                                  |
//! | `InitDone`       | `replace(list)`                          |
//! | `Apply(obj)`     | `update(obj)` (the informer decides add/update by the cache) |
//! | `Delete(obj)`    | `delete(obj)`                            |
//!
//! # Recovery
//! Errors are logged, counted, and retried by the watcher with backoff; nothing already in the
//! FIFO or cache is dropped. A list interrupted by an error is discarded and the next `Init`
//! starts it again, so a partial list never reaches `replace` (which would delete the rest).

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::{
    Api,
    api::DynamicObject,
    runtime::{WatchStreamExt, watcher},
};
use prometheus::IntCounter;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{DeltaFifo, ObjectRef, resource_version};

/// Rewrites an object before it is queued and cached (client-go's `TransformFunc`).
pub type Transform = Arc<dyn Fn(&mut DynamicObject) + Send + Sync>;

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
}

/// One list+watch loop. See the module docs.
pub struct Reflector {
    name: String,
    api: Api<DynamicObject>,
    config: watcher::Config,
    fifo: Arc<DeltaFifo>,
    transform: Option<Transform>,
    metrics: ReflectorMetrics,
    last_sync_resource_version: Mutex<String>,
}

impl Reflector {
    /// A reflector named `name` (for logs) that feeds `fifo`.
    pub fn new(
        name: String,
        api: Api<DynamicObject>,
        config: watcher::Config,
        fifo: Arc<DeltaFifo>,
        transform: Option<Transform>,
        metrics: ReflectorMetrics,
    ) -> Self {
        Self {
            name,
            api,
            config,
            fifo,
            transform,
            metrics,
            last_sync_resource_version: Mutex::new(String::new()),
        }
    }

    /// The resourceVersion of the newest object seen (list or watch event).
    pub fn last_sync_resource_version(&self) -> String {
        self.last_sync_resource_version
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn prepare(&self, mut obj: DynamicObject) -> ObjectRef {
        if let Some(t) = &self.transform {
            t(&mut obj);
        }
        *self
            .last_sync_resource_version
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = resource_version(&obj).to_owned();
        Arc::new(obj)
    }

    /// Runs until `cancel` fires.
    pub async fn run(&self, cancel: CancellationToken) {
        let stream = watcher(self.api.clone(), self.config.clone()).default_backoff();
        futures::pin_mut!(stream);
        let mut listing: Option<Vec<ObjectRef>> = None;
        let mut lists = 0u64;
        loop {
            let event = tokio::select! {
                _ = cancel.cancelled() => break,
                event = stream.next() => event,
            };
            let Some(event) = event else { break };
            match event {
                Ok(watcher::Event::Init) => {
                    if lists > 0 {
                        self.metrics.relists.inc();
                        info!(informer = %self.name, "Relisting");
                    }
                    lists += 1;
                    listing = Some(Vec::new());
                }
                Ok(watcher::Event::InitApply(obj)) => {
                    let obj = self.prepare(obj);
                    listing.get_or_insert_default().push(obj);
                }
                Ok(watcher::Event::InitDone) => {
                    let list = listing.take().unwrap_or_default();
                    self.metrics.listed.inc_by(list.len() as u64);
                    debug!(informer = %self.name, objects = list.len(), "List complete");
                    self.fifo.replace(list);
                }
                Ok(watcher::Event::Apply(obj)) => {
                    self.metrics.applied.inc();
                    self.fifo.update(self.prepare(obj));
                }
                Ok(watcher::Event::Delete(obj)) => {
                    self.metrics.deleted.inc();
                    self.fifo.delete(self.prepare(obj));
                }
                Err(err) => {
                    self.metrics.watch_errors.inc();
                    warn!(informer = %self.name, error = %err, "List/watch failed; retrying with backoff");
                }
            }
        }
        debug!(informer = %self.name, "Reflector stopped");
    }
}
