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
//!                        pipeline (encode with message, publish to sinks, retry)
//! ```
//!
//! - [`config`]: settings, loaded from YAML plus `KEB_*` environment variables, validated.
//! - [`cluster`]: the Kubernetes client and discovery of configured kinds.
//! - [`informer`]: client-go's Reflector, DeltaFIFO, Indexer, SharedIndexInformer,
//!   ProcessorListener and SharedInformerFactory.
//! - [`message`]: notification → CloudEvents envelope; the transform applied before caching.
//! - [`sinks`]: destinations (stdout/file, Kafka, NATS) and their checkpoint stores.
//! - [`pipeline`]: listener → sink delivery with retries; checkpoints of what sinks
//!   acknowledged and the resume that compares them with the first list.
//! - [`consumer`]: tools for consumers (`state`).
//! - [`metrics`], [`admin`]: Prometheus metrics and the `/metrics`, `/healthz`, `/readyz` server.
//! - [`app`]: builds all of it from a config and runs it until shutdown.

pub mod admin;
pub mod app;
pub mod cluster;
pub mod config;
pub mod consumer;
pub mod informer;
pub mod leader;
pub mod message;
pub mod metrics;
pub mod pipeline;
pub mod problems;
pub mod selection;
pub mod sinks;
pub mod workqueue;
