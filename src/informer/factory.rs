//! client-go's `SharedInformerFactory`: one informer per (resource, namespace, selectors),
//! handed to every route that asks for it, so that one list+watch serves them all.

use std::{
    fmt,
    sync::{Arc, Mutex},
};

use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject},
};
use tokio_util::sync::CancellationToken;

use super::{
    DeltaFifo, Indexer, SharedIndexInformer,
    list_watch::{ListWatchConfig, ShardFilter, ShardMode},
    reflector::{Reflector, ReflectorMetrics},
    shared_informer::InformerMetrics,
    transform::Transform,
};
use crate::{metrics::Metrics, shard::Shard};

/// What makes two informers the same: resource, namespace (`None`: all) and selectors.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InformerKey {
    /// API group, `""` for core.
    pub group: String,
    /// API version.
    pub version: String,
    /// Plural resource name.
    pub plural: String,
    /// One namespace, or `None` for all namespaces (and cluster-scoped resources).
    pub namespace: Option<String>,
    /// Label selector.
    pub label_selector: Option<String>,
    /// Field selector.
    pub field_selector: Option<String>,
    /// Only one shard's objects (`None`: all).
    pub shard: Option<Shard>,
}

impl fmt::Display for InformerKey {
    /// `apps/v1/deployments`, then `@namespace` and `{l=…,f=…}` when set: a bounded metric label.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.group.is_empty() {
            write!(f, "{}/", self.group)?;
        }
        write!(f, "{}/{}", self.version, self.plural)?;
        if let Some(ns) = &self.namespace {
            write!(f, "@{ns}")?;
        }
        if let Some(shard) = self.shard.filter(|s| !s.is_whole()) {
            write!(f, "#{}", shard.label())?;
        }
        match (&self.label_selector, &self.field_selector) {
            (None, None) => Ok(()),
            (l, fs) => write!(
                f,
                "{{l={},f={}}}",
                l.as_deref().unwrap_or(""),
                fs.as_deref().unwrap_or("")
            ),
        }
    }
}

/// How reflectors list and watch.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// Objects per list page at most (`ListWatchConfig::page_size`).
    pub page_size: u32,
    /// Streaming watch-list instead of a paged list.
    pub streaming_list: bool,
    /// Server-side timeout of each watch request, in seconds.
    pub watch_timeout_seconds: u32,
    /// Lists in flight at once over every informer of the factory.
    pub max_concurrent_lists: u32,
}

/// Hands out shared informers and starts them. See the module docs.
pub struct SharedInformerFactory {
    client: Client,
    options: WatchOptions,
    metrics: Arc<Metrics>,
    informers: Mutex<Vec<(InformerKey, Arc<SharedIndexInformer>)>>,
    // The shard filters of sharded informers, by informer name.
    shard_filters: Mutex<Vec<(String, ShardFilter)>>,
    // One permit per list in flight (`max_concurrent_lists`).
    lists: Arc<tokio::sync::Semaphore>,
}

impl SharedInformerFactory {
    /// A factory whose informers use `client` and list/watch with `options`.
    pub fn new(client: Client, options: WatchOptions, metrics: Arc<Metrics>) -> Self {
        Self {
            lists: Arc::new(tokio::sync::Semaphore::new(
                options.max_concurrent_lists.max(1) as usize,
            )),
            client,
            options,
            metrics,
            informers: Mutex::new(Vec::new()),
            shard_filters: Mutex::new(Vec::new()),
        }
    }

    /// The running sharded informers whose API server ignored the shard selector (their
    /// last list echoed no `shardInfo`): they filter on the client.
    pub fn client_side_shards(&self) -> Vec<String> {
        let running: Vec<String> = self
            .informers()
            .iter()
            .filter(|i| i.is_spawned())
            .map(|i| i.name().to_owned())
            .collect();
        self.shard_filters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(name, f)| f.mode() == ShardMode::Client && running.contains(name))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The informer for `key` (whose resource is `resource`), created on first request; a new
    /// informer rewrites every object with `transform` before caching it.
    pub fn informer_for(
        &self,
        resource: &ApiResource,
        key: InformerKey,
        transform: Option<Transform>,
    ) -> Arc<SharedIndexInformer> {
        let mut informers = self.informers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, informer)) = informers.iter().find(|(k, _)| *k == key) {
            return informer.clone();
        }
        let name = key.to_string();
        let api: Api<DynamicObject> = match &key.namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, resource),
            None => Api::all_with(self.client.clone(), resource),
        };
        let config = ListWatchConfig {
            page_size: self.options.page_size,
            streaming: self.options.streaming_list,
            timeout: self.options.watch_timeout_seconds,
            labels: key.label_selector.clone(),
            fields: key.field_selector.clone(),
            activity: Default::default(),
            opened: Default::default(),
            transform: transform.unwrap_or_default(),
            lists: Some(self.lists.clone()),
            // One namespace outside its shard: nothing to list or watch.
            idle: matches!(
                (&key.namespace, key.shard),
                (Some(ns), Some(shard)) if !shard.is_whole() && !shard.holds_namespace(ns)
            ),
            shard: key.shard.filter(|s| !s.is_whole()).map(|shard| {
                ShardFilter::new(
                    shard,
                    self.metrics
                        .informer_shard_server_side
                        .with_label_values(&[&name]),
                )
            }),
        };
        if let Some(filter) = &config.shard {
            let mut filters = self.shard_filters.lock().unwrap_or_else(|e| e.into_inner());
            filters.retain(|(n, _)| *n != name);
            filters.push((name.clone(), filter.clone()));
        }
        let indexer = Arc::new(Indexer::new());
        let fifo = Arc::new(DeltaFifo::new(indexer.clone()));
        let m = &self.metrics;
        let reflector = Reflector::new(
            name.clone(),
            api,
            config,
            fifo.clone(),
            ReflectorMetrics {
                watch_errors: m.informer_watch_errors.with_label_values(&[&name]),
                relists: m.informer_relists.with_label_values(&[&name]),
                listed: m
                    .informer_watch_events
                    .with_label_values(&[&name, "listed"]),
                applied: m
                    .informer_watch_events
                    .with_label_values(&[&name, "applied"]),
                deleted: m
                    .informer_watch_events
                    .with_label_values(&[&name, "deleted"]),
                forbidden: m.informer_forbidden.with_label_values(&[&name]),
                stalls: m.informer_watch_stalls.with_label_values(&[&name]),
            },
        );
        let informer = Arc::new(SharedIndexInformer::new(
            name.clone(),
            indexer,
            fifo,
            reflector,
            InformerMetrics {
                cached_objects: m.informer_cached_objects.with_label_values(&[&name]),
                synced: m.informer_synced.with_label_values(&[&name]),
                notifications: ["added", "updated", "deleted", "synced"]
                    .map(|t| m.informer_notifications.with_label_values(&[&name, t])),
            },
        ));
        m.informer_synced.with_label_values(&[&name]).set(0);
        informers.push((key, informer.clone()));
        informer
    }

    /// Every informer handed out so far.
    pub fn informers(&self) -> Vec<Arc<SharedIndexInformer>> {
        self.informers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(_, i)| i.clone())
            .collect()
    }

    /// Forgets `informer` (a stopped one): the next request for its key creates a new one.
    pub fn remove(&self, informer: &Arc<SharedIndexInformer>) {
        self.informers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(_, i)| !Arc::ptr_eq(i, informer));
        // Whatever stopped it (discovery, a lost shard, shutdown), it no longer runs: its
        // liveness series goes with it (a frozen age would look healthy), and comes back if
        // an informer of the same name runs again.
        let _ = self
            .metrics
            .informer_last_event_age
            .remove_label_values(&[informer.name()]);
    }

    /// Starts every informer; each stops after `cancel` fires and its FIFO is drained
    /// ([`SharedIndexInformer::stop`] waits for that).
    pub fn start(&self, cancel: &CancellationToken) {
        for i in self.informers() {
            i.spawn(cancel);
        }
    }

    /// Whether every informer has synced.
    pub fn has_synced(&self) -> bool {
        self.informers().iter().all(|i| i.has_synced())
    }
}
