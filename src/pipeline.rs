//! One route to one sink: listener → encoder → sink, in order, retrying until the sink accepts.
//!
//! # Contract
//! - Notifications of a listener are published one at a time, in listener order.
//! - A retriable sink error is retried with exponential backoff (100 ms doubling to 30 s)
//!   until it succeeds or the process shuts down; nothing is skipped.
//! - A final error (an object that cannot be encoded, a sink that can never take it) is logged
//!   with the object key and counted in `keb_sink_failed_total`, and the route goes on.
//! - The task ends when the listener is closed and drained.

use std::{sync::Arc, time::Duration};

use prometheus::{Histogram, IntCounter};
use tracing::{error, warn};

use crate::{informer::ProcessorListener, message::Encoder, metrics::Metrics, sinks::Sink};

const RETRY_BASE: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// One (resource, sink) delivery path.
pub struct Route {
    /// Name of the resource config.
    pub resource: String,
    /// The listener registered on the resource's informer(s).
    pub listener: Arc<ProcessorListener>,
    /// Encoder for the resource.
    pub encoder: Encoder,
    /// The destination.
    pub sink: Arc<dyn Sink>,
}

struct RouteMetrics {
    published: [IntCounter; 4],
    bytes: IntCounter,
    publish_duration: Histogram,
    end_to_end: Histogram,
}

impl Route {
    /// Delivers until the listener is closed and drained.
    pub async fn run(self, metrics: Arc<Metrics>) {
        let sink_name = self.sink.name().to_owned();
        let labels = [sink_name.as_str(), self.resource.as_str()];
        let m = RouteMetrics {
            published: ["added", "updated", "deleted", "synced"].map(|t| {
                metrics
                    .sink_published
                    .with_label_values(&[labels[0], labels[1], t])
            }),
            bytes: metrics.sink_bytes.with_label_values(&labels),
            publish_duration: metrics
                .sink_publish_duration
                .with_label_values(&[labels[0]]),
            end_to_end: metrics
                .end_to_end_latency
                .with_label_values(&[labels[1], labels[0]]),
        };
        let failed = |reason: &str| {
            metrics
                .sink_failed
                .with_label_values(&[labels[0], labels[1], reason])
                .inc()
        };
        while let Some(n) = self.listener.pop().await {
            let message = match self.encoder.encode(&n) {
                Ok(m) => m,
                Err(err) => {
                    failed("encode");
                    error!(error = %err, sink = %sink_name, resource = %self.resource, key = %n.key(), "Cannot encode notification; skipped");
                    continue;
                }
            };
            let mut delay = RETRY_BASE;
            loop {
                let started = std::time::Instant::now();
                match self.sink.publish(&message).await {
                    Ok(()) => {
                        m.publish_duration.observe(started.elapsed().as_secs_f64());
                        m.end_to_end
                            .observe(message.received.elapsed().as_secs_f64());
                        m.published[message.event_type as usize].inc();
                        m.bytes.inc_by(message.payload.len() as u64);
                        break;
                    }
                    Err(err) if err.is_retriable() => {
                        failed(err.reason());
                        warn!(error = %err, sink = %sink_name, key = %message.key, retry_in = ?delay, "Publish failed; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(RETRY_MAX);
                    }
                    Err(err) => {
                        failed(err.reason());
                        error!(error = %err, sink = %sink_name, key = %message.key, id = %message.id, "Publish failed for good; message dropped");
                        break;
                    }
                }
            }
        }
    }
}
