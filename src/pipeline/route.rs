//! Building one route (a resource's kind to one sink) from its parts, the same way for the
//! service, the tests and the benches: what is measured and tested is what runs.
//!
//! ```text
//! listeners ─▶ [Resumer] ─▶ [RouteFilter] ─▶ RouteQueue ─▶ workers (Route) ─▶ sink
//!                                                              └─▶ [Checkpointer]
//! ```
//! The resumer sits in front when the route resumes from a checkpoint (it compares the first
//! list with it and applies the route's `events` after); the filter when the resource filters;
//! the checkpointer records what the sink acknowledged.

use std::sync::Arc;

use kube::api::TypeMeta;

use super::{
    Budget, Checkpointer, Delivery, Resumer, Route, RouteQueue,
    filter::{FilterMetrics, Reason, RouteFilter, Rules},
    resume::Outcome,
};
use crate::{
    informer::{EventType, NotificationHandler},
    message::Encoder,
    metrics::Metrics,
    sinks::CheckpointStore,
    workqueue::rate_limiter::{RetrySettings, controller_rate_limiter},
};

/// Most notifications a sink's routes hold together by default (`sinks[].max_pending`), and
/// a route built without a shared budget: about 100 MB of 1 KB objects, so a sink may lag by
/// that much before updates are coalesced.
pub const DEFAULT_MAX_PENDING: usize = 100_000;

/// Most objects a sink's routes have in flight together by default
/// (`sinks[].max_objects_in_flight`; see [`super::Delivery::in_flight`]).
pub const DEFAULT_MAX_OBJECTS_IN_FLIGHT: usize = 4096;

/// The same for a Kafka sink with `exactly_once`, whose objects stay in flight until their
/// transaction commits.
pub const DEFAULT_MAX_TRANSACTIONAL_OBJECTS_IN_FLIGHT: usize = 32_768;

/// Most bytes of messages a sink's routes have in flight together by default
/// (`sinks[].max_bytes_in_flight`; see [`super::InFlight`]).
pub const DEFAULT_MAX_BYTES_IN_FLIGHT: usize = 8 << 20;

/// The same for a Kafka sink with `exactly_once`.
pub const DEFAULT_MAX_TRANSACTIONAL_BYTES_IN_FLIGHT: usize = 128 << 20;

/// Builds one route. Names: the route is `{resource}/{sink}`, its metrics are labelled with
/// `resource` and `sink`.
pub struct RouteBuilder<'m> {
    resource: String,
    sink: String,
    encoder: Encoder,
    delivery: Arc<Delivery>,
    metrics: &'m Metrics,
    budget: Option<Arc<Budget>>,
    retry: RetrySettings,
    events: Vec<EventType>,
    rules: Option<Arc<Rules>>,
    filter_lanes: Option<usize>,
    store: Option<Arc<dyn CheckpointStore>>,
    resume: Option<(TypeMeta, usize)>,
    fence: Option<crate::leader::Fence>,
}

/// A built route and what feeds it.
pub struct BuiltRoute {
    /// The route: its queue and what its workers publish with.
    pub route: Arc<Route>,
    /// What the route's listeners hand notifications to: the resumer, the filter or the
    /// queue. Listeners pass on every type: the queue applies the route's `events`.
    pub handler: Arc<dyn NotificationHandler>,
    /// The resumer, when the route resumes from its checkpoint.
    pub resumer: Option<Arc<Resumer>>,
    /// The checkpointer the workers record acknowledgements into, with a store.
    pub checkpointer: Option<Arc<Checkpointer>>,
}

impl<'m> RouteBuilder<'m> {
    /// A route of `resource` (its name in metrics: `configmap`, `all/widgets.example.com`) to
    /// the sink of `delivery`, labelled `sink` (usually the sink's name), encoding with
    /// `encoder`. By default: every event type, client-go's retry settings, a budget of its
    /// own of [`DEFAULT_MAX_PENDING`], no filter, no checkpoint.
    pub fn new(
        resource: &str,
        sink: &str,
        encoder: Encoder,
        delivery: Arc<Delivery>,
        metrics: &'m Metrics,
    ) -> Self {
        Self {
            resource: resource.to_owned(),
            sink: sink.to_owned(),
            encoder,
            delivery,
            metrics,
            budget: None,
            retry: RetrySettings::default(),
            events: EventType::ALL.to_vec(),
            rules: None,
            filter_lanes: None,
            store: None,
            resume: None,
            fence: None,
        }
    }

    /// With leader election: hands messages over only while `fence` is valid.
    pub fn fence(mut self, fence: Option<crate::leader::Fence>) -> Self {
        self.fence = fence;
        self
    }

    /// The route's name, `{resource}/{sink}`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.resource, self.sink)
    }

    /// Shares `budget` (the sink's `max_pending`) with the sink's other routes.
    pub fn budget(mut self, budget: Arc<Budget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Retries failed publishes with `retry`.
    pub fn retry(mut self, retry: RetrySettings) -> Self {
        self.retry = retry;
        self
    }

    /// Publishes only notifications of these types.
    pub fn events(mut self, events: &[EventType]) -> Self {
        self.events = events.to_vec();
        self
    }

    /// Filters with `rules` (none: no filter stage).
    pub fn filter(mut self, rules: Option<Arc<Rules>>) -> Self {
        self.rules = rules;
        self
    }

    /// Evaluates the filter on `lanes` tasks of its own, in parallel across keys (0: on the
    /// informer's thread). By default one per worker thread of the Tokio runtime the route is
    /// built on (none outside a runtime).
    pub fn filter_lanes(mut self, lanes: usize) -> Self {
        self.filter_lanes = Some(lanes);
        self
    }

    /// Records what the sink acknowledged into `store` (none: no checkpoint). The caller runs
    /// the checkpointer's writes ([`Checkpointer::run`], then a last [`Checkpointer::flush`]);
    /// the service always pairs it with [`resume`](Self::resume).
    pub fn checkpoint(mut self, store: Option<Arc<dyn CheckpointStore>>) -> Self {
        self.store = store;
        self
    }

    /// With a checkpoint store, compares the first list of the route's `informers` informers
    /// of objects of `types` with the checkpoint and publishes only what changed.
    pub fn resume(mut self, types: TypeMeta, informers: usize) -> Self {
        self.resume = Some((types, informers));
        self
    }

    /// Builds the queue, the stages in front of it and the route.
    pub fn build(self) -> BuiltRoute {
        let metrics = self.metrics;
        let name = self.name();
        let labels = [self.resource.as_str(), self.sink.as_str()];
        let queue = Arc::new(
            RouteQueue::new(
                name.clone(),
                Box::new(controller_rate_limiter(self.retry)),
                metrics.workqueue.for_queue(&name),
                self.budget
                    .unwrap_or_else(|| Arc::new(Budget::new(DEFAULT_MAX_PENDING))),
                metrics.listener_buffered.with_label_values(&labels),
                metrics.listener_coalesced.with_label_values(&labels),
            )
            .with_events(&self.events)
            .with_fence(self.fence.clone()),
        );
        let front: Arc<dyn NotificationHandler> = match self.rules {
            Some(rules) => Arc::new(
                RouteFilter::new(
                    name.clone(),
                    rules,
                    queue.clone(),
                    FilterMetrics {
                        filtered: Reason::ALL.map(|reason| {
                            metrics.filtered.with_label_values(&[
                                labels[0],
                                labels[1],
                                reason.as_str(),
                            ])
                        }),
                        errors: metrics.filter_errors.with_label_values(&labels),
                    },
                )
                .with_lanes(self.filter_lanes.unwrap_or_else(|| {
                    tokio::runtime::Handle::try_current().map_or(0, |h| h.metrics().num_workers())
                })),
            ),
            None => queue.clone(),
        };
        let checkpointer = self.store.map(|store| {
            Arc::new(
                Checkpointer::new(
                    name.clone(),
                    store,
                    metrics.checkpoint_lag.with_label_values(&[&name]),
                    metrics
                        .checkpoint_write_failures
                        .with_label_values(&[&name]),
                )
                .with_fence(self.fence.clone())
                .in_transactions(self.delivery.sink.in_transactions()),
            )
        });
        let resumer = match (&checkpointer, self.resume) {
            (Some(_), Some((types, informers))) => Some(Arc::new(Resumer::new(
                name.clone(),
                front.clone(),
                types,
                informers,
                Outcome::ALL.map(|o| {
                    metrics
                        .resume_objects
                        .with_label_values(&[name.as_str(), o.as_str()])
                }),
                metrics.route_resuming.with_label_values(&[name.as_str()]),
            ))),
            _ => None,
        };
        let handler: Arc<dyn NotificationHandler> = match &resumer {
            Some(r) => r.clone(),
            None => front,
        };
        let mut route = Route::new(self.resource, queue, self.encoder, self.delivery, metrics);
        if let Some(c) = &checkpointer {
            route = route.with_checkpointer(c.clone());
        }
        BuiltRoute {
            route: Arc::new(route),
            handler,
            resumer,
            checkpointer,
        }
    }
}
