//! Every metric family, registered in one place. Names are part of the public interface
//! (dashboards and alerts use them); labels are bounded sets taken from the config, never
//! object names.

use crate::workqueue::metrics::WorkqueueMetricFamilies;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    exponential_buckets,
};

/// The process's metrics. One instance per process (tests make their own).
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// `keb_informer_notifications_total{resource,type}`: notifications distributed by informers.
    pub informer_notifications: IntCounterVec,
    /// `keb_informer_watch_events_total{resource,type}`: events received from list/watch.
    pub informer_watch_events: IntCounterVec,
    /// `keb_informer_watch_errors_total{resource}`: list/watch failures, each followed by a retry.
    pub informer_watch_errors: IntCounterVec,
    /// `keb_informer_relists_total{resource}`: lists after the first.
    pub informer_relists: IntCounterVec,
    /// `keb_informer_cached_objects{resource}`: objects in the cache.
    pub informer_cached_objects: IntGaugeVec,
    /// `keb_informer_synced{resource}`: 1 once the first list is cached.
    pub informer_synced: IntGaugeVec,
    /// `keb_listener_buffered_notifications{resource,sink}`: notifications a route holds
    /// (pending or being published).
    pub listener_buffered: IntGaugeVec,
    /// `keb_listener_coalesced_total{resource,sink}`: updates merged because the sink was at
    /// its `max_pending` cap.
    pub listener_coalesced: IntCounterVec,
    /// `keb_filtered_total{resource,sink,reason}`: notifications a route's filter did not
    /// publish (`filter`, `filter_error`, `suppressed`).
    pub filtered: IntCounterVec,
    /// `keb_filter_errors_total{resource,sink}`: filter evaluations that failed.
    pub filter_errors: IntCounterVec,
    /// `keb_message_degraded_total{sink,resource,step}`: messages over the destination's size
    /// limit, by the step that made them fit (`old_object`, `patch`, `reference`) or
    /// `dead_letter`.
    pub message_degraded: IntCounterVec,
    /// `keb_sink_published_total{sink,resource,type}`: messages the sink acknowledged.
    pub sink_published: IntCounterVec,
    /// `keb_sink_failed_total{sink,resource,reason}`: failed publish attempts.
    pub sink_failed: IntCounterVec,
    /// `keb_sink_bytes_total{sink,resource}`: payload bytes acknowledged.
    pub sink_bytes: IntCounterVec,
    /// `keb_kafka_transactions_total{sink,outcome}`: transactions of an `exactly_once` Kafka
    /// sink, `committed` or `aborted` (their messages are sent again).
    pub kafka_transactions: IntCounterVec,
    /// `keb_kafka_producer_fenced{sink}`: transactional ids of an `exactly_once` Kafka sink
    /// whose producer here a newer one fenced (another replica took over), until this replica
    /// starts a term of that id again; `/healthz` fails meanwhile.
    pub kafka_producer_fenced: IntGaugeVec,
    /// `keb_sink_in_flight{sink}`: publishes waiting for the destination's acknowledgement.
    pub sink_in_flight: IntGaugeVec,
    /// `keb_sink_publish_duration_seconds{sink}`: publish call to acknowledgement.
    pub sink_publish_duration: HistogramVec,
    /// `keb_end_to_end_latency_seconds{resource,sink}`: watch event received to sink acknowledged.
    pub end_to_end_latency: HistogramVec,
    /// `keb_kubernetes_api_reachable`: 1 while the last API health probe succeeded.
    pub api_reachable: IntGauge,
    /// `keb_kubernetes_api_requests_total`: requests sent to the API server.
    pub api_requests: IntCounter,
    /// `keb_kubernetes_api_throttled_total`: answers 429 Too Many Requests (the client retries
    /// them after the server's Retry-After).
    pub api_throttled: IntCounter,
    /// `keb_kubernetes_api_retry_after_seconds_total`: the Retry-After seconds of those answers.
    pub api_retry_after_seconds: IntCounter,
    /// `keb_kubernetes_api_client_wait_seconds_total`: time requests waited for the client-side
    /// rate limit (`kubernetes.qps`/`burst`).
    pub api_client_wait_seconds: prometheus::Counter,
    /// `keb_resource_pending{resource}`: 1 while a configured kind is not served (yet).
    pub resource_pending: IntGaugeVec,
    /// `keb_informer_forbidden{resource}`: 1 while the informer's list or watch is refused (403).
    pub informer_forbidden: IntGaugeVec,
    /// `keb_informer_watch_stalls_total{resource}`: watches restarted because they delivered
    /// neither an event nor a bookmark for `kubernetes.watch_stall_timeout`.
    pub informer_watch_stalls: IntCounterVec,
    /// `keb_informer_last_event_age_seconds{resource}`: seconds since a running informer's
    /// list+watch last heard from the API server (an event, a bookmark or a list page;
    /// refreshed every 500 ms). Bookmarks arrive about every minute on an idle watch.
    pub informer_last_event_age: prometheus::GaugeVec,
    /// `keb_informer_shard_server_side{resource}`: for a shard's informer, 1 while the API
    /// server applies its shard selector, 0 while the client filters (the server ignored it).
    pub informer_shard_server_side: IntGaugeVec,
    /// `keb_leader`: 1 while this replica publishes (it leads, or leader election is off).
    pub leader: IntGauge,
    /// `keb_takeover_wait_seconds{lease}`: after this replica took a Lease over, the seconds
    /// left before it publishes (the last holder's messages may still be delivered until
    /// then); 0 otherwise.
    pub takeover_wait: prometheus::GaugeVec,
    /// `keb_shard_owned{shard}`: 1 while this replica owns (holds the Lease of) the shard.
    pub shard_owned: IntGaugeVec,
    /// `keb_shard_handovers_total{shard,change}`: times this replica `acquired` a shard
    /// (began publishing it) or `stopped` (handed it on, or lost its Lease).
    pub shard_handovers: IntCounterVec,
    /// `keb_shard_replicas`: replicas this one sees sharing the shards (its own included).
    pub shard_replicas: IntGauge,
    /// `keb_resume_objects_total{route,outcome}`: objects compared with a route's checkpoint
    /// when it resumed, by outcome (`unchanged`, `updated`, `deleted`, `added`, `recreated`).
    pub resume_objects: IntCounterVec,
    /// `keb_checkpoint_load_seconds{route}`: how long the last checkpoint load took.
    pub checkpoint_load_seconds: prometheus::GaugeVec,
    /// `keb_checkpoint_waiting{route}`: 1 while the route publishes nothing because its
    /// checkpoint cannot be loaded (unreadable: retried; another cluster's: for good).
    pub checkpoint_waiting: IntGaugeVec,
    /// `keb_route_resuming{route}`: 1 from when this replica takes the route's Lease (it
    /// leads, or owns the route's shard; the takeover wait included) until the route's resume
    /// is over: its checkpoint read and compared with a fresh list, every object gone meanwhile
    /// deleted. A route at 1 has not published all of what changed while no replica did.
    pub route_resuming: IntGaugeVec,
    /// `keb_checkpoint_lag{route}`: keys acknowledged by the sink but not yet stored in the
    /// checkpoint.
    pub checkpoint_lag: IntGaugeVec,
    /// `keb_checkpoint_write_failures_total{route}`: failed checkpoint writes (retried).
    pub checkpoint_write_failures: IntCounterVec,
    /// client-go's `workqueue_*` families, one queue per route (`name="resource/sink"`).
    pub workqueue: WorkqueueMetricFamilies,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every family, plus process metrics on Linux.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        // 1 ms .. ~65 s: from a local stdout write to a broker under stress.
        let latency = |name: &str, help: &str, labels: &[&str]| {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help)
                    .buckets(exponential_buckets(0.001, 2.0, 17).expect("valid buckets")),
                labels,
            )
            .expect("valid metric");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let api_reachable = IntGauge::new(
            "keb_kubernetes_api_reachable",
            "1 while the last Kubernetes API health probe succeeded",
        )
        .expect("valid metric");
        registry
            .register(Box::new(api_reachable.clone()))
            .expect("unique metric");
        let leader = IntGauge::new(
            "keb_leader",
            "1 while this replica publishes: it leads, or leader election is off",
        )
        .expect("valid metric");
        registry
            .register(Box::new(leader.clone()))
            .expect("unique metric");
        let single = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let api_client_wait_seconds = prometheus::Counter::new(
            "keb_kubernetes_api_client_wait_seconds_total",
            "Time requests waited for the client-side rate limit (kubernetes.qps and burst)",
        )
        .expect("valid metric");
        registry
            .register(Box::new(api_client_wait_seconds.clone()))
            .expect("unique metric");
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("unique metric");
        Self {
            informer_notifications: counter(
                "keb_informer_notifications_total",
                "Notifications distributed by informers, by type",
                &["resource", "type"],
            ),
            informer_watch_events: counter(
                "keb_informer_watch_events_total",
                "Objects received from list and watch, by kind of event",
                &["resource", "type"],
            ),
            informer_watch_errors: counter(
                "keb_informer_watch_errors_total",
                "List or watch failures; each is retried with backoff",
                &["resource"],
            ),
            informer_relists: counter(
                "keb_informer_relists_total",
                "Lists after the first one",
                &["resource"],
            ),
            informer_cached_objects: gauge(
                "keb_informer_cached_objects",
                "Objects in the informer cache",
                &["resource"],
            ),
            informer_synced: gauge(
                "keb_informer_synced",
                "1 once the informer's first list is cached",
                &["resource"],
            ),
            listener_buffered: gauge(
                "keb_listener_buffered_notifications",
                "Notifications a route holds, pending or being published",
                &["resource", "sink"],
            ),
            listener_coalesced: counter(
                "keb_listener_coalesced_total",
                "Updates merged into a pending notification because the sink was at its cap",
                &["resource", "sink"],
            ),
            filtered: counter(
                "keb_filtered_total",
                "Notifications a route's filter did not publish, by reason",
                &["resource", "sink", "reason"],
            ),
            filter_errors: counter(
                "keb_filter_errors_total",
                "Filter evaluations that failed (the notification passed or was dropped as filter_error says)",
                &["resource", "sink"],
            ),
            message_degraded: counter(
                "keb_message_degraded_total",
                "Messages over the destination's size limit, by the step that made them fit",
                &["sink", "resource", "step"],
            ),
            sink_published: counter(
                "keb_sink_published_total",
                "Messages acknowledged by the sink",
                &["sink", "resource", "type"],
            ),
            sink_failed: counter(
                "keb_sink_failed_total",
                "Failed publish attempts",
                &["sink", "resource", "reason"],
            ),
            sink_bytes: counter(
                "keb_sink_bytes_total",
                "Payload bytes acknowledged by the sink",
                &["sink", "resource"],
            ),
            kafka_transactions: counter(
                "keb_kafka_transactions_total",
                "Transactions of an exactly-once Kafka sink, committed or aborted",
                &["sink", "outcome"],
            ),
            kafka_producer_fenced: gauge(
                "keb_kafka_producer_fenced",
                "Transactional ids of an exactly-once Kafka sink whose producer here was fenced by a newer one, until a term of this replica starts it again",
                &["sink"],
            ),
            sink_in_flight: gauge(
                "keb_sink_in_flight",
                "Publishes waiting for the destination's acknowledgement",
                &["sink"],
            ),
            sink_publish_duration: latency(
                "keb_sink_publish_duration_seconds",
                "Time from publish to acknowledgement",
                &["sink"],
            ),
            end_to_end_latency: latency(
                "keb_end_to_end_latency_seconds",
                "Time from watch event received to sink acknowledgement",
                &["resource", "sink"],
            ),
            resume_objects: counter(
                "keb_resume_objects_total",
                "Objects compared with a route's checkpoint when it resumed, by outcome",
                &["route", "outcome"],
            ),
            takeover_wait: {
                let g = prometheus::GaugeVec::new(
                    Opts::new(
                        "keb_takeover_wait_seconds",
                        "Seconds left of the takeover wait after this replica took a Lease over (it publishes nothing until then)",
                    ),
                    &["lease"],
                )
                .expect("valid metric");
                registry
                    .register(Box::new(g.clone()))
                    .expect("unique metric");
                g
            },
            informer_last_event_age: {
                let g = prometheus::GaugeVec::new(
                    Opts::new(
                        "keb_informer_last_event_age_seconds",
                        "Seconds since a running informer last heard from the API server (event, bookmark or list page)",
                    ),
                    &["resource"],
                )
                .expect("valid metric");
                registry
                    .register(Box::new(g.clone()))
                    .expect("unique metric");
                g
            },
            checkpoint_load_seconds: {
                let g = prometheus::GaugeVec::new(
                    Opts::new(
                        "keb_checkpoint_load_seconds",
                        "How long the last load of a route's checkpoint took",
                    ),
                    &["route"],
                )
                .expect("valid metric");
                registry
                    .register(Box::new(g.clone()))
                    .expect("unique metric");
                g
            },
            checkpoint_waiting: gauge(
                "keb_checkpoint_waiting",
                "1 while the route publishes nothing because its checkpoint cannot be loaded",
                &["route"],
            ),
            route_resuming: gauge(
                "keb_route_resuming",
                "1 from when this replica takes the route's Lease until its resume from the checkpoint is over",
                &["route"],
            ),
            checkpoint_lag: gauge(
                "keb_checkpoint_lag",
                "Keys acknowledged by the sink but not yet stored in the route's checkpoint",
                &["route"],
            ),
            checkpoint_write_failures: counter(
                "keb_checkpoint_write_failures_total",
                "Failed writes of a route's checkpoint; each is retried",
                &["route"],
            ),
            api_requests: single(
                "keb_kubernetes_api_requests_total",
                "Requests sent to the Kubernetes API server",
            ),
            api_throttled: single(
                "keb_kubernetes_api_throttled_total",
                "Answers 429 Too Many Requests from the Kubernetes API server",
            ),
            api_retry_after_seconds: single(
                "keb_kubernetes_api_retry_after_seconds_total",
                "Retry-After seconds of the API server's 429 answers",
            ),
            api_client_wait_seconds,
            resource_pending: gauge(
                "keb_resource_pending",
                "1 while a configured kind is not served by the API server (yet)",
                &["resource"],
            ),
            informer_forbidden: gauge(
                "keb_informer_forbidden",
                "1 while the informer's list or watch is refused (403 Forbidden)",
                &["resource"],
            ),
            informer_shard_server_side: gauge(
                "keb_informer_shard_server_side",
                "For a shard's informer: 1 while the API server applies the shard selector, 0 while the client filters",
                &["resource"],
            ),
            shard_owned: gauge(
                "keb_shard_owned",
                "1 while this replica owns the shard (holds its Lease)",
                &["shard"],
            ),
            shard_handovers: counter(
                "keb_shard_handovers_total",
                "Times this replica acquired a shard (began publishing it) or stopped publishing it",
                &["shard", "change"],
            ),
            shard_replicas: {
                let g = IntGauge::new(
                    "keb_shard_replicas",
                    "Replicas sharing the shards, as this one sees them (itself included)",
                )
                .expect("valid metric");
                registry
                    .register(Box::new(g.clone()))
                    .expect("unique metric");
                g
            },
            informer_watch_stalls: counter(
                "keb_informer_watch_stalls_total",
                "Watches restarted after delivering neither an event nor a bookmark for kubernetes.watch_stall_timeout",
                &["resource"],
            ),
            api_reachable,
            leader,
            workqueue: WorkqueueMetricFamilies::register(&registry).expect("unique metrics"),
            registry,
        }
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# {e}\n"))
    }
}
