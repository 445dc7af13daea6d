//! The ordered, bounded front of one route (one resource to one sink): a work queue of object
//! keys, each key owning its pending notifications in informer order.
//!
//! # Contract
//! - `on_notification` never blocks (the informer calls it).
//! - Every notification is kept, in order per object, while the sink's cap allows. The cap
//!   ([`Budget`]) counts every notification not yet settled (pending or being published) over
//!   all routes of a sink. At the cap, an update is merged into the newest pending notification
//!   of the same object (oldest `old`, newest `new`), counted as coalesced. Deletes, and the
//!   newest state of an object with nothing pending, are always kept: beyond the cap the queue
//!   holds at most a few notifications per object.
//! - A worker takes a key and all its pending notifications at once ([`RouteQueue::take`]);
//!   the work queue guarantees no other worker holds the same key meanwhile. The key stays
//!   *parked* (new notifications are kept but do not queue it) until the worker either
//!   [`finish`](RouteQueue::finish)es, which queues the key again if more arrived, or
//!   [`retry`](RouteQueue::retry)s, which puts what it could not deliver in front of anything
//!   that arrived since and queues the key after the rate limiter's delay. So a retry is never
//!   brought forward by new notifications (client-go's queue would requeue a key added while
//!   processing at once, bypassing the backoff).

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use prometheus::{IntCounter, IntGauge};

use crate::{
    informer::{Notification, NotificationHandler, NotificationKind, resource_version},
    workqueue::{QueueMetrics, RateLimiter, RateLimitingQueue},
};

/// How many notifications wait for one sink (all its routes), against a cap.
#[derive(Debug)]
pub struct Budget {
    held: AtomicUsize,
    cap: usize,
}

impl Budget {
    /// A budget of `cap` notifications.
    pub fn new(cap: usize) -> Self {
        Self {
            held: AtomicUsize::new(0),
            cap: cap.max(1),
        }
    }

    /// Notifications held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    fn full(&self) -> bool {
        self.held() >= self.cap
    }
}

/// See the module docs for the contract.
pub struct RouteQueue {
    name: String,
    // False on a standby: notifications are dropped on arrival and before publishing.
    active: std::sync::atomic::AtomicBool,
    queue: RateLimitingQueue<String>,
    state: Mutex<Pending>,
    budget: Arc<Budget>,
    held: AtomicUsize,
    buffered: IntGauge,
    coalesced: IntCounter,
}

#[derive(Default)]
struct Pending {
    by_key: HashMap<String, VecDeque<Notification>>,
    // Keys held by a worker or waiting for a retry delay: new notifications do not queue them.
    parked: HashSet<String>,
}

impl std::fmt::Debug for RouteQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteQueue")
            .field("name", &self.name)
            .field("held", &self.held())
            .finish()
    }
}

impl RouteQueue {
    /// A route queue called `name` (`resource/sink`, the work queue's metric label), sharing
    /// `budget` with the other routes of its sink.
    pub fn new(
        name: String,
        limiter: Box<dyn RateLimiter<String>>,
        queue_metrics: QueueMetrics,
        budget: Arc<Budget>,
        buffered: IntGauge,
        coalesced: IntCounter,
    ) -> Self {
        Self {
            name,
            active: std::sync::atomic::AtomicBool::new(true),
            queue: RateLimitingQueue::new(limiter, queue_metrics),
            state: Mutex::new(Pending::default()),
            budget,
            held: AtomicUsize::new(0),
            buffered,
            coalesced,
        }
    }

    /// The route's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The work queue of keys.
    pub fn queue(&self) -> &RateLimitingQueue<String> {
        &self.queue
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notifications of this route not yet settled (pending or being published).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Whether this route publishes (this replica leads, or leader election is off).
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Turns publishing on or off. Off drops everything pending: a standby holds nothing, and
    /// the next leader replays its cache.
    pub fn set_active(&self, active: bool) {
        self.active.store(active, Ordering::Relaxed);
        if !active {
            let dropped: usize = {
                let mut p = self.lock();
                let n = p.by_key.values().map(VecDeque::len).sum();
                p.by_key.clear();
                n
            };
            if dropped > 0 {
                self.settle(dropped);
            }
        }
    }

    /// Accepts one notification (see the module docs).
    pub fn push(&self, n: Notification) {
        if !self.is_active() {
            return;
        }
        let key = n.key();
        let mut p = self.lock();
        let pending = p.by_key.entry(key.clone()).or_default();
        if self.budget.full()
            && let Some(last) = pending.back_mut()
            && coalesce(last, &n)
        {
            self.coalesced.inc();
            return;
        }
        pending.push_back(n);
        self.budget.held.fetch_add(1, Ordering::Relaxed);
        let held = self.held.fetch_add(1, Ordering::Relaxed) + 1;
        self.buffered.set(held as i64);
        let parked = p.parked.contains(&key);
        drop(p);
        if !parked {
            self.queue.add(key);
        }
    }

    /// Takes every pending notification of `key`, oldest first, and parks the key. The caller
    /// holds `key` from the work queue and must end with `finish` or `retry`.
    pub fn take(&self, key: &str) -> VecDeque<Notification> {
        let mut p = self.lock();
        p.parked.insert(key.to_owned());
        p.by_key.remove(key).unwrap_or_default()
    }

    /// Ends a successful turn of `key`: unparks it and queues it again if notifications
    /// arrived meanwhile. While the queue shuts down, `add` is ignored, so instead the
    /// notifications that arrived are returned for the caller to deliver in the same turn
    /// (the key stays parked); otherwise `None`.
    pub fn finish(&self, key: &str) -> Option<VecDeque<Notification>> {
        let mut p = self.lock();
        if !p.by_key.contains_key(key) {
            p.parked.remove(key);
            return None;
        }
        if self.queue.is_shutting_down() {
            return p.by_key.remove(key);
        }
        p.parked.remove(key);
        drop(p);
        self.queue.add(key.to_owned());
        None
    }

    /// Puts back what could not be delivered, in front of what arrived meanwhile, and
    /// schedules `key` after the rate limiter's delay.
    pub fn retry(&self, key: &str, undelivered: VecDeque<Notification>) {
        let mut p = self.lock();
        let pending = p.by_key.entry(key.to_owned()).or_default();
        let newer = std::mem::replace(pending, undelivered);
        pending.extend(newer);
        if pending.is_empty() {
            p.by_key.remove(key);
            p.parked.remove(key);
            return;
        }
        drop(p);
        self.queue.add_rate_limited(key.to_owned());
    }

    /// Marks `n` notifications as delivered or failed for good.
    pub fn settle(&self, n: usize) {
        self.budget.held.fetch_sub(n, Ordering::Relaxed);
        let held = self.held.fetch_sub(n, Ordering::Relaxed) - n;
        self.buffered.set(held as i64);
    }
}

impl NotificationHandler for RouteQueue {
    fn on_notification(&self, n: Notification) {
        self.push(n);
    }
}

/// Merges `incoming` into `pending` (both about the same object) when that loses no state
/// the consumer needs: an add or update followed by an update or resync. Returns false when
/// `incoming` must be kept on its own (deletes, adds after deletes).
fn coalesce(pending: &mut Notification, incoming: &Notification) -> bool {
    use NotificationKind::*;
    let merged = match (&pending.kind, &incoming.kind) {
        (
            Add {
                is_initial_list, ..
            },
            Update { new, .. },
        ) => Add {
            obj: new.clone(),
            is_initial_list: *is_initial_list,
        },
        (
            Update {
                old,
                new: pending_new,
            },
            Update { new, .. },
        ) => {
            // A resync of the state already pending adds nothing.
            if resource_version(pending_new) == resource_version(new) {
                return true;
            }
            Update {
                old: old.clone(),
                new: new.clone(),
            }
        }
        _ => return false,
    };
    pending.kind = merged;
    pending.observed = incoming.observed;
    // `received` stays the oldest: end-to-end latency counts from the first change.
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        informer::{ObjectRef, testing::obj},
        workqueue::rate_limiter::ItemExponentialFailureRateLimiter,
    };
    use std::time::Duration;

    fn route(cap: usize) -> (RouteQueue, Arc<Budget>) {
        let budget = Arc::new(Budget::new(cap));
        let q = RouteQueue::new(
            "r/s".into(),
            Box::new(ItemExponentialFailureRateLimiter::new(
                Duration::from_secs(1),
                Duration::from_secs(10),
            )),
            QueueMetrics::unregistered(),
            budget.clone(),
            IntGauge::new("b", "b").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        );
        (q, budget)
    }

    fn note(kind: NotificationKind) -> Notification {
        Notification {
            kind,
            received: std::time::Instant::now(),
            observed: jiff::Timestamp::now(),
        }
    }
    fn add(o: ObjectRef) -> Notification {
        note(NotificationKind::Add {
            obj: o,
            is_initial_list: false,
        })
    }
    fn update(old: ObjectRef, new: ObjectRef) -> Notification {
        note(NotificationKind::Update { old, new })
    }
    fn delete(o: ObjectRef) -> Notification {
        note(NotificationKind::Delete {
            obj: o,
            final_state_unknown: false,
        })
    }
    fn describe(n: &Notification) -> String {
        match &n.kind {
            NotificationKind::Add { obj, .. } => format!("add {}", resource_version(obj)),
            NotificationKind::Update { old, new } => format!(
                "update {}->{}",
                resource_version(old),
                resource_version(new)
            ),
            NotificationKind::Delete { obj, .. } => format!("delete {}", resource_version(obj)),
        }
    }
    fn take(q: &RouteQueue) -> (String, Vec<String>) {
        let key = q.queue().try_get().expect("a key is queued");
        let batch = q.take(&key);
        q.settle(batch.len());
        assert!(q.finish(&key).is_none());
        q.queue().done(&key);
        (key, batch.iter().map(describe).collect())
    }

    #[test]
    fn below_the_cap_every_notification_is_kept_in_order_per_key() {
        let (q, budget) = route(100);
        q.push(add(obj("ns", "a", "1")));
        q.push(add(obj("ns", "b", "2")));
        q.push(update(obj("ns", "a", "1"), obj("ns", "a", "3")));
        q.push(delete(obj("ns", "a", "4")));
        assert_eq!(budget.held(), 4);
        assert_eq!(
            take(&q),
            (
                "ns/a".into(),
                vec!["add 1".into(), "update 1->3".into(), "delete 4".into()]
            )
        );
        assert_eq!(take(&q), ("ns/b".into(), vec!["add 2".into()]));
        assert_eq!(budget.held(), 0);
        assert_eq!(q.held(), 0);
    }

    #[test]
    fn at_the_cap_updates_coalesce_but_deletes_and_new_objects_are_kept() {
        let (q, budget) = route(2);
        q.push(add(obj("ns", "a", "1")));
        q.push(update(obj("ns", "b", "1"), obj("ns", "b", "2")));
        q.push(update(obj("ns", "a", "1"), obj("ns", "a", "3")));
        q.push(update(obj("ns", "b", "2"), obj("ns", "b", "4")));
        q.push(update(obj("ns", "b", "4"), obj("ns", "b", "4"))); // resync of a pending state
        assert_eq!(budget.held(), 2);
        assert_eq!(q.coalesced.get(), 3);
        q.push(delete(obj("ns", "a", "5")));
        q.push(add(obj("ns", "c", "6")));
        q.push(update(obj("ns", "a", "5"), obj("ns", "a", "7"))); // cannot merge into a delete
        assert_eq!(
            budget.held(),
            5,
            "over the cap by what must never be dropped"
        );
        assert_eq!(take(&q).1, ["add 3", "delete 5", "update 5->7"]);
        assert_eq!(take(&q).1, ["update 1->4"]);
        assert_eq!(take(&q).1, ["add 6"]);
    }

    #[test]
    fn the_cap_is_shared_by_the_routes_of_a_sink() {
        let (q1, budget) = route(2);
        let q2 = RouteQueue::new(
            "r2/s".into(),
            Box::new(ItemExponentialFailureRateLimiter::new(
                Duration::from_secs(1),
                Duration::from_secs(10),
            )),
            QueueMetrics::unregistered(),
            budget.clone(),
            IntGauge::new("b", "b").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        );
        q1.push(add(obj("ns", "a", "1")));
        q2.push(add(obj("ns", "x", "1")));
        q1.push(update(obj("ns", "a", "1"), obj("ns", "a", "2")));
        assert_eq!(
            q1.coalesced.get(),
            1,
            "q1 coalesces because q2 filled the sink's budget"
        );
    }

    #[test]
    fn a_notification_during_a_publish_is_delivered_after_it() {
        let (q, _) = route(100);
        q.push(add(obj("ns", "a", "1")));
        let key = q.queue().try_get().unwrap();
        let batch = q.take(&key);
        q.push(update(obj("ns", "a", "1"), obj("ns", "a", "2")));
        assert_eq!(q.queue().try_get(), None, "never two workers on one key");
        q.settle(batch.len());
        assert!(q.finish(&key).is_none());
        q.queue().done(&key);
        assert_eq!(take(&q).1, ["update 1->2"]);
    }

    #[test]
    fn during_shutdown_a_finished_key_hands_back_what_arrived() {
        let (q, _) = route(100);
        q.push(add(obj("ns", "a", "1")));
        let key = q.queue().try_get().unwrap();
        let batch = q.take(&key);
        q.push(update(obj("ns", "a", "1"), obj("ns", "a", "2")));
        q.queue().shut_down();
        q.settle(batch.len());
        let more = q
            .finish(&key)
            .expect("the newer notification comes back to the worker");
        assert_eq!(
            more.iter().map(describe).collect::<Vec<_>>(),
            ["update 1->2"]
        );
        assert!(q.finish(&key).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_retried_key_keeps_its_order_and_waits_for_its_delay() {
        let (q, _) = route(100);
        q.push(add(obj("ns", "a", "1")));
        q.push(update(obj("ns", "a", "1"), obj("ns", "a", "2")));
        let key = q.queue().try_get().unwrap();
        let mut batch = q.take(&key);
        batch.pop_front(); // "add 1" delivered
        q.settle(1);
        q.push(update(obj("ns", "a", "2"), obj("ns", "a", "3"))); // arrives during the publish
        q.retry(&key, batch);
        q.queue().done(&key);
        assert_eq!(
            q.queue().try_get(),
            None,
            "the new notification does not bypass the backoff"
        );
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(q.queue().try_get(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(take(&q).1, ["update 1->2", "update 2->3"]);
    }
}
