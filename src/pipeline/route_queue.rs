//! The ordered, bounded front of one route (one resource to one sink): a work queue of object
//! keys, each key owning its pending notifications in informer order.
//!
//! # Contract
//! - `on_notification` never blocks (the informer calls it).
//! - Every notification is kept, in order per object, while the sink's cap allows. The cap
//!   ([`Budget`]) counts every notification not yet settled (pending or being published) over
//!   all routes of a sink.
//! - At the cap, a notification for an object that already has one pending is merged into it
//!   (counted as coalesced) instead of adding a second copy: an add or update into a pending
//!   add or update keeps the newest state (and the oldest `old`); a resync, or a repeated add,
//!   of the state already pending is dropped; a delete replaces a pending add or update (it
//!   carries the last state, and its own marks: `k8sfilteredout`, `k8sresumed`); a delete
//!   after a pending delete of the same uid is dropped (client-go's DeltaFIFO collapses them
//!   the same way), unless only the pending one guessed its final state or was a filter's
//!   (`k8sfilteredout`): the object's real delete then replaces it. An object that left a
//!   filter and came back (a delete and an add of one uid pending) and leaves again collapses
//!   into the first delete. Only an object with nothing pending, or one added again after a
//!   pending delete (recreated, or back in a filter), gets a new entry. So beyond the cap the
//!   sink holds at most `cap + D`, where D counts the *incarnations* with something pending or
//!   being published: per key, one per uid with a pending delete plus one if the last
//!   pending notification is not a delete, counted separately for what waits and what a
//!   worker holds. Deletes of every incarnation and the newest state of every object are
//!   never dropped.
//! - A worker takes a key and all its pending notifications at once ([`RouteQueue::take`]);
//!   the work queue guarantees no other worker holds the same key meanwhile. The key stays
//!   *parked* (new notifications are kept but do not queue it) until the worker either
//!   [`finish`](RouteQueue::finish)es, which queues the key again if more arrived, or
//!   [`retry`](RouteQueue::retry)s, which puts what it could not deliver in front of anything
//!   that arrived since and queues the key after the rate limiter's delay. So a retry is never
//!   brought forward by new notifications (client-go's queue would requeue a key added while
//!   processing at once, bypassing the backoff). At the cap, the seam between the two is
//!   coalesced as above, which keeps the bound.
//! - The route's `events` apply here, after the stages in front (resume, filter), which see
//!   every notification: a type the route does not publish is dropped on arrival, except a
//!   delete, which is kept as a *silent* one: the worker publishes nothing for it, but settles
//!   it in order, so that the checkpoint forgets the key (deletes always settle state).
//! - A route is active (this replica leads, or leader election is off) or not. Each switch
//!   starts a new *term* and drops everything pending; a worker that took notifications in an
//!   earlier term drops them instead of publishing or retrying them, since the new leader
//!   term starts from the informer's cache.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use prometheus::{IntCounter, IntGauge};

use crate::{
    informer::{
        EventType, Notification, NotificationHandler, NotificationKind, ObjectRef, resource_version,
    },
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

pub use crate::informer::Key;

/// See the module docs for the contract.
pub struct RouteQueue {
    name: String,
    // False on a standby: notifications are dropped on arrival and before publishing.
    active: std::sync::atomic::AtomicBool,
    // Incremented by every `set_active`; see the module docs.
    term: std::sync::atomic::AtomicU64,
    // Told of every `set_active` (see `term_ended`).
    terms: tokio::sync::watch::Sender<()>,
    queue: RateLimitingQueue<Key>,
    state: Mutex<Pending>,
    budget: Arc<Budget>,
    held: AtomicUsize,
    buffered: IntGauge,
    coalesced: IntCounter,
    // By event type: whether the route publishes it.
    publishes: [bool; 4],
    // With leader election: the lease's local validity, checked before each hand-over.
    fence: Option<crate::leader::Fence>,
}

#[derive(Default)]
struct Pending {
    by_key: HashMap<Key, VecDeque<Notification>, foldhash::fast::RandomState>,
    // Keys held by a worker or waiting for a retry delay: new notifications do not queue them.
    parked: HashSet<Key, foldhash::fast::RandomState>,
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
        limiter: Box<dyn RateLimiter<Key>>,
        queue_metrics: QueueMetrics,
        budget: Arc<Budget>,
        buffered: IntGauge,
        coalesced: IntCounter,
    ) -> Self {
        Self {
            name,
            active: std::sync::atomic::AtomicBool::new(true),
            term: std::sync::atomic::AtomicU64::new(0),
            terms: tokio::sync::watch::Sender::new(()),
            queue: RateLimitingQueue::new(limiter, queue_metrics),
            state: Mutex::new(Pending::default()),
            budget,
            held: AtomicUsize::new(0),
            buffered,
            coalesced,
            publishes: [true; 4],
            fence: None,
        }
    }

    /// Publishes only notifications of these types (by default every type); see the module
    /// docs for deletes.
    pub fn with_events(mut self, events: &[EventType]) -> Self {
        self.publishes = [false; 4];
        for t in events {
            self.publishes[*t as usize] = true;
        }
        self
    }

    /// Whether the route publishes notifications of type `ty` (a delete it does not publish
    /// is settled silently).
    pub fn publishes(&self, ty: EventType) -> bool {
        self.publishes[ty as usize]
    }

    /// The route's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The work queue of keys.
    pub fn queue(&self) -> &RateLimitingQueue<Key> {
        &self.queue
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The budget this route shares with its sink's other routes.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// Notifications of this route not yet settled (pending or being published).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Whether this route publishes (this replica leads, or leader election is off).
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Checks `fence` before each hand-over from now on (see [`Self::may_hand_over`]).
    pub fn with_fence(mut self, fence: Option<crate::leader::Fence>) -> Self {
        self.fence = fence;
        self
    }

    /// Whether a message may be handed over now: without leader election always; with it,
    /// while the lease renewed last is valid by this replica's clock. A lapse holds messages
    /// back (the elector then either renews or ends the term, which drops them).
    pub fn may_hand_over(&self) -> bool {
        self.fence
            .as_ref()
            .is_none_or(crate::leader::Fence::is_valid)
    }

    /// Whether this route publishes and `term` is still the current one.
    pub fn is_current(&self, term: u64) -> bool {
        self.is_active() && self.term() == term
    }

    /// Returns once `term` is not the current one any more (at once if it is not).
    pub async fn term_ended(&self, term: u64) {
        let mut changes = self.terms.subscribe();
        let _ = changes.wait_for(|()| !self.is_current(term)).await;
    }

    /// The current term (see the module docs).
    pub fn term(&self) -> u64 {
        self.term.load(Ordering::SeqCst)
    }

    /// Turns publishing on or off and starts a new term, dropping everything pending: a
    /// standby holds nothing, and a new leader starts from the informer's cache.
    pub fn set_active(&self, active: bool) {
        let dropped: usize = {
            let mut p = self.lock();
            self.active.store(active, Ordering::SeqCst);
            self.term.fetch_add(1, Ordering::SeqCst);
            let n = p.by_key.values().map(VecDeque::len).sum();
            p.by_key.clear();
            n
        };
        self.terms.send_replace(());
        if dropped > 0 {
            self.settle(dropped);
        }
    }

    /// Accepts one notification (see the module docs).
    pub fn push(&self, n: Notification) {
        self.push_in(n, None);
    }

    /// Accepts one notification if `term` (when given) is still the current one: a stage in
    /// front that evaluated it in an ended term drops it (the new term replays the cache).
    pub fn push_in(&self, n: Notification, term: Option<u64>) {
        let ty = n.event_type();
        if !self.publishes(ty) && ty != EventType::Deleted {
            return;
        }
        let key = n.key().clone();
        let mut p = self.lock();
        // Checked under the lock: `set_active` switches, counts the term and clears under it
        // too.
        if !self.is_active() || term.is_some_and(|t| t != self.term()) {
            return;
        }
        let pending = p.by_key.entry(key.clone()).or_default();
        if self.budget.full() {
            let released = coalesce_into(pending, &n);
            if released > 0 {
                self.coalesced.inc();
                if released > 1 {
                    drop(p);
                    self.settle(released - 1);
                }
                return;
            }
        }
        // A key with notifications pending already is queued or parked already (`finish`
        // and `retry` queue what they leave pending): no second trip to the work queue.
        let first = pending.is_empty();
        pending.push_back(n);
        self.budget.held.fetch_add(1, Ordering::Relaxed);
        let held = self.held.fetch_add(1, Ordering::Relaxed) + 1;
        self.buffered.set(held as i64);
        let queue = first && !p.parked.contains(&key);
        drop(p);
        if queue {
            self.queue.add(key);
        }
    }

    /// Takes every pending notification of `key`, oldest first, and parks the key; also
    /// returns the term they belong to. The caller holds `key` from the work queue and must
    /// end with `finish` or `retry`.
    pub fn take(&self, key: &Key) -> (VecDeque<Notification>, u64) {
        let mut p = self.lock();
        p.parked.insert(key.clone());
        (p.by_key.remove(key).unwrap_or_default(), self.term())
    }

    /// Ends a successful turn of `key`: unparks it and queues it again if notifications
    /// arrived meanwhile. While the queue shuts down, `add` is ignored, so instead the
    /// notifications that arrived are returned for the caller to deliver in the same turn
    /// (the key stays parked); otherwise `None`.
    pub fn finish(&self, key: &Key) -> Option<VecDeque<Notification>> {
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
        self.queue.add(key.clone());
        None
    }

    /// Puts back what could not be delivered, in front of what arrived meanwhile, and
    /// schedules `key` after the rate limiter's delay. Notifications of an earlier `term`
    /// are dropped (settled) instead, since the route changed hands meanwhile, and what is
    /// pending is queued at once.
    pub fn retry(&self, key: &Key, mut undelivered: VecDeque<Notification>, term: u64) {
        let mut p = self.lock();
        let mut released = 0;
        let stale = term != self.term();
        if stale {
            released += undelivered.len();
            undelivered.clear();
        }
        let full = self.budget.full();
        let pending = p.by_key.entry(key.clone()).or_default();
        let mut newer = std::mem::replace(pending, undelivered);
        // At the cap the seam is coalesced like any arrival, so the bound holds.
        while full && let Some(next) = newer.front() {
            let merged = coalesce_into(pending, next);
            if merged == 0 {
                break;
            }
            newer.pop_front();
            released += merged;
            self.coalesced.inc();
        }
        pending.extend(newer);
        let empty = pending.is_empty();
        if empty {
            p.by_key.remove(key);
            p.parked.remove(key);
        }
        drop(p);
        if released > 0 {
            self.settle(released);
        }
        if stale && !empty {
            // Nothing of this term failed: what is pending goes on without a delay.
            self.queue.add(key.to_owned());
        } else if !empty {
            self.queue.add_rate_limited(key.to_owned());
        }
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

/// Merges `incoming` into `pending` (one key's pending notifications) when that loses nothing
/// a consumer needs (see [`coalesce`]), and collapses an object that left a filter, came back
/// and left again (`[delete u, add u] + delete u`) into its first delete. Returns how many
/// notifications were released: 0 (keep `incoming` on its own), 1, or 2.
fn coalesce_into(pending: &mut VecDeque<Notification>, incoming: &Notification) -> usize {
    let Some(last) = pending.back_mut() else {
        return 0;
    };
    if !coalesce(last, incoming) {
        return 0;
    }
    if pending.len() >= 2 && is_delete(&pending[pending.len() - 1]) {
        let last = pending.pop_back().expect("two pending");
        let before = pending.back_mut().expect("two pending");
        if is_delete(before) && coalesce(before, &last) {
            return 2;
        }
        pending.push_back(last);
    }
    1
}

fn is_delete(n: &Notification) -> bool {
    matches!(n.kind(), NotificationKind::Delete { .. })
}

/// Merges `incoming` into `pending` (the newest pending notification of the same key) when
/// that loses nothing a consumer needs: see the module docs for the rules. Returns false when
/// `incoming` must be kept on its own (anything after a pending delete but another delete).
fn coalesce(pending: &mut Notification, incoming: &Notification) -> bool {
    use NotificationKind::*;
    let merged = match (pending.kind(), incoming.kind()) {
        (
            Delete {
                obj: pending_obj,
                final_state_unknown: pending_unknown,
            },
            Delete {
                obj,
                final_state_unknown,
            },
        ) if pending_obj.uid() == obj.uid() => {
            // DeltaFIFO's dedup: keep the older delete unless it only guessed the final state;
            // and the object's real delete wins over a filter's.
            let guessed = *pending_unknown && !*final_state_unknown;
            let filters = pending.filtered_out && !incoming.filtered_out;
            if !guessed && !filters {
                return true;
            }
            pending.filtered_out = incoming.filtered_out;
            pending.resumed = incoming.resumed;
            pending.gone_at = incoming.gone_at.clone();
            Delete {
                obj: obj.clone(),
                final_state_unknown: *final_state_unknown,
            }
        }
        // After a delete comes a new incarnation of the key (also the delete of one whose add
        // was merged into that delete, or the object back in a filter): kept on its own.
        (Delete { .. }, _) => return false,
        // The delete carries the last state, and its own marks; nothing pending before it is
        // still needed.
        (Add { .. } | Update { .. }, Delete { .. }) => {
            pending.filtered_out = incoming.filtered_out;
            pending.resumed = incoming.resumed;
            pending.gone_at = incoming.gone_at.clone();
            incoming.kind().clone()
        }
        (
            Add {
                obj: pending_new,
                is_initial_list,
            },
            Add { obj: new, .. } | Update { new, .. },
        ) => {
            // A resync or a repeated add of the state already pending adds nothing.
            if same_state(pending_new, new) {
                return true;
            }
            Add {
                obj: new.clone(),
                is_initial_list: *is_initial_list,
            }
        }
        (
            Update {
                old,
                new: pending_new,
            },
            Add { obj: new, .. } | Update { new, .. },
        ) => {
            if same_state(pending_new, new) {
                return true;
            }
            Update {
                old: old.clone(),
                new: new.clone(),
            }
        }
    };
    pending.set_kind(merged);
    pending.observed = incoming.observed;
    // `received` stays the oldest: end-to-end latency counts from the first change.
    true
}

/// Same object (uid) at the same resourceVersion.
fn same_state(a: &ObjectRef, b: &ObjectRef) -> bool {
    resource_version(a) == resource_version(b) && a.uid() == b.uid()
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

    fn add(o: ObjectRef) -> Notification {
        Notification::new(NotificationKind::Add {
            obj: o,
            is_initial_list: false,
        })
    }
    fn update(old: ObjectRef, new: ObjectRef) -> Notification {
        Notification::new(NotificationKind::Update { old, new })
    }
    fn delete(o: ObjectRef) -> Notification {
        Notification::new(NotificationKind::Delete {
            obj: o,
            final_state_unknown: false,
        })
    }
    fn describe(n: &Notification) -> String {
        match n.kind() {
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
        let (batch, _) = q.take(&key);
        q.settle(batch.len());
        assert!(q.finish(&key).is_none());
        q.queue().done(&key);
        (key.to_string(), batch.iter().map(describe).collect())
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
    fn a_notification_evaluated_in_an_ended_term_is_not_taken() {
        let (q, budget) = route(100);
        let term = q.term();
        q.push_in(add(obj("ns", "a", "1")), Some(term));
        assert_eq!(budget.held(), 1);
        // Leadership lost and regained while a filter lane evaluated the next one.
        q.set_active(false);
        q.set_active(true);
        q.push_in(add(obj("ns", "b", "1")), Some(term));
        assert_eq!(
            budget.held(),
            0,
            "dropped with the ended term, and not taken in the new one"
        );
        q.push_in(add(obj("ns", "b", "2")), Some(q.term()));
        // (The ended term's key may still be queued, with nothing: a worker skips it.)
        let taken: Vec<_> = std::iter::from_fn(|| (!q.queue().is_empty()).then(|| take(&q)))
            .filter(|(_, batch)| !batch.is_empty())
            .collect();
        assert_eq!(taken, [("ns/b".into(), vec!["add 2".into()])]);
    }

    #[test]
    fn at_the_cap_each_object_keeps_one_entry_until_a_delete() {
        let (q, budget) = route(2);
        q.push(add(obj("ns", "a", "1")));
        q.push(update(obj("ns", "b", "1"), obj("ns", "b", "2")));
        q.push(update(obj("ns", "a", "1"), obj("ns", "a", "3")));
        q.push(update(obj("ns", "b", "2"), obj("ns", "b", "4")));
        q.push(update(obj("ns", "b", "4"), obj("ns", "b", "4"))); // resync of a pending state
        assert_eq!(budget.held(), 2);
        assert_eq!(q.coalesced.get(), 3);
        q.push(delete(obj("ns", "a", "5"))); // replaces the pending add: it has the last state
        q.push(add(obj("ns", "c", "6")));
        q.push(add(obj("ns", "a", "7"))); // recreated: cannot merge into a delete
        assert_eq!(q.coalesced.get(), 4);
        assert_eq!(
            budget.held(),
            4,
            "over the cap by one entry per object incarnation"
        );
        assert_eq!(take(&q).1, ["delete 5", "add 7"]);
        assert_eq!(take(&q).1, ["update 1->4"]);
        assert_eq!(take(&q).1, ["add 6"]);
    }

    #[test]
    fn at_the_cap_repeated_adds_and_resyncs_of_one_object_never_pile_up() {
        let (q, budget) = route(1);
        q.push(add(obj("ns", "x", "1"))); // fills the budget
        for _ in 0..25 {
            q.push(add(obj("ns", "a", "1"))); // a replay of the same state, again and again
            q.push(update(obj("ns", "a", "1"), obj("ns", "a", "1"))); // its resync
        }
        q.push(add(obj("ns", "a", "2"))); // a newer add of the same uid keeps the newer
        q.push(delete(obj("ns", "a", "3")));
        q.push(delete(obj("ns", "a", "3"))); // a repeated delete collapses
        assert_eq!(budget.held(), 2);
        assert_eq!(take(&q).1, ["add 1"]);
        assert_eq!(take(&q).1, ["delete 3"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_at_the_cap_coalesces_with_what_arrived_meanwhile() {
        let (q, budget) = route(1);
        q.push(add(obj("ns", "a", "1")));
        let key = q.queue().try_get().unwrap();
        let (batch, term) = q.take(&key);
        q.push(update(obj("ns", "a", "1"), obj("ns", "a", "2"))); // at the cap: a new entry
        assert_eq!(budget.held(), 2);
        q.retry(&key, batch, term); // the publish of "add 1" failed
        q.queue().done(&key);
        assert_eq!(budget.held(), 1, "the seam merged into one entry");
        tokio::time::advance(Duration::from_secs(1)).await; // the retry's backoff
        assert_eq!(take(&q).1, ["add 2"]);
    }

    #[test]
    fn a_new_term_drops_what_the_old_one_held_even_in_a_workers_hands() {
        let (q, budget) = route(100);
        q.push(add(obj("ns", "a", "1")));
        q.push(add(obj("ns", "b", "1")));
        let key = q.queue().try_get().unwrap();
        let (batch, term) = q.take(&key);
        q.set_active(false);
        q.set_active(true);
        assert_eq!(budget.held(), 1, "the pending one is dropped at once");
        q.push(add(obj("ns", "a", "2"))); // the new term's replay
        q.retry(&key, batch, term); // the old term's failed publish comes back
        assert_eq!(budget.held(), 1);
        q.queue().done(&key);
        // "ns/b" is still queued, with nothing left to publish.
        assert_eq!(take(&q), ("ns/b".into(), vec![]));
        assert_eq!(take(&q), ("ns/a".into(), vec!["add 2".into()]));
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
        let (batch, _) = q.take(&key);
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
        let (batch, _) = q.take(&key);
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
        let (mut batch, term) = q.take(&key);
        batch.pop_front(); // "add 1" delivered
        q.settle(1);
        q.push(update(obj("ns", "a", "2"), obj("ns", "a", "3"))); // arrives during the publish
        q.retry(&key, batch, term);
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

    /// Random sequences from a model cluster (creates, updates, deletes, resyncs, replays,
    /// leadership changes, objects leaving and re-entering a filter) interleaved with a
    /// worker's takes, deliveries and failed publishes, with the sink's budget full: the held
    /// count never exceeds the bound of the module docs, and what is finally delivered has
    /// every delete (with its own marks) and the newest state of every object.
    mod bound {
        use super::*;
        use proptest::prelude::*;
        use std::collections::BTreeMap;

        #[derive(Debug, Clone)]
        enum Op {
            Create(u8),
            Update(u8),
            Delete(u8),
            Sync(u8),
            Leave(u8),
            Enter(u8),
            Replay,
            Flip,
            Take,
            Deliver(u8),
            Fail,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                3 => (0..4u8).prop_map(Op::Create),
                5 => (0..4u8).prop_map(Op::Update),
                2 => (0..4u8).prop_map(Op::Delete),
                2 => (0..4u8).prop_map(Op::Sync),
                2 => (0..4u8).prop_map(Op::Leave),
                2 => (0..4u8).prop_map(Op::Enter),
                1 => Just(Op::Replay),
                1 => Just(Op::Flip),
                3 => Just(Op::Take),
                3 => (1..4u8).prop_map(Op::Deliver),
                1 => Just(Op::Fail),
            ]
        }

        fn object(key: u8, uid: u64, rv: u64) -> ObjectRef {
            let mut o = obj("ns", &format!("k{key}"), &rv.to_string())
                .to_dynamic()
                .unwrap();
            o.metadata.uid = Some(format!("u{uid}"));
            Arc::new(crate::informer::CachedObject::new(&o))
        }

        /// Incarnations in one key's notifications: one per uid with a delete, plus one if
        /// the last is not a delete.
        fn incarnations<'a>(ns: impl IntoIterator<Item = &'a Notification>) -> usize {
            let (mut deleted, mut last_delete) = (std::collections::HashSet::new(), true);
            for n in ns {
                last_delete = matches!(n.kind(), NotificationKind::Delete { .. });
                if last_delete {
                    deleted.insert(n.object().uid().map(str::to_owned));
                }
            }
            deleted.len() + (!last_delete) as usize
        }

        /// (type, uid, rv, k8sfilteredout) of a notification.
        fn fact(n: &Notification) -> (char, String, u64, bool) {
            let o = n.object();
            let t = match n.event_type() {
                crate::informer::EventType::Added => 'A',
                crate::informer::EventType::Updated => 'U',
                crate::informer::EventType::Deleted => 'D',
                crate::informer::EventType::Synced => 'S',
            };
            (
                t,
                o.uid().unwrap().to_owned(),
                resource_version(o).parse().unwrap(),
                n.filtered_out,
            )
        }

        struct Hand {
            key: Key,
            batch: VecDeque<Notification>,
            term: u64,
        }

        fn run(cap: usize, filler: bool, ops: Vec<Op>) -> Result<(), TestCaseError> {
            let budget = Arc::new(Budget::new(cap));
            let queue = |name: &str| {
                RouteQueue::new(
                    name.into(),
                    Box::new(ItemExponentialFailureRateLimiter::new(
                        Duration::ZERO,
                        Duration::ZERO,
                    )),
                    QueueMetrics::unregistered(),
                    budget.clone(),
                    IntGauge::new("b", "b").unwrap(),
                    IntCounter::new("c", "c").unwrap(),
                )
            };
            let q = queue("r/s");
            // Another route of the sink holding the whole budget, never delivered.
            let other = queue("other/s");
            if filler {
                for rv in 0..cap as u64 {
                    other.push(update(object(9, 0, rv), object(9, 0, rv + 1)));
                }
                prop_assert!(budget.full());
            }
            let (mut rv, mut uid) = (0u64, 0u64);
            let mut cluster: BTreeMap<u8, (u64, u64)> = BTreeMap::new(); // key -> (uid, rv)
            // Keys of objects outside the filter: their changes never reach the queue.
            let mut out = std::collections::BTreeSet::new();
            let mut must_delete: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
            let mut delivered: BTreeMap<String, Vec<(char, String, u64, bool)>> = BTreeMap::new();
            let mut hands: Vec<Hand> = Vec::new();

            let deliver =
                |hand: &mut Hand,
                 n: usize,
                 delivered: &mut BTreeMap<String, Vec<(char, String, u64, bool)>>| {
                    for _ in 0..n {
                        // As the worker does: a batch of an earlier term is dropped.
                        if hand.term != q.term() {
                            q.settle(hand.batch.len());
                            hand.batch.clear();
                        }
                        let Some(note) = hand.batch.pop_front() else {
                            break;
                        };
                        delivered
                            .entry(hand.key.to_string())
                            .or_default()
                            .push(fact(&note));
                        q.settle(1);
                    }
                };

            for op in ops {
                match op {
                    Op::Create(k) if !cluster.contains_key(&k) => {
                        (rv, uid) = (rv + 1, uid + 1);
                        cluster.insert(k, (uid, rv));
                        q.push(add(object(k, uid, rv)));
                    }
                    Op::Update(k) if cluster.contains_key(&k) => {
                        let (u, old) = cluster[&k];
                        rv += 1;
                        cluster.insert(k, (u, rv));
                        if !out.contains(&k) {
                            q.push(update(object(k, u, old), object(k, u, rv)));
                        }
                    }
                    Op::Delete(k) if cluster.contains_key(&k) => {
                        let (u, _) = cluster.remove(&k).unwrap();
                        rv += 1;
                        if !out.remove(&k) {
                            q.push(delete(object(k, u, rv)));
                            must_delete
                                .entry(format!("ns/k{k}"))
                                .or_default()
                                .push((format!("u{u}"), rv));
                        }
                    }
                    Op::Leave(k) if cluster.contains_key(&k) && !out.contains(&k) => {
                        // The filter's k8sfilteredout delete.
                        let (u, _) = cluster[&k];
                        rv += 1;
                        cluster.insert(k, (u, rv));
                        out.insert(k);
                        let mut n = delete(object(k, u, rv));
                        n.filtered_out = true;
                        q.push(n);
                    }
                    Op::Enter(k) if out.contains(&k) => {
                        let (u, _) = cluster[&k];
                        rv += 1;
                        cluster.insert(k, (u, rv));
                        out.remove(&k);
                        q.push(add(object(k, u, rv)));
                    }
                    Op::Sync(k) if cluster.contains_key(&k) && !out.contains(&k) => {
                        let (u, r) = cluster[&k];
                        q.push(update(object(k, u, r), object(k, u, r)));
                    }
                    Op::Replay => {
                        for (k, (u, r)) in cluster.iter().filter(|(k, _)| !out.contains(k)) {
                            q.push(Notification::new(NotificationKind::Add {
                                obj: object(*k, *u, *r),
                                is_initial_list: true,
                            }));
                        }
                    }
                    Op::Flip => {
                        // Lost and regained leadership: a new term replays the cache.
                        q.set_active(false);
                        q.set_active(true);
                        must_delete.clear();
                        delivered.clear();
                        for (k, (u, r)) in cluster.iter().filter(|(k, _)| !out.contains(k)) {
                            q.push(Notification::new(NotificationKind::Add {
                                obj: object(*k, *u, *r),
                                is_initial_list: true,
                            }));
                        }
                    }
                    Op::Take => {
                        if let Some(key) = q.queue().try_get() {
                            let (batch, term) = q.take(&key);
                            hands.push(Hand { key, batch, term });
                        }
                    }
                    Op::Deliver(n) => {
                        if let Some(mut hand) = hands.pop() {
                            deliver(&mut hand, n as usize, &mut delivered);
                            if hand.batch.is_empty() {
                                prop_assert!(q.finish(&hand.key).is_none());
                                q.queue().forget(&hand.key);
                                q.queue().done(&hand.key);
                            } else {
                                hands.push(hand);
                            }
                        }
                    }
                    Op::Fail => {
                        if let Some(hand) = hands.pop() {
                            q.retry(&hand.key, hand.batch, hand.term);
                            q.queue().done(&hand.key);
                        }
                    }
                    _ => {}
                }
                let d: usize = q.lock().by_key.values().map(incarnations).sum::<usize>()
                    + hands.iter().map(|h| incarnations(&h.batch)).sum::<usize>();
                if filler {
                    prop_assert!(q.held() <= d, "route holds {} > {d} incarnations", q.held());
                } else {
                    prop_assert!(
                        budget.held() <= cap + d,
                        "held {} > cap {cap} + {d} incarnations",
                        budget.held()
                    );
                }
            }
            // Drain: every worker finishes, then every key is delivered.
            while let Some(mut hand) = hands.pop() {
                deliver(&mut hand, usize::MAX, &mut delivered);
                prop_assert!(q.finish(&hand.key).is_none());
                q.queue().done(&hand.key);
            }
            while let Some(key) = q.queue().try_get() {
                let (batch, term) = q.take(&key);
                let mut hand = Hand { key, batch, term };
                deliver(&mut hand, usize::MAX, &mut delivered);
                prop_assert!(q.finish(&hand.key).is_none());
                q.queue().done(&hand.key);
            }
            prop_assert_eq!(q.held(), 0);
            for k in 0..4u8 {
                let key = format!("ns/k{k}");
                let got = delivered.get(&key).cloned().unwrap_or_default();
                let deletes: Vec<_> = got
                    .iter()
                    .filter(|f| f.0 == 'D' && !f.3)
                    .map(|f| (f.1.clone(), f.2))
                    .collect();
                let want = must_delete.get(&key).cloned().unwrap_or_default();
                prop_assert_eq!(&deletes, &want, "every delete of {}: {:?}", key, got);
                prop_assert!(
                    got.windows(2).all(|w| w[0].2 <= w[1].2),
                    "in order: {:?}",
                    got
                );
                match cluster.get(&k) {
                    Some((u, _)) if out.contains(&k) => {
                        // Out of the stream: nothing delivered, or its filter's delete last.
                        if let Some(last) = got.last() {
                            prop_assert!(
                                last.0 == 'D' && last.3 && last.1 == format!("u{u}"),
                                "{} left the filter; last: {:?}",
                                key,
                                got
                            );
                        }
                    }
                    Some((u, r)) => {
                        let last = got.last().expect("the object was delivered");
                        prop_assert!(
                            last.0 != 'D' && last.1 == format!("u{u}") && last.2 == *r,
                            "newest state of {} (u{}, {}) last: {:?}",
                            key,
                            u,
                            r,
                            got
                        );
                    }
                    // Gone: its delete last (a filter's, when it was deleted out of the stream).
                    None if !want.is_empty() => {
                        prop_assert_eq!(got.last().map(|f| f.0), Some('D'));
                    }
                    None => {}
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(500))]
            #[test]
            fn held_stays_within_the_bound_and_deletes_and_newest_states_survive(
                cap in 1usize..6,
                filler in any::<bool>(),
                ops in proptest::collection::vec(op(), 1..120),
            ) {
                run(cap, filler, ops)?;
            }
        }
    }
}
