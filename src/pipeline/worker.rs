//! The workers of one route: take a key, publish its notifications in order, settle or retry.

use std::{collections::VecDeque, sync::Arc};

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};
use serde_json::json;
use tokio::{sync::OwnedSemaphorePermit as OwnedPermit, task::JoinHandle};
use tracing::{debug, error, info, warn};

use super::{RouteQueue, route_queue::Key};
use crate::{
    informer::{EventType, Notification, NotificationKind},
    message::{Encoder, Message, Trim},
    metrics::Metrics,
    sinks::{FailureReason, Sink},
    workqueue::TokenBucket,
};

/// Room left under a sink's size limit for what [`Message::wire_size`] does not count
/// (record framing, the sink's own headers).
const SIZE_MARGIN: usize = 1024;

/// While shutting down, how long a failed key waits before its next attempt.
const SHUTDOWN_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(200);

/// How often a key held back by a lapsed lease (see `RouteQueue::may_hand_over`) looks again.
const FENCE_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(100);

/// At most one warning per route this often about retriable failures (an outage fails every
/// object in flight; the line counts them).
const FAILURE_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// How one sink is published to; shared by the sink's routes.
pub struct Delivery {
    /// The destination.
    pub sink: Arc<dyn Sink>,
    /// Receives a reference record for each message that fails for good.
    pub dead_letter: Option<Arc<dyn Sink>>,
    /// Optional publish rate limit protecting the destination.
    pub publish_limit: Option<Arc<TokenBucket>>,
    /// Retries of one notification before it fails for good; `None`: forever.
    pub max_retries: Option<u32>,
    /// Room in flight at the sink, shared by its routes (and shards): see [`InFlight`].
    pub in_flight: Arc<InFlight>,
}

impl Delivery {
    /// Room for `objects` objects and `bytes` bytes of their messages in flight (see
    /// [`InFlight`]).
    pub fn in_flight(objects: usize, bytes: usize) -> Arc<InFlight> {
        let max = |n: usize| n.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        Arc::new(InFlight {
            objects: Arc::new(tokio::sync::Semaphore::new(max(objects))),
            bytes: Arc::new(tokio::sync::Semaphore::new(max(bytes))),
            max_bytes: max(bytes),
        })
    }
}

/// Room in flight at a sink, for all its routes together.
/// - Objects (`sinks[].max_objects_in_flight`): a worker takes a permit before it hands a key
///   over, and the key's release gives it back (see [`Route::spawn_workers`]); a key waiting
///   for its checkpoint intent or a lapsed lease has nothing in flight and gives it back
///   meanwhile.
/// - Bytes (`sinks[].max_bytes_in_flight`): before a notification is encoded it takes room
///   for an estimate of its message ([`Encoder::size_estimate`](crate::message::Encoder),
///   at most the sink's size limit), fitted to the
///   message's [`wire_size`](crate::message::Message::wire_size) once encoded (at most the
///   whole room), and gives it back with the acknowledgement. So a key waiting for room
///   holds no encoded message, and what is encoded or handed over stays within the room
///   (plus what a message outgrew its estimate by, while it waits again). A wait holds no
///   room: one that outgrew its estimate gives its room back before it waits for the whole.
///   The room a message holds comes back with acknowledgements that need nothing else handed
///   over: waiting for bytes never waits on itself.
pub struct InFlight {
    objects: Arc<tokio::sync::Semaphore>,
    bytes: Arc<tokio::sync::Semaphore>,
    max_bytes: usize,
}

impl InFlight {
    /// The room a message of `size` bytes takes: all of the room at most.
    fn room_for(&self, size: usize) -> usize {
        size.clamp(1, self.max_bytes).min(u32::MAX as usize)
    }

    /// Room for a message of `size` bytes, once there is some.
    async fn bytes(&self, size: usize) -> OwnedPermit {
        (self.bytes.clone())
            .acquire_many_owned(self.room_for(size) as u32)
            .await
            .expect("a delivery's semaphore is never closed")
    }

    /// `room` fitted to a message of `size` bytes: what it holds beyond goes back at once; if
    /// it holds less, it is given back and the whole taken again once there is room.
    async fn fit(&self, mut room: OwnedPermit, size: usize) -> OwnedPermit {
        let (want, held) = (self.room_for(size), room.num_permits());
        if want <= held {
            drop(room.split(held - want));
            room
        } else {
            drop(room);
            self.bytes(size).await
        }
    }
}

struct RouteMetrics {
    published: [IntCounter; EventType::ALL.len()],
    in_flight: IntGauge,
    bytes_in_flight: IntGauge,
    bytes: IntCounter,
    publish_duration: Histogram,
    end_to_end: Histogram,
    failed: IntCounterVec,
    degraded: [IntCounter; Degradation::ALL.len()],
}

/// The `step` label of `keb_message_degraded_total`: how far a message over the
/// destination's size limit was cut before it was accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degradation {
    /// Sent without `data.oldObject` ([`Trim::OldObject`]).
    OldObject = 0,
    /// Sent without `data.oldObject` and `data.patch` ([`Trim::Patch`]).
    Patch,
    /// Sent as a reference ([`Trim::Reference`]).
    Reference,
    /// Too large even as a reference: dead-lettered.
    DeadLetter,
}

impl Degradation {
    /// Every step, in discriminant order.
    pub const ALL: [Degradation; 4] = [
        Self::OldObject,
        Self::Patch,
        Self::Reference,
        Self::DeadLetter,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OldObject => "old_object",
            Self::Patch => "patch",
            Self::Reference => "reference",
            Self::DeadLetter => "dead_letter",
        }
    }

    /// The step a message sent at `trim` counts at; `None` for a whole message.
    pub fn of(trim: Trim) -> Option<Self> {
        match trim {
            Trim::None => None,
            Trim::OldObject => Some(Self::OldObject),
            Trim::Patch => Some(Self::Patch),
            Trim::Reference => Some(Self::Reference),
        }
    }
}

/// One (resource, sink) route. See the module docs of [`super`].
pub struct Route {
    resource: String,
    queue: Arc<RouteQueue>,
    // Replaced when the kind's served version changes (see `set_encoder`).
    encoder: std::sync::RwLock<Arc<Encoder>>,
    delivery: Arc<Delivery>,
    metrics: RouteMetrics,
    checkpointer: Option<Arc<super::Checkpointer>>,
    // Set by a retriable failure, cleared by the next acknowledgement (see `acknowledged`).
    failing: std::sync::atomic::AtomicBool,
    // When the last failure warning was logged, and failures since.
    failure_log: std::sync::Mutex<(Option<std::time::Instant>, u64)>,
    // What the next message of some keys must take into account (see `Marks`).
    marks: std::sync::Mutex<Marks>,
    // Whether `marks` holds any: the hot path skips its lock when not.
    has_marks: std::sync::atomic::AtomicBool,
}

/// Per key, what the next message must take into account.
#[derive(Default)]
struct Marks {
    // The id of a message the destination refused as too large in its acknowledgement, and
    // the trim step its retry starts from.
    trim: std::collections::HashMap<String, (String, Trim)>,
    // Keys whose consumers may not hold the object a patch would start from (the last message
    // was a reference, or one failed for good): the next update goes without `data.patch`,
    // so that a consumer applying patches takes its `data.object`.
    unpatched: std::collections::HashSet<String>,
}

impl Marks {
    fn is_empty(&self) -> bool {
        self.trim.is_empty() && self.unpatched.is_empty()
    }
}

enum Outcome {
    Settled,
    Retry,
}

/// What is remembered of a message handed over, for its acknowledgement.
struct Sent {
    id: String,
    // How much of the message was left out to fit.
    trim: Trim,
    // How much of that was left out for a consumer's sake, not to fit (see `Marks`).
    forced: Trim,
    event_type: EventType,
    bytes: usize,
    received: std::time::Instant,
    started: std::time::Instant,
}

impl Sent {
    fn of(message: Message, (trim, forced): (Trim, Trim), started: std::time::Instant) -> Self {
        Self {
            bytes: message.payload.len(),
            id: message.id,
            trim,
            forced,
            event_type: message.event_type,
            received: message.received,
            started,
        }
    }
}

/// A message handed over, and the future of its acknowledgement.
struct Pending {
    ack: crate::sinks::Ack,
    message: Sent,
    /// Its bytes in flight (see [`InFlight`]), given back with the acknowledgement.
    bytes: OwnedPermit,
    /// Its payload, let go of with `bytes` (so within the room that counts it): a sink that
    /// shares it (Kafka's, until its report) lets go first, so it is freed by a runtime
    /// thread (likely the one that encoded it), not by the sink's reporting thread (mimalloc
    /// frees across threads by a slower path).
    payload: bytes::Bytes,
}

enum Submitted {
    /// Done with, for good (delivered, or failed for good and dead-lettered).
    Settled,
    /// Handed over; its acknowledgement is pending.
    Pending(Pending),
    /// Not handed over; to retry.
    Retry,
    /// Not handed over: the lease lapsed meanwhile (see `RouteQueue::may_hand_over`).
    Fenced,
}

/// What a worker handed over of a key's batch: at most one message, whose acknowledgement is
/// awaited before the next of the key is handed over; what follows it; whether a hand-over
/// failed (what follows then goes back for retry); or the checkpoint write the front of the
/// rest waits for (see [`super::Checkpointer::intend`]).
#[derive(Default)]
struct HandedOver {
    pending: Option<(Notification, Pending)>,
    rest: VecDeque<Notification>,
    failed: bool,
    intent: Option<futures::future::BoxFuture<'static, ()>>,
    // Held back: this replica's lease is not valid by its clock (see `RouteQueue::may_hand_over`).
    fenced: bool,
    // The sink's abandonments (see `Sink::abandoned`) when this was handed over: a failure
    // after another term's abandonment (with sharding: another shard's handover, on the
    // shared producer) may be that purge, not the destination's answer.
    abandoned: u64,
}

impl Route {
    /// A route delivering `queue`'s notifications of `resource` with `encoder` through `delivery`.
    pub fn new(
        resource: String,
        queue: Arc<RouteQueue>,
        encoder: Encoder,
        delivery: Arc<Delivery>,
        metrics: &Metrics,
    ) -> Self {
        let sink = delivery.sink.name().to_owned();
        let labels = [sink.as_str(), resource.as_str()];
        let metrics = RouteMetrics {
            published: EventType::ALL.map(|t| {
                metrics
                    .sink_published
                    .with_label_values(&[labels[0], labels[1], t.as_str()])
            }),
            in_flight: metrics.sink_in_flight.with_label_values(&[labels[0]]),
            bytes_in_flight: metrics.sink_bytes_in_flight.with_label_values(&[labels[0]]),
            bytes: metrics.sink_bytes.with_label_values(&labels),
            publish_duration: metrics
                .sink_publish_duration
                .with_label_values(&[labels[0]]),
            end_to_end: metrics
                .end_to_end_latency
                .with_label_values(&[labels[1], labels[0]]),
            failed: metrics.sink_failed.clone(),
            degraded: Degradation::ALL.map(|step| {
                metrics
                    .message_degraded
                    .with_label_values(&[labels[0], labels[1], step.as_str()])
            }),
        };
        for reason in FailureReason::ALL.map(FailureReason::as_str) {
            metrics
                .failed
                .with_label_values(&[labels[0], labels[1], reason]);
        }
        Self {
            resource,
            queue,
            encoder: std::sync::RwLock::new(Arc::new(encoder)),
            delivery,
            metrics,
            checkpointer: None,
            failing: std::sync::atomic::AtomicBool::new(false),
            failure_log: std::sync::Mutex::new((None, 0)),
            marks: std::sync::Mutex::default(),
            has_marks: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The encoder messages are made with now.
    pub fn encoder(&self) -> Arc<Encoder> {
        self.encoder
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Encodes from now on with `encoder` (the kind is now served at another version).
    pub fn set_encoder(&self, encoder: Encoder) {
        *self.encoder.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(encoder);
    }

    /// Records every settled notification in `checkpointer` (see `pipeline::checkpoint`).
    pub fn with_checkpointer(mut self, checkpointer: Arc<super::Checkpointer>) -> Self {
        self.checkpointer = Some(checkpointer);
        self
    }

    /// The route's queue.
    pub fn queue(&self) -> &Arc<RouteQueue> {
        &self.queue
    }

    /// Starts `n` workers; each ends when the work queue is shut down and empty. A worker
    /// hands a key over only with room for it in flight ([`Delivery::in_flight`]), held
    /// until the key is released (given back while it waits for its checkpoint intent or a
    /// lapsed lease, with nothing in flight): so at most that many objects of the sink's
    /// routes are handed over and unacknowledged at once. Keys waiting for their intents
    /// are outside that bound (a completion each in their worker, as many as new objects
    /// pending).
    pub fn spawn_workers(self: &Arc<Self>, n: usize) -> Vec<JoinHandle<()>> {
        (0..n.max(1))
            .map(|_| tokio::spawn(self.clone().work()))
            .collect()
    }

    fn failed(&self, reason: FailureReason) {
        self.metrics
            .failed
            .with_label_values(&[self.delivery.sink.name(), &self.resource, reason.as_str()])
            .inc();
    }

    /// Takes a key, hands its notifications to the sink in order without awaiting their
    /// acknowledgements, and moves on to the next key. The key's completion (awaiting the
    /// acknowledgements, settling or retrying; the key stays owned until then) runs among
    /// this worker's other keys, all polled by this one task: acknowledgements that come in
    /// together are settled in one wake-up of the worker, not one task each. Taking the next
    /// key (which may wait for room in flight or for the sink's own window) never stops the
    /// completions that make that room.
    async fn work(self: Arc<Self>) {
        use futures::{FutureExt, StreamExt};
        use std::panic::AssertUnwindSafe;
        let mut keys = futures::stream::FuturesUnordered::new();
        // A panic (a bug) strands only the key it happened with, as a task per key would:
        // the worker goes on with its other keys.
        let take = |route: Arc<Self>| AssertUnwindSafe(route.next_key()).catch_unwind();
        let next = take(self.clone());
        tokio::pin!(next);
        loop {
            tokio::select! {
                Some(()) = keys.next(), if !keys.is_empty() => {
                    // Acknowledgements settle without a tokio resource's budget: yield now
                    // and then, so that the runtime thread serves its other tasks.
                    tokio::task::consume_budget().await;
                }
                taken = &mut next => {
                    let (key, handed, term, room) = match taken {
                        Ok(Some(taken)) => taken,
                        Ok(None) => break,
                        Err(_) => {
                            error!(resource = %self.resource, sink = %self.delivery.sink.name(), "Handing a key over panicked; the key stays held");
                            next.set(take(self.clone()));
                            continue;
                        }
                    };
                    let held = key.clone();
                    let route = self.clone();
                    let completion = AssertUnwindSafe(self.clone().complete(key, handed, term, room));
                    let mut completion = Box::pin(completion.catch_unwind().map(move |r| {
                        if r.is_err() {
                            error!(resource = %route.resource, sink = %route.delivery.sink.name(), key = %held, "A key's delivery panicked; the key stays held");
                        }
                    }));
                    // Settled already (a sink that acknowledges at once): it takes no place
                    // among the keys awaited.
                    if (&mut completion).now_or_never().is_none() {
                        keys.push(completion);
                    }
                    next.set(take(self.clone()));
                }
            }
        }
        // The work queue is shut down and empty: what this worker handed over settles.
        while keys.next().await.is_some() {}
    }

    /// The next key of the work queue, with room for it in flight (see [`Delivery::in_flight`]),
    /// and what was handed over of its notifications as they are by then; `None` once the
    /// queue is shut down and empty. The room is taken after the key: an idle route's workers
    /// hold none that a busy one waits for.
    async fn next_key(self: Arc<Self>) -> Option<(Key, HandedOver, u64, OwnedPermit)> {
        let key = self.queue.queue().get().await?;
        let room = self.room_in_flight().await;
        let (batch, term) = self.queue.take(&key);
        let handed = self.hand_over(&key, batch, term).await;
        Some((key, handed, term, room))
    }

    /// Room for one more object in flight (see [`InFlight`]), once there is some.
    async fn room_in_flight(&self) -> OwnedPermit {
        (self
            .delivery
            .in_flight
            .objects
            .clone()
            .acquire_owned()
            .await)
            .expect("a delivery's semaphore is never closed")
    }

    /// Gives `room` back while `wait` runs (a key with nothing in flight meanwhile), then
    /// takes room again once there is some.
    async fn without_room(&self, room: OwnedPermit, wait: impl Future<Output = ()>) -> OwnedPermit {
        drop(room);
        wait.await;
        self.room_in_flight().await
    }

    /// Awaits what was handed over for `key`, settles it or retries, hands over the key's next
    /// notification (one message of a key in flight at a time), goes on with what arrived
    /// meanwhile when shutting down, and releases the key (and its `room` in flight).
    async fn complete(
        self: Arc<Self>,
        key: Key,
        mut handed: HandedOver,
        term: u64,
        mut room: OwnedPermit,
    ) {
        let queue = self.queue.queue();
        loop {
            if let Some(intent) = handed.intent.take() {
                // Once the key is in the checkpoint its message may go; a term that ends
                // meanwhile drops it (`hand_over` settles it) rather than waiting on. Nothing
                // of the key is in flight meanwhile: its room goes to other keys, so that the
                // checkpoint store's write time does not bound the sink's pace.
                let ended = self.queue.term_ended(term);
                room = self
                    .without_room(room, async {
                        tokio::select! {
                            () = intent => {}
                            () = ended => {}
                        }
                    })
                    .await;
                handed = self
                    .hand_over(&key, std::mem::take(&mut handed.rest), term)
                    .await;
                continue;
            }
            if std::mem::take(&mut handed.fenced) {
                // Not a failure of the sink: looked at again shortly, never given up on.
                // Nothing of the key is in flight meanwhile: its room goes to the keys of
                // other shards (a lapsed lease would otherwise take the whole sink's room).
                room = self
                    .without_room(room, tokio::time::sleep(FENCE_RETRY_DELAY))
                    .await;
                handed = self
                    .hand_over(&key, std::mem::take(&mut handed.rest), term)
                    .await;
                continue;
            }
            let (mut batch, mut failed) = self.settle_ack(&key, &mut handed, term).await;
            if !failed && !batch.is_empty() {
                // The acknowledgement came: the next message of the key goes now.
                handed = self.hand_over(&key, batch, term).await;
                continue;
            }
            // Only within the term: a failure after it ended (a purged queue) is no delivery
            // attempt to give up on (the retry below drops it). Nor is one after the sink
            // abandoned what it queued for an earlier term of the shard (lost and regained):
            // it is retried without counting. (With sharding each shard's view counts its
            // own abandonments: another shard's hand-over is none of these.)
            if failed && self.delivery.sink.abandoned() != handed.abandoned {
                queue.forget(&key);
            }
            if failed
                && self.queue.is_current(term)
                && self
                    .delivery
                    .max_retries
                    .is_some_and(|max| queue.num_requeues(&key) >= max)
            {
                self.give_up(&key, &mut batch, term).await;
                if !queue.is_shutting_down() {
                    // The rest (and what arrived meanwhile) goes on, without the delay earned
                    // by the one that failed; with nothing left the key is simply released.
                    self.queue.retry(&key, batch, term);
                    break;
                }
                // A draining work queue takes no retries (the key would stay parked with
                // what is left): the rest goes on here, and what arrived meanwhile comes
                // from `finish`.
                failed = false;
                if !batch.is_empty() {
                    handed = self.hand_over(&key, batch, term).await;
                    continue;
                }
            }
            if failed && queue.is_shutting_down() {
                // A draining work queue takes no retries: retry here, within the grace period
                // (what arrives meanwhile waits for `finish`, as usual). Nothing of the key is
                // in flight while it waits: its room goes to keys that can drain meanwhile.
                room = self
                    .without_room(room, tokio::time::sleep(SHUTDOWN_RETRY_DELAY))
                    .await;
                handed = self.hand_over(&key, batch, term).await;
                continue;
            }
            if failed {
                self.queue.retry(&key, batch, term);
                break;
            }
            queue.forget(&key);
            match self.queue.finish(&key) {
                // Shutting down: deliver what arrived, now.
                Some(more) => handed = self.hand_over(&key, more, term).await,
                None => break,
            }
        }
        queue.done(&key);
    }

    /// Hands the front of `batch` to the sink: settles the silent deletes and the
    /// notifications settled at once (no pipelining, failed for good) in front, and stops at
    /// the first message handed over (its acknowledgement pending) or at a retriable
    /// hand-over failure. What follows is handed over only once that acknowledgement came:
    /// one message of a key is in flight at a time, so a retry never re-sends an older state
    /// after a newer one was stored (see the delivery contract, docs/src/delivery-contract.md).
    async fn hand_over(
        &self,
        key: &str,
        mut batch: VecDeque<Notification>,
        term: u64,
    ) -> HandedOver {
        let mut handed = HandedOver {
            abandoned: self.delivery.sink.abandoned(),
            ..Default::default()
        };
        while let Some(n) = batch.pop_front() {
            if !self.queue.is_current(term) {
                // Leadership changed since the batch was taken: a standby publishes nothing,
                // and a new term starts from the informer's cache.
                self.queue.settle(batch.len() + 1);
                batch.clear();
                break;
            }
            if !self.queue.publishes(n.event_type()) {
                // A delete the route does not publish: it only settles the key.
                self.settle(key, &n, false, term);
                continue;
            }
            if !self.queue.may_hand_over() {
                // The lease may have lapsed (this replica was frozen or cut off): hold back
                // until it is renewed, or the term ends and drops this.
                batch.push_front(n);
                handed.fenced = true;
                break;
            }
            if let (
                Some(c),
                NotificationKind::Add { obj, .. } | NotificationKind::Update { new: obj, .. },
            ) = (&self.checkpointer, n.kind())
                && let Some(intent) = c.intend(key, obj)
            {
                // Consumers may get this message before its acknowledgement: the next resume
                // must know the key even if this process ends before then.
                batch.push_front(n);
                handed.intent = Some(intent);
                break;
            }
            match self.submit(key, &n, term).await {
                Submitted::Settled => {
                    self.settle(key, &n, false, term);
                }
                Submitted::Pending(ack) => {
                    handed.pending = Some((n, ack));
                    break;
                }
                Submitted::Retry => {
                    batch.push_front(n);
                    handed.failed = true;
                    break;
                }
                Submitted::Fenced => {
                    batch.push_front(n);
                    handed.fenced = true;
                    break;
                }
            }
        }
        handed.rest = batch;
        handed
    }

    /// Awaits the acknowledgement of what `handed` holds. Returns what is left of the key's
    /// batch, in order (the failed notification in front), and whether it failed.
    async fn settle_ack(
        &self,
        key: &str,
        handed: &mut HandedOver,
        term: u64,
    ) -> (VecDeque<Notification>, bool) {
        let mut rest = std::mem::take(&mut handed.rest);
        let mut failed = handed.failed;
        if let Some((n, pending)) = handed.pending.take() {
            let result = pending.ack.await;
            self.metrics
                .bytes_in_flight
                .sub(pending.bytes.num_permits() as i64);
            drop((pending.bytes, pending.payload));
            self.metrics.in_flight.dec();
            let delivered = result.is_ok();
            match self.acknowledged(key, &n, &pending.message, result).await {
                Outcome::Settled => {
                    self.settle(key, &n, delivered, term);
                }
                Outcome::Retry => {
                    rest.push_front(n);
                    failed = true;
                }
            }
        }
        (rest, failed)
    }

    /// Settles `n`, recording it in the checkpoint: `delivered`, failed for good, or a delete
    /// the route does not publish (the checkpoint forgets the key).
    fn settle(&self, key: &str, n: &Notification, delivered: bool, term: u64) {
        self.record(key, n, delivered, term);
        self.queue.settle(1);
    }

    /// Records the settlement of `n` in the checkpoint. A sink that writes the checkpoint in
    /// its transactions wrote a delivered message's record with it; it writes the others'
    /// here, before the key's next message, and only within leadership term `term` (a later
    /// term resumes from what the checkpoint holds: an older term's record would take it
    /// back).
    fn record(&self, key: &str, n: &Notification, delivered: bool, term: u64) {
        let Some(c) = &self.checkpointer else {
            return;
        };
        // A late settlement of an ended term: its record would land among the next term's
        // (undoing an intent the next term wrote for the same key, say).
        if !self.queue.is_current(term) {
            return;
        }
        if !c.is_transactional() {
            c.record(key, n);
        } else if !delivered {
            let change = super::Checkpointer::change_of(key, n);
            self.delivery.sink.settle_silently(c.route(), change);
        }
    }

    /// Fails the front notification of `batch` for good after `max_retries`.
    async fn give_up(&self, key: &str, batch: &mut VecDeque<Notification>, term: u64) {
        let queue = self.queue.queue();
        let n = batch.pop_front().expect("a failed notification");
        // Settled for good: a restart must not re-send it.
        self.record(key, &n, false, term);
        self.failed(FailureReason::MaxRetries);
        error!(sink = %self.delivery.sink.name(), resource = %self.resource, key,
               retries = queue.num_requeues(&Key::from(key)), "Giving up on a notification after max_retries");
        self.dead_letter(key, &n, None, FailureReason::MaxRetries)
            .await;
        self.queue.settle(1);
        queue.forget(&Key::from(key));
    }

    /// Encodes `n` so that it fits the sink's size limit, trimming it step by step (see
    /// [`Trim`]); `None` when even a reference is too large (dead-lettered then, `room`
    /// given back first: nothing of it is in flight meanwhile).
    async fn encode_fitting(
        &self,
        key: &str,
        n: &Notification,
        mut trim: Trim,
        room: &mut Option<OwnedPermit>,
    ) -> Option<(Message, Trim)> {
        let sink = &self.delivery.sink;
        let limit = sink
            .max_message_bytes()
            .map(|m| m.saturating_sub(SIZE_MARGIN));
        loop {
            let message = match self.encoder().encode_trimmed(key, n, trim) {
                Ok(m) => m,
                Err(err) => {
                    self.failed(FailureReason::Encode);
                    error!(error = %err, sink = %sink.name(), resource = %self.resource, key, "Cannot encode notification");
                    drop(room.take());
                    self.dead_letter(key, n, None, FailureReason::Encode).await;
                    return None;
                }
            };
            let Some(limit) = limit.filter(|&l| message.wire_size() > l) else {
                return Some((message, trim));
            };
            match self.next_trim(n, trim) {
                Some(next) => trim = next,
                None => {
                    drop(room.take());
                    self.too_large(key, n, &message, limit).await;
                    return None;
                }
            }
        }
    }

    /// Where the message of `n` starts trimming: a step recorded when the destination refused
    /// its message as too large, and at least [`Trim::Patch`] for an update of an unpatched key
    /// (see [`Marks`]); the second value is the step forced by the latter (not a degradation).
    fn trim_hint(&self, key: &str, n: &Notification) -> (Trim, Trim) {
        use std::sync::atomic::Ordering;
        if !self.has_marks.load(Ordering::Relaxed) {
            return (Trim::None, Trim::None);
        }
        let mut marks = self.lock_marks();
        // A mark of an older message of the key (a newer one took its place) goes too.
        let trim = match marks.trim.remove(key) {
            Some((id, trim)) if id == message_id(n) => trim,
            _ => Trim::None,
        };
        let forced = if marks.unpatched.contains(key)
            && self.encoder().trim_steps(n).contains(&Trim::Patch)
        {
            Trim::Patch
        } else {
            Trim::None
        };
        if marks.is_empty() {
            self.has_marks.store(false, Ordering::SeqCst);
        }
        (trim.max(forced), forced)
    }

    fn lock_marks(&self) -> std::sync::MutexGuard<'_, Marks> {
        self.marks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records whether the consumers of `key` hold the object its next patch starts from
    /// (only for an encoder that makes patches).
    fn set_unpatched(&self, key: &str, unpatched: bool) {
        use std::sync::atomic::Ordering;
        if !unpatched && !self.has_marks.load(Ordering::Relaxed) {
            return;
        }
        if !self.encoder().patches() {
            return;
        }
        let mut marks = self.lock_marks();
        if unpatched {
            marks.unpatched.insert(key.to_owned());
            // Set under the lock, as `trim_hint` clears it under the lock.
            self.has_marks.store(true, Ordering::SeqCst);
        } else {
            marks.unpatched.remove(key);
            if marks.is_empty() {
                self.has_marks.store(false, Ordering::SeqCst);
            }
        }
    }

    /// The step after `trim` that changes `n`'s message.
    fn next_trim(&self, n: &Notification, trim: Trim) -> Option<Trim> {
        self.encoder()
            .trim_steps(n)
            .into_iter()
            .find(|&step| step > trim)
    }

    async fn too_large(&self, key: &str, n: &Notification, message: &Message, limit: usize) {
        self.metrics.degraded[Degradation::DeadLetter as usize].inc();
        self.failed(FailureReason::TooLarge);
        error!(sink = %self.delivery.sink.name(), resource = %self.resource, key, size = message.wire_size(), limit,
               "Even a reference-only message exceeds the sink's size limit; dead-lettering it");
        self.dead_letter(
            key,
            n,
            Some((&message.id, message.payload.len())),
            FailureReason::TooLarge,
        )
        .await;
    }

    /// Encodes `n` and hands it to the sink, unless leadership term `term` ended meanwhile.
    async fn submit(&self, key: &str, n: &Notification, term: u64) -> Submitted {
        let sink = &self.delivery.sink;
        if let Some(limit) = &self.delivery.publish_limit {
            let wait = limit.reserve();
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
        // A message the broker refused as too large after the hand-over goes again trimmed.
        let (mut trim, forced) = self.trim_hint(key, n);
        // Room for the message's bytes before it is encoded (never more than the sink takes):
        // acknowledgements of other messages make it (see `InFlight`).
        let room = &self.delivery.in_flight;
        let mut estimate = self.encoder().size_estimate(n);
        if let Some(max) = self.delivery.sink.max_message_bytes() {
            estimate = estimate.min(max);
        }
        let mut held = Some(room.bytes(estimate).await);
        loop {
            let Some((message, fitted)) = self.encode_fitting(key, n, trim, &mut held).await else {
                return Submitted::Settled;
            };
            trim = fitted;
            let bytes = room
                .fit(
                    held.take().expect("held until handed over"),
                    message.wire_size(),
                )
                .await;
            // Checked again right before the hand-over: the rate limit's wait, an encoding,
            // the wait for room, or a freeze may have outlasted the lease, or its term (this
            // replica may lead again already: the next term sends what it needs from the
            // checkpoint).
            if !self.queue.may_hand_over() || !self.queue.is_current(term) {
                return Submitted::Fenced;
            }
            let started = std::time::Instant::now();
            self.metrics.in_flight.inc();
            let handed = match &self.checkpointer {
                Some(c) if c.is_transactional() => {
                    let change = super::Checkpointer::change_of(key, n);
                    sink.submit_settling(&message, c.route(), Some(change))
                        .await
                }
                _ => sink.submit(&message).await,
            };
            let err = match handed {
                Ok(ack) => {
                    if trim != Trim::None {
                        debug!(sink = %sink.name(), key, step = trim.as_str(), size = message.wire_size(),
                               "Message trimmed to fit the sink's size limit");
                    }
                    self.metrics.bytes_in_flight.add(bytes.num_permits() as i64);
                    return Submitted::Pending(Pending {
                        ack,
                        payload: message.payload.clone(),
                        message: Sent::of(message, (trim, forced), started),
                        bytes,
                    });
                }
                Err(err) => err,
            };
            self.metrics.in_flight.dec();
            // The sink's own check can be stricter than the estimate (record framing, the
            // sink's headers): a message it refuses at once as too large is trimmed further.
            if matches!(err, crate::sinks::Error::TooLarge { .. }) {
                match self.next_trim(n, trim) {
                    Some(next) => {
                        trim = next;
                        held = Some(bytes);
                        continue;
                    }
                    None => {
                        drop(bytes);
                        self.too_large(key, n, &message, message.wire_size()).await;
                        return Submitted::Settled;
                    }
                }
            }
            // Nothing of it is in flight while its failure is handled (a dead letter, say).
            drop(bytes);
            let sent = Sent::of(message, (trim, forced), started);
            return match self.acknowledged(key, n, &sent, Err(err)).await {
                Outcome::Settled => Submitted::Settled,
                Outcome::Retry => Submitted::Retry,
            };
        }
    }

    /// Accounts for the sink's answer about one message.
    async fn acknowledged(
        &self,
        key: &str,
        n: &Notification,
        sent: &Sent,
        result: crate::sinks::Result<()>,
    ) -> Outcome {
        let sink = &self.delivery.sink;
        match result {
            Ok(()) => {
                // One clock read for both.
                let now = std::time::Instant::now();
                self.metrics
                    .publish_duration
                    .observe((now - sent.started).as_secs_f64());
                self.metrics
                    .end_to_end
                    .observe(now.saturating_duration_since(sent.received).as_secs_f64());
                self.metrics.published[sent.event_type as usize].inc();
                // After a delete the key's next message is an add: no patch to start.
                self.set_unpatched(
                    key,
                    sent.trim == Trim::Reference && sent.event_type != EventType::Deleted,
                );
                if let Some(step) = Degradation::of(sent.trim).filter(|_| sent.trim > sent.forced) {
                    // Counted once accepted: a trimmed message the destination refused again
                    // is counted at the step that made it fit.
                    self.metrics.degraded[step as usize].inc();
                }
                self.metrics.bytes.inc_by(sent.bytes as u64);
                if self.failing.load(std::sync::atomic::Ordering::Relaxed)
                    && self
                        .failing
                        .swap(false, std::sync::atomic::Ordering::SeqCst)
                {
                    self.recovered();
                }
                Outcome::Settled
            }
            // The destination's own limit is stricter than the one the sink knows (a Kafka
            // topic's max.message.bytes): retry with the next trim step.
            Err(err @ crate::sinks::Error::TooLarge { .. })
                if self.next_trim(n, sent.trim).is_some() =>
            {
                let next = self.next_trim(n, sent.trim).expect("checked");
                warn!(error = %err, sink = %sink.name(), key, id = %sent.id, step = next.as_str(),
                      "The destination refused the message as too large; sending it again trimmed");
                let mut marks = self.lock_marks();
                marks.trim.insert(key.to_owned(), (sent.id.clone(), next));
                // Set under the lock, as `trim_hint` clears it under the lock.
                self.has_marks
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                drop(marks);
                Outcome::Retry
            }
            Err(err) if err.is_retriable() => {
                if matches!(err, crate::sinks::Error::Aborted(_)) {
                    // Not this message's failure: its retry counts nothing and waits no backoff.
                    self.queue.queue().forget(&Key::from(key));
                }
                if sent.trim > sent.forced {
                    // It goes again as trimmed as it was (an aborted transaction fails a
                    // message that fitted): not refused as too large a second time.
                    let mut marks = self.lock_marks();
                    marks
                        .trim
                        .insert(key.to_owned(), (sent.id.clone(), sent.trim));
                    self.has_marks
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                }
                self.failed(err.reason());
                self.failing
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                let attempt = self.queue.queue().num_requeues(&Key::from(key));
                let mut log = self.failure_log.lock().unwrap_or_else(|e| e.into_inner());
                log.1 += 1;
                if log.0.is_none_or(|at| at.elapsed() >= FAILURE_LOG_EVERY) {
                    warn!(error = %err, sink = %sink.name(), resource = %self.resource, key, attempt,
                          failures = log.1, "Publish failed; retrying with backoff (failures: of this route since the last such line)");
                    *log = (Some(std::time::Instant::now()), 0);
                } else {
                    debug!(error = %err, sink = %sink.name(), key, attempt, "Publish failed");
                }
                Outcome::Retry
            }
            Err(err) => {
                self.failed(err.reason());
                if matches!(err, crate::sinks::Error::TooLarge { .. }) {
                    self.metrics.degraded[Degradation::DeadLetter as usize].inc();
                }
                error!(error = %err, sink = %sink.name(), key, id = %sent.id, "Publish failed for good");
                self.dead_letter(key, n, Some((&sent.id, sent.bytes)), err.reason())
                    .await;
                Outcome::Settled
            }
        }
    }

    /// The sink accepted a message after retriable failures: it works again. Retries waiting
    /// out their backoff go now instead of one by one through the retry bucket (after an
    /// outage that failed every object in flight, the bucket alone would space them over
    /// minutes: 20,000 objects at the default 10/s take over half an hour).
    fn recovered(&self) {
        let brought = self.queue.queue().recovered();
        let failures =
            std::mem::take(&mut self.failure_log.lock().unwrap_or_else(|e| e.into_inner()).1);
        info!(sink = %self.delivery.sink.name(), resource = %self.resource, retries_brought_forward = brought,
              failures_since_last_warning = failures, "Sink accepts messages again");
    }

    /// Publishes a small reference record for a notification that failed for good.
    async fn dead_letter(
        &self,
        key: &str,
        n: &Notification,
        message: Option<(&str, usize)>,
        reason: FailureReason,
    ) {
        // Consumers miss this state: the key's next patch would start from one they lack
        // (after a delete its next message is an add, which starts none).
        self.set_unpatched(key, !matches!(n.kind(), NotificationKind::Delete { .. }));
        let Some(dlq) = &self.delivery.dead_letter else {
            return;
        };
        let meta = &**n.object();
        let id = message.map_or_else(|| message_id(n), |(id, _)| id.to_owned());
        let record = json!({
            "id": id,
            "key": key,
            "resource": self.resource,
            "sink": self.delivery.sink.name(),
            "type": n.event_type().as_str(),
            "reason": reason.as_str(),
            "size": message.map(|(_, size)| size),
        });
        let dead = Message {
            id,
            key: key.to_owned(),
            event_type: n.event_type(),
            payload: record.to_string().into(),
            attributes: Vec::new(),
            content_type: crate::message::DATA_CONTENT_TYPE,
            resource: self.encoder().resource().clone(),
            namespace: meta.namespace().map(str::to_owned),
            name: meta.name().unwrap_or_default().to_owned(),
            received: n.received,
        };
        if let Err(err) = dlq.publish(&dead).await {
            error!(error = %err, sink = %dlq.name(), key, "Dead-letter publish failed; the record is lost");
        }
    }
}

/// The id the message of `n` has (see [`crate::message::message_id`]).
fn message_id(n: &Notification) -> String {
    let meta = &**n.object();
    crate::message::message_id(
        meta.uid().unwrap_or_default(),
        meta.resource_version().unwrap_or_default(),
        n.event_type(),
    )
}
