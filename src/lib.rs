//! kube-event-bridge: exports Kubernetes informer notifications to message brokers.
//!
//! The data path, one module per box:
//!
//! ```text
//! kube-apiserver ─list/watch─▶ informer::reflector ─▶ informer::delta_fifo ─▶ informer::shared_informer
//!                                                                   │ (cache: informer::indexer)
//!                                                                   ▼
//!                        informer::listener (one per informer and sink, bounded)
//!                                                                   ▼
//!      pipeline::route: [resume] ─▶ [filter] ─▶ route_queue ─▶ worker (encode with message) ─▶ sinks
//! ```
//!
//! The module map (dependencies point down the list, never up; `scripts/check-modules.py`
//! checks there is no cycle):
//!
//! ```text
//! allocator.rs      mimalloc, the process's allocator, and its purge setting
//! workqueue/        client-go's work queue: queue.rs, rate_limiter.rs, rate_limiting_queue.rs,
//!                   metrics.rs
//! metrics.rs        every Prometheus metric family
//! problems.rs       what settings validation found, with field paths
//! selector.rs       label selectors as kubectl takes them → kube's Selector
//! shard.rs          shards: FNV-1a ranges of namespaces (KEP-5866), their selectors
//! informer/         reflector, list_watch (list+watch state machine), watch_events, transform,
//!                   delta_fifo, indexer, shared_informer, listener, factory;
//!                   notification.rs (Notification, EventType), object.rs (CachedObject, diffs)
//! message/          mod.rs (envelope, Encoder, MessageConfig), trim.rs, transform.rs,
//!                   patch.rs (diff: patch on the JSON text)
//! sinks/            Sink and its errors; checkpoint.rs (the store contract), secret.rs,
//!                   template.rs, tls.rs (the TLS files every broker sink reads); stdout/, kafka/, nats/, each with the same rooms: config.rs
//!                   (settings), sink.rs (the Sink), checkpoint.rs (the store), and for the
//!                   brokers client.rs (connections, producers) and error.rs (what the
//!                   client's errors mean); kafka/ also record.rs (the checkpoint record),
//!                   transactions.rs, oauth.rs (OAUTHBEARER tokens), reader.rs
//! pipeline/         route.rs (RouteBuilder), route_queue.rs, worker.rs, resume.rs,
//!                   checkpoint.rs (Checkpointer), filter/ (mod: RouteFilter; settings:
//!                   the rules and reasons; stage: the evaluation; lanes: where it
//!                   evaluates; expr: CEL and the settings' errors; cel_json: JSON to CEL values)
//! admin.rs          /metrics, /healthz, /readyz (and its settings)
//! cluster.rs        the Kubernetes client, its settings and rate limit
//! leader/           leader election on a Lease: settings.rs, fence.rs (what workers check),
//!                   handoff.rs (takeover wait, what a holder writes for the next), elector.rs,
//!                   membership.rs (which replicas share the shards, who should own which)
//! config/           the document: mod.rs (load, cross-references), resource.rs, sink.rs
//! convert/          configs from other exporters: mod.rs (notes, secrets, YAML out), otel.rs
//!                   (OpenTelemetry k8sobjects), event_exporter.rs (kubernetes-event-exporter)
//! selection.rs      which kinds each configured resource selects, by discovery
//! app/              mod.rs (App: build, then run), build.rs (resolving kinds, one part per
//!                   shard, electors, membership), start.rs (what runs), shutdown.rs (the
//!                   layers), error.rs, sinks.rs (opening sinks and stores), resources.rs
//!                   (wiring), checkpoints.rs (loading them, waiting routes), discovery.rs,
//!                   leadership.rs, health.rs
//! consumer/         tools for consumers: state.rs, tail.rs; event.rs (reading messages back),
//!                   progress.rs
//! ```

pub mod admin;
pub mod allocator;
pub mod app;
pub mod cluster;
pub mod config;
pub mod consumer;
pub mod convert;
pub mod informer;
pub mod leader;
pub mod message;
pub mod metrics;
pub mod pipeline;
pub mod problems;
pub mod selection;
pub mod selector;
pub mod shard;
pub mod sinks;
pub mod workqueue;

/// The hasher of the maps and sets keyed by object keys on the per-object paths (the
/// DeltaFIFO, the cache and its indices, the route queues, the checkpointer): foldhash, several
/// times faster than std's SipHash on short strings. Keys are the API server's object names,
/// not input the process must protect its maps from; foldhash is still seeded per process.
pub(crate) type FastHash = foldhash::fast::RandomState;
