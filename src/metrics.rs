//! Every metric family, registered in one place. Names are part of the public interface
//! (dashboards and alerts use them); labels are bounded sets taken from the config, never
//! object names.

use crate::workqueue::metrics::WorkqueueMetricFamilies;
use prometheus::{
    Counter, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, core::Collector, exponential_buckets,
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
    /// `keb_sink_bytes_in_flight{sink}`: their messages' bytes (see
    /// `sinks[].max_bytes_in_flight`).
    pub sink_bytes_in_flight: IntGaugeVec,
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
    pub api_client_wait_seconds: Counter,
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
    pub informer_last_event_age: GaugeVec,
    /// `keb_informer_shard_server_side{resource}`: for a shard's informer, 1 while the API
    /// server applies its shard selector, 0 while the client filters (the server ignored it).
    pub informer_shard_server_side: IntGaugeVec,
    /// `keb_leader`: 1 while this replica publishes (it leads, or leader election is off).
    pub leader: IntGauge,
    /// `keb_takeover_wait_seconds{lease}`: after this replica took a Lease over, the seconds
    /// left before it publishes (the last holder's messages may still be delivered until
    /// then); 0 otherwise.
    pub takeover_wait: GaugeVec,
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
    pub checkpoint_load_seconds: GaugeVec,
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
    /// Creates and registers every family (see the table below), plus process metrics on Linux.
    pub fn new() -> Self {
        let registry = Registry::new();
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("unique metric");
        let r = Registrar(&registry);
        Self {
            informer_notifications: r.counter(&INFORMER_NOTIFICATIONS),
            informer_watch_events: r.counter(&INFORMER_WATCH_EVENTS),
            informer_watch_errors: r.counter(&INFORMER_WATCH_ERRORS),
            informer_relists: r.counter(&INFORMER_RELISTS),
            informer_cached_objects: r.gauge(&INFORMER_CACHED_OBJECTS),
            informer_synced: r.gauge(&INFORMER_SYNCED),
            listener_buffered: r.gauge(&LISTENER_BUFFERED),
            listener_coalesced: r.counter(&LISTENER_COALESCED),
            filtered: r.counter(&FILTERED),
            filter_errors: r.counter(&FILTER_ERRORS),
            message_degraded: r.counter(&MESSAGE_DEGRADED),
            sink_published: r.counter(&SINK_PUBLISHED),
            sink_failed: r.counter(&SINK_FAILED),
            sink_bytes: r.counter(&SINK_BYTES),
            kafka_transactions: r.counter(&KAFKA_TRANSACTIONS),
            kafka_producer_fenced: r.gauge(&KAFKA_PRODUCER_FENCED),
            sink_in_flight: r.gauge(&SINK_IN_FLIGHT),
            sink_bytes_in_flight: r.gauge(&SINK_BYTES_IN_FLIGHT),
            sink_publish_duration: r.latency(&SINK_PUBLISH_DURATION),
            end_to_end_latency: r.latency(&END_TO_END_LATENCY),
            api_reachable: r.single_gauge(&API_REACHABLE),
            api_requests: r.single_counter(&API_REQUESTS),
            api_throttled: r.single_counter(&API_THROTTLED),
            api_retry_after_seconds: r.single_counter(&API_RETRY_AFTER_SECONDS),
            api_client_wait_seconds: r.seconds_counter(&API_CLIENT_WAIT_SECONDS),
            resource_pending: r.gauge(&RESOURCE_PENDING),
            informer_forbidden: r.gauge(&INFORMER_FORBIDDEN),
            informer_watch_stalls: r.counter(&INFORMER_WATCH_STALLS),
            informer_last_event_age: r.float_gauge(&INFORMER_LAST_EVENT_AGE),
            informer_shard_server_side: r.gauge(&INFORMER_SHARD_SERVER_SIDE),
            leader: r.single_gauge(&LEADER),
            takeover_wait: r.float_gauge(&TAKEOVER_WAIT),
            shard_owned: r.gauge(&SHARD_OWNED),
            shard_handovers: r.counter(&SHARD_HANDOVERS),
            shard_replicas: r.single_gauge(&SHARD_REPLICAS),
            resume_objects: r.counter(&RESUME_OBJECTS),
            checkpoint_load_seconds: r.float_gauge(&CHECKPOINT_LOAD_SECONDS),
            checkpoint_waiting: r.gauge(&CHECKPOINT_WAITING),
            route_resuming: r.gauge(&ROUTE_RESUMING),
            checkpoint_lag: r.gauge(&CHECKPOINT_LAG),
            checkpoint_write_failures: r.counter(&CHECKPOINT_WRITE_FAILURES),
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

/// A metric family: its name, help and label names (none for a single series).
struct Family {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
}

impl Family {
    fn opts(&self) -> Opts {
        Opts::new(self.name, self.help)
    }
}

/// Creates families and registers them in one registry. A family is valid and its name unique
/// by construction (the table below), so a failure is a bug and panics.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    fn register<C: Collector + Clone + 'static>(&self, made: prometheus::Result<C>) -> C {
        let c = made.expect("valid metric");
        self.0.register(Box::new(c.clone())).expect("unique metric");
        c
    }

    fn counter(&self, f: &Family) -> IntCounterVec {
        self.register(IntCounterVec::new(f.opts(), f.labels))
    }

    fn gauge(&self, f: &Family) -> IntGaugeVec {
        self.register(IntGaugeVec::new(f.opts(), f.labels))
    }

    fn float_gauge(&self, f: &Family) -> GaugeVec {
        self.register(GaugeVec::new(f.opts(), f.labels))
    }

    /// Buckets from 1 ms to about 65 s: from a local stdout write to a broker under stress.
    fn latency(&self, f: &Family) -> HistogramVec {
        let buckets = exponential_buckets(0.001, 2.0, 17).expect("valid buckets");
        let opts = HistogramOpts::new(f.name, f.help).buckets(buckets);
        self.register(HistogramVec::new(opts, f.labels))
    }

    fn single_counter(&self, f: &Family) -> IntCounter {
        self.register(IntCounter::with_opts(f.opts()))
    }

    fn single_gauge(&self, f: &Family) -> IntGauge {
        self.register(IntGauge::with_opts(f.opts()))
    }

    fn seconds_counter(&self, f: &Family) -> Counter {
        self.register(Counter::with_opts(f.opts()))
    }
}

// The families, in the order of `Metrics`' fields: name, help, labels.

const INFORMER_NOTIFICATIONS: Family = Family {
    name: "keb_informer_notifications_total",
    help: "Notifications distributed by informers, by type",
    labels: &["resource", "type"],
};

const INFORMER_WATCH_EVENTS: Family = Family {
    name: "keb_informer_watch_events_total",
    help: "Objects received from list and watch, by kind of event",
    labels: &["resource", "type"],
};

const INFORMER_WATCH_ERRORS: Family = Family {
    name: "keb_informer_watch_errors_total",
    help: "List or watch failures; each is retried with backoff",
    labels: &["resource"],
};

const INFORMER_RELISTS: Family = Family {
    name: "keb_informer_relists_total",
    help: "Lists after the first one",
    labels: &["resource"],
};

const INFORMER_CACHED_OBJECTS: Family = Family {
    name: "keb_informer_cached_objects",
    help: "Objects in the informer cache",
    labels: &["resource"],
};

const INFORMER_SYNCED: Family = Family {
    name: "keb_informer_synced",
    help: "1 once the informer's first list is cached",
    labels: &["resource"],
};

const LISTENER_BUFFERED: Family = Family {
    name: "keb_listener_buffered_notifications",
    help: "Notifications a route holds, pending or being published",
    labels: &["resource", "sink"],
};

const LISTENER_COALESCED: Family = Family {
    name: "keb_listener_coalesced_total",
    help: "Updates merged into a pending notification because the sink was at its cap",
    labels: &["resource", "sink"],
};

const FILTERED: Family = Family {
    name: "keb_filtered_total",
    help: "Notifications a route's filter did not publish, by reason",
    labels: &["resource", "sink", "reason"],
};

const FILTER_ERRORS: Family = Family {
    name: "keb_filter_errors_total",
    help: "Filter evaluations that failed (the notification passed or was dropped as filter_error says)",
    labels: &["resource", "sink"],
};

const MESSAGE_DEGRADED: Family = Family {
    name: "keb_message_degraded_total",
    help: "Messages over the destination's size limit, by the step that made them fit",
    labels: &["sink", "resource", "step"],
};

const SINK_PUBLISHED: Family = Family {
    name: "keb_sink_published_total",
    help: "Messages acknowledged by the sink",
    labels: &["sink", "resource", "type"],
};

const SINK_FAILED: Family = Family {
    name: "keb_sink_failed_total",
    help: "Failed publish attempts",
    labels: &["sink", "resource", "reason"],
};

const SINK_BYTES: Family = Family {
    name: "keb_sink_bytes_total",
    help: "Payload bytes acknowledged by the sink",
    labels: &["sink", "resource"],
};

const KAFKA_TRANSACTIONS: Family = Family {
    name: "keb_kafka_transactions_total",
    help: "Transactions of an exactly-once Kafka sink, committed or aborted",
    labels: &["sink", "outcome"],
};

const KAFKA_PRODUCER_FENCED: Family = Family {
    name: "keb_kafka_producer_fenced",
    help: "Transactional ids of an exactly-once Kafka sink whose producer here was fenced by a newer one, until a term of this replica starts it again",
    labels: &["sink"],
};

const SINK_IN_FLIGHT: Family = Family {
    name: "keb_sink_in_flight",
    help: "Publishes waiting for the destination's acknowledgement",
    labels: &["sink"],
};

const SINK_BYTES_IN_FLIGHT: Family = Family {
    name: "keb_sink_bytes_in_flight",
    help: "Bytes of the messages waiting for the destination's acknowledgement",
    labels: &["sink"],
};

const SINK_PUBLISH_DURATION: Family = Family {
    name: "keb_sink_publish_duration_seconds",
    help: "Time from publish to acknowledgement",
    labels: &["sink"],
};

const END_TO_END_LATENCY: Family = Family {
    name: "keb_end_to_end_latency_seconds",
    help: "Time from watch event received to sink acknowledgement",
    labels: &["resource", "sink"],
};

const API_REACHABLE: Family = Family {
    name: "keb_kubernetes_api_reachable",
    help: "1 while the last Kubernetes API health probe succeeded",
    labels: &[],
};

const API_REQUESTS: Family = Family {
    name: "keb_kubernetes_api_requests_total",
    help: "Requests sent to the Kubernetes API server",
    labels: &[],
};

const API_THROTTLED: Family = Family {
    name: "keb_kubernetes_api_throttled_total",
    help: "Answers 429 Too Many Requests from the Kubernetes API server",
    labels: &[],
};

const API_RETRY_AFTER_SECONDS: Family = Family {
    name: "keb_kubernetes_api_retry_after_seconds_total",
    help: "Retry-After seconds of the API server's 429 answers",
    labels: &[],
};

const API_CLIENT_WAIT_SECONDS: Family = Family {
    name: "keb_kubernetes_api_client_wait_seconds_total",
    help: "Time requests waited for the client-side rate limit (kubernetes.qps and burst)",
    labels: &[],
};

const RESOURCE_PENDING: Family = Family {
    name: "keb_resource_pending",
    help: "1 while a configured kind is not served by the API server (yet)",
    labels: &["resource"],
};

const INFORMER_FORBIDDEN: Family = Family {
    name: "keb_informer_forbidden",
    help: "1 while the informer's list or watch is refused (403 Forbidden)",
    labels: &["resource"],
};

const INFORMER_WATCH_STALLS: Family = Family {
    name: "keb_informer_watch_stalls_total",
    help: "Watches restarted after delivering neither an event nor a bookmark for kubernetes.watch_stall_timeout",
    labels: &["resource"],
};

const INFORMER_LAST_EVENT_AGE: Family = Family {
    name: "keb_informer_last_event_age_seconds",
    help: "Seconds since a running informer last heard from the API server (event, bookmark or list page)",
    labels: &["resource"],
};

const INFORMER_SHARD_SERVER_SIDE: Family = Family {
    name: "keb_informer_shard_server_side",
    help: "For a shard's informer: 1 while the API server applies the shard selector, 0 while the client filters",
    labels: &["resource"],
};

const LEADER: Family = Family {
    name: "keb_leader",
    help: "1 while this replica publishes: it leads, or leader election is off",
    labels: &[],
};

const TAKEOVER_WAIT: Family = Family {
    name: "keb_takeover_wait_seconds",
    help: "Seconds left of the takeover wait after this replica took a Lease over (it publishes nothing until then)",
    labels: &["lease"],
};

const SHARD_OWNED: Family = Family {
    name: "keb_shard_owned",
    help: "1 while this replica owns the shard (holds its Lease)",
    labels: &["shard"],
};

const SHARD_HANDOVERS: Family = Family {
    name: "keb_shard_handovers_total",
    help: "Times this replica acquired a shard (began publishing it) or stopped publishing it",
    labels: &["shard", "change"],
};

const SHARD_REPLICAS: Family = Family {
    name: "keb_shard_replicas",
    help: "Replicas sharing the shards, as this one sees them (itself included)",
    labels: &[],
};

const RESUME_OBJECTS: Family = Family {
    name: "keb_resume_objects_total",
    help: "Objects compared with a route's checkpoint when it resumed, by outcome",
    labels: &["route", "outcome"],
};

const CHECKPOINT_LOAD_SECONDS: Family = Family {
    name: "keb_checkpoint_load_seconds",
    help: "How long the last load of a route's checkpoint took",
    labels: &["route"],
};

const CHECKPOINT_WAITING: Family = Family {
    name: "keb_checkpoint_waiting",
    help: "1 while the route publishes nothing because its checkpoint cannot be loaded",
    labels: &["route"],
};

const ROUTE_RESUMING: Family = Family {
    name: "keb_route_resuming",
    help: "1 from when this replica takes the route's Lease until its resume from the checkpoint is over",
    labels: &["route"],
};

const CHECKPOINT_LAG: Family = Family {
    name: "keb_checkpoint_lag",
    help: "Keys acknowledged by the sink but not yet stored in the route's checkpoint",
    labels: &["route"],
};

const CHECKPOINT_WRITE_FAILURES: Family = Family {
    name: "keb_checkpoint_write_failures_total",
    help: "Failed writes of a route's checkpoint; each is retried",
    labels: &["route"],
};
