//! client-go's `processorListener`: the buffer between a shared informer and one consumer
//! (one resource route to one sink), so that a slow sink never blocks the informer or the
//! other sinks.
//!
//! # Contract
//! - `add` never blocks and never waits for the consumer.
//! - Notifications come out in the order they went in (strict FIFO).
//! - Memory is bounded, unlike client-go's buffer that grows "until we OOM": at `capacity`, an
//!   update is merged into the newest pending notification of the same object (the merged
//!   notification keeps the oldest `old` and takes the newest `new`), and counted as coalesced.
//!   Deletes, and notifications for objects with nothing pending, are always kept, so the
//!   buffer holds at most `capacity` plus a few per object it has seen: the newest state of
//!   each object and every delete are never dropped.
//! - Notification types the route did not ask for are dropped on entry.
//! - The listener has its own resync period; the informer asks `should_resync` on each tick
//!   of its check period, and resync notifications reach only listeners that are due.

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
    time::Duration,
};

use prometheus::{IntCounter, IntGauge};
use tokio::{sync::Notify, time::Instant};

use super::{Notification, NotificationKind, resource_version};
use crate::config::EventType;

/// See the module docs for the contract.
pub struct ProcessorListener {
    name: String,
    capacity: usize,
    accepts: [bool; 4],
    resync_period: Option<Duration>,
    buffer: Mutex<Buffer>,
    resync: Mutex<ResyncState>,
    notify: Notify,
    buffered: IntGauge,
    coalesced: IntCounter,
}

#[derive(Default)]
struct Buffer {
    entries: VecDeque<(String, Notification)>,
    // Sequence number of `entries[0]`; entry i has sequence `head_seq + i`.
    head_seq: u64,
    // Key → sequence number of its newest pending entry, for O(1) coalescing.
    newest: HashMap<String, u64>,
    closed: bool,
}

struct ResyncState {
    next: Instant,
    syncing: bool,
}

impl std::fmt::Debug for ProcessorListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessorListener")
            .field("name", &self.name)
            .field("len", &self.len())
            .finish()
    }
}

impl ProcessorListener {
    /// A listener named `name` (for logs) that buffers up to `capacity` notifications of the
    /// `accepted` types, resyncing every `resync_period` if set.
    pub fn new(
        name: impl Into<String>,
        capacity: usize,
        accepted: &[EventType],
        resync_period: Option<Duration>,
        buffered: IntGauge,
        coalesced: IntCounter,
    ) -> Self {
        let mut accepts = [false; 4];
        for t in accepted {
            accepts[*t as usize] = true;
        }
        let resync_period = resync_period.filter(|p| !p.is_zero());
        Self {
            name: name.into(),
            capacity: capacity.max(1),
            accepts,
            resync_period,
            buffer: Mutex::new(Buffer::default()),
            resync: Mutex::new(ResyncState {
                next: Instant::now() + resync_period.unwrap_or_default(),
                syncing: false,
            }),
            notify: Notify::new(),
            buffered,
            coalesced,
        }
    }

    /// The listener's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buffer> {
        self.buffer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Buffers a notification without blocking (see the module docs for what happens when full).
    pub fn add(&self, n: Notification) {
        if !self.accepts[n.event_type() as usize] {
            return;
        }
        let key = n.key();
        let mut b = self.lock();
        if b.closed {
            return;
        }
        if b.entries.len() >= self.capacity
            && let Some(&seq) = b.newest.get(&key)
        {
            let i = (seq - b.head_seq) as usize;
            if coalesce(&mut b.entries[i].1, n.clone()) {
                self.coalesced.inc();
                return;
            }
        }
        let seq = b.head_seq + b.entries.len() as u64;
        b.newest.insert(key.clone(), seq);
        b.entries.push_back((key, n));
        self.buffered.set(b.entries.len() as i64);
        drop(b);
        self.notify.notify_one();
    }

    /// The oldest notification, without waiting.
    pub fn try_pop(&self) -> Option<Notification> {
        let mut b = self.lock();
        let (key, n) = b.entries.pop_front()?;
        let seq = b.head_seq;
        b.head_seq += 1;
        if b.newest.get(&key) == Some(&seq) {
            b.newest.remove(&key);
        }
        self.buffered.set(b.entries.len() as i64);
        Some(n)
    }

    /// The oldest notification; waits while empty, `None` once closed and drained.
    pub async fn pop(&self) -> Option<Notification> {
        loop {
            if let Some(n) = self.try_pop() {
                return Some(n);
            }
            if self.lock().closed {
                return None;
            }
            self.notify.notified().await;
        }
    }

    /// Stops accepting notifications; `pop` drains what is buffered, then returns `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.notify.notify_waiters();
        self.notify.notify_one();
    }

    /// Number of buffered notifications.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The listener's resync period, if it resyncs.
    pub fn resync_period(&self) -> Option<Duration> {
        self.resync_period
    }

    /// client-go's `shouldResync` for one listener: due when `now` has reached its next resync;
    /// a due listener's next resync moves to `now + period`. Sets the flag `is_syncing` reads.
    pub fn should_resync(&self, now: Instant) -> bool {
        let mut r = self.resync.lock().unwrap_or_else(|e| e.into_inner());
        let Some(period) = self.resync_period else {
            r.syncing = false;
            return false;
        };
        r.syncing = now >= r.next;
        if r.syncing {
            r.next = now + period;
        }
        r.syncing
    }

    /// Whether resync notifications are currently delivered to this listener.
    ///
    /// Unlike client-go, where every listener starts with this flag set (so that the unchanged
    /// objects of a relist reach every listener while resync is off), it starts unset: a relist
    /// never produces phantom updates.
    pub fn is_syncing(&self) -> bool {
        self.resync
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .syncing
    }
}

/// Merges `incoming` into `pending` (both about the same object) when that loses no state
/// the consumer needs: add/update followed by an update or resync. Returns false otherwise.
fn coalesce(pending: &mut Notification, incoming: Notification) -> bool {
    use NotificationKind::*;
    let merged = match (&pending.kind, incoming.kind) {
        (
            Add {
                is_initial_list, ..
            },
            Update { new, .. },
        ) => Add {
            obj: new,
            is_initial_list: *is_initial_list,
        },
        (
            Update {
                old,
                new: pending_new,
            },
            Update { new, .. },
        ) => {
            // Resync of the state already pending adds nothing.
            if resource_version(pending_new) == resource_version(&new)
                && resource_version(old) != resource_version(&new)
            {
                return true;
            }
            Update {
                old: old.clone(),
                new,
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
    use crate::informer::{ObjectRef, testing::obj};

    fn listener(
        capacity: usize,
        accepted: &[EventType],
        resync: Option<Duration>,
    ) -> ProcessorListener {
        ProcessorListener::new(
            "test",
            capacity,
            accepted,
            resync,
            IntGauge::new("b", "b").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        )
    }

    const ALL: &[EventType] = &[
        EventType::Added,
        EventType::Updated,
        EventType::Deleted,
        EventType::Synced,
    ];

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
            NotificationKind::Add { obj, .. } => {
                format!("add {} {}", n.key(), resource_version(obj))
            }
            NotificationKind::Update { old, new } => {
                format!(
                    "update {} {}->{}",
                    n.key(),
                    resource_version(old),
                    resource_version(new)
                )
            }
            NotificationKind::Delete { obj, .. } => {
                format!("delete {} {}", n.key(), resource_version(obj))
            }
        }
    }
    fn drain(l: &ProcessorListener) -> Vec<String> {
        std::iter::from_fn(|| l.try_pop())
            .map(|n| describe(&n))
            .collect()
    }

    #[test]
    fn fifo_order_below_capacity() {
        let l = listener(10, ALL, None);
        l.add(add(obj("ns", "a", "1")));
        l.add(add(obj("ns", "b", "2")));
        l.add(update(obj("ns", "a", "1"), obj("ns", "a", "3")));
        assert_eq!(drain(&l), ["add ns/a 1", "add ns/b 2", "update ns/a 1->3"]);
    }

    #[test]
    fn at_capacity_updates_coalesce_but_deletes_and_new_objects_are_kept() {
        let l = listener(2, ALL, None);
        l.add(add(obj("ns", "a", "1")));
        l.add(update(obj("ns", "b", "1"), obj("ns", "b", "2")));
        // Full: these merge into the pending entries of a and b.
        l.add(update(obj("ns", "a", "1"), obj("ns", "a", "3")));
        l.add(update(obj("ns", "b", "2"), obj("ns", "b", "4")));
        l.add(update(obj("ns", "b", "4"), obj("ns", "b", "5")));
        assert_eq!(l.len(), 2);
        assert_eq!(l.coalesced.get(), 3);
        // Still full: a delete and an unseen object are kept beyond capacity.
        l.add(delete(obj("ns", "a", "6")));
        l.add(add(obj("ns", "c", "7")));
        assert_eq!(
            drain(&l),
            [
                "add ns/a 3",
                "update ns/b 1->5",
                "delete ns/a 6",
                "add ns/c 7"
            ]
        );
    }

    #[test]
    fn coalescing_targets_the_newest_pending_entry() {
        let l = listener(3, ALL, None);
        l.add(update(obj("ns", "a", "1"), obj("ns", "a", "2")));
        l.add(delete(obj("ns", "a", "3")));
        l.add(add(obj("ns", "a", "4")));
        l.add(update(obj("ns", "a", "4"), obj("ns", "a", "5")));
        assert_eq!(
            drain(&l),
            ["update ns/a 1->2", "delete ns/a 3", "add ns/a 5"]
        );
        // After draining, the index is empty and nothing coalesces into popped entries.
        l.add(update(obj("ns", "a", "5"), obj("ns", "a", "6")));
        assert_eq!(drain(&l), ["update ns/a 5->6"]);
    }

    #[test]
    fn unrequested_types_are_dropped() {
        let l = listener(10, &[EventType::Deleted], None);
        l.add(add(obj("ns", "a", "1")));
        l.add(update(obj("ns", "a", "1"), obj("ns", "a", "1")));
        l.add(delete(obj("ns", "a", "2")));
        assert_eq!(drain(&l), ["delete ns/a 2"]);
    }

    #[tokio::test(start_paused = true)]
    async fn resync_is_due_at_the_listeners_own_period() {
        let fast = listener(10, ALL, Some(Duration::from_secs(2)));
        let slow = listener(10, ALL, Some(Duration::from_secs(5)));
        let off = listener(10, ALL, None);
        assert!(
            !fast.is_syncing(),
            "no listener starts syncing (no phantom updates on relist)"
        );
        let mut due = (0, 0, 0);
        for _ in 0..10 {
            tokio::time::advance(Duration::from_secs(1)).await;
            let now = Instant::now();
            due.0 += fast.should_resync(now) as u32;
            due.1 += slow.should_resync(now) as u32;
            due.2 += off.should_resync(now) as u32;
        }
        assert_eq!(due, (5, 2, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn pop_drains_then_ends_after_close() {
        let l = std::sync::Arc::new(listener(10, ALL, None));
        l.add(add(obj("ns", "a", "1")));
        l.close();
        l.add(add(obj("ns", "b", "1")));
        assert_eq!(
            l.pop().await.map(|n| describe(&n)).as_deref(),
            Some("add ns/a 1")
        );
        assert!(l.pop().await.is_none());
    }
}
