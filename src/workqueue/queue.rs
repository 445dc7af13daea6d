//! client-go's work queue (`util/workqueue/queue.go` and `delaying_queue.go`).
//!
//! # Contract
//! - **Fair**: items are handed out in the order they were added.
//! - **Stingy**: an item added several times before it is processed is processed once, and an
//!   item is never handed to two workers at once. An item added while it is being processed
//!   is marked dirty and queued again by `done`, once, however many adds it received.
//! - `add` is ignored after `shut_down`; `get` still drains queued items and returns `None`
//!   only when the queue is empty and shutting down.
//! - `shut_down_with_drain` also waits until every item handed out has been `done`.
//! - `add_after(x, d)`: `d <= 0` is a plain `add`; otherwise `x` waits until its ready time.
//!   An item waiting twice keeps the **earlier** ready time. Every call counts as a retry in
//!   the metrics; calls during shutdown are ignored and waiting items are dropped at shutdown.
//!
//! The queue- and work-duration histograms are accumulated under the queue's lock and reach
//! the shared histograms every `FLUSH_EVERY` observations, at `update_unfinished_work` (every
//! 500 ms in the service, as client-go refreshes its gauges) and at `shut_down`.
//!
//! Unlike client-go, waiting items live in the queue itself (a min-heap) and the workers
//! blocked in `get` wake at the next ready time: no extra goroutine-like task, no 10 s
//! heartbeat, no channel of 1000.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap, VecDeque},
    hash::Hash,
    sync::Mutex,
    time::Duration,
};

pub(crate) use crate::FastHash;

use prometheus::local::LocalHistogram;
use tokio::{sync::Notify, time::Instant};

use super::QueueMetrics;

/// See the module docs for the contract.
pub struct Queue<T> {
    state: Mutex<State<T>>,
    // Wakes workers blocked in `get`.
    work: Notify,
    // Wakes `shut_down_with_drain` when the processing set empties.
    drained: Notify,
    metrics: QueueMetrics,
}

struct State<T> {
    queue: VecDeque<T>,
    // Item → when it was first added since it was last handed out (for the queue-duration
    // histogram).
    dirty: HashMap<T, Instant, FastHash>,
    // Item → when it was handed out.
    processing: HashMap<T, Instant, FastHash>,
    // Delayed items: the heap may hold stale entries; `waiting` has the true ready time.
    heap: BinaryHeap<Reverse<(Instant, u64, T)>>,
    waiting: HashMap<T, Instant, FastHash>,
    seq: u64,
    shutting_down: bool,
    draining: bool,
    durations: Durations,
}

/// How many duration observations a queue accumulates before adding them to the shared
/// histograms (at the latest; `update_unfinished_work` adds them every 500 ms too).
const FLUSH_EVERY: u32 = 256;

/// The queue- and work-duration histograms, accumulated under the queue's lock (which every
/// observation holds anyway) and added to the shared histograms now and then: a shared
/// histogram's observation is four atomic operations on lines every runtime thread writes.
struct Durations {
    queue: LocalHistogram,
    work: LocalHistogram,
    unflushed: u32,
}

impl Durations {
    fn observed(&mut self) {
        self.unflushed += 1;
        if self.unflushed >= FLUSH_EVERY {
            self.flush();
        }
    }

    fn flush(&mut self) {
        self.queue.flush();
        self.work.flush();
        self.unflushed = 0;
    }
}

impl<T> std::fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").finish_non_exhaustive()
    }
}

impl<T: Clone + Eq + Hash + Ord> Queue<T> {
    /// An empty queue reporting to `metrics`.
    pub fn new(metrics: QueueMetrics) -> Self {
        Self {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                dirty: HashMap::default(),
                processing: HashMap::default(),
                heap: BinaryHeap::new(),
                waiting: HashMap::default(),
                seq: 0,
                shutting_down: false,
                draining: false,
                durations: Durations {
                    queue: metrics.queue_duration.local(),
                    work: metrics.work_duration.local(),
                    unflushed: 0,
                },
            }),
            work: Notify::new(),
            drained: Notify::new(),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `x` as needing processing (see the module docs).
    pub fn add(&self, x: T) {
        let mut s = self.lock();
        if s.shutting_down {
            return;
        }
        if self.add_locked(&mut s, x) {
            drop(s);
            self.work.notify_one();
        }
    }

    // Returns whether an item was pushed to the queue (a worker should wake).
    fn add_locked(&self, s: &mut State<T>, x: T) -> bool {
        let std::collections::hash_map::Entry::Vacant(v) = s.dirty.entry(x) else {
            return false;
        };
        let x = v.key().clone();
        v.insert(Instant::now());
        self.metrics.adds.inc();
        self.metrics.depth.inc();
        if s.processing.contains_key(&x) {
            return false;
        }
        s.queue.push_back(x);
        true
    }

    /// Adds `x` after `delay` (see the module docs).
    pub fn add_after(&self, x: T, delay: Duration) {
        let mut s = self.lock();
        if s.shutting_down {
            return;
        }
        self.metrics.retries.inc();
        if delay.is_zero() {
            if self.add_locked(&mut s, x) {
                drop(s);
                self.work.notify_one();
            }
            return;
        }
        let ready = Instant::now() + delay;
        if s.waiting.get(&x).is_some_and(|existing| *existing <= ready) {
            return;
        }
        s.waiting.insert(x.clone(), ready);
        s.seq += 1;
        let seq = s.seq;
        s.heap.push(Reverse((ready, seq, x)));
        drop(s);
        // A worker blocked in `get` must re-arm its timer for the new, possibly earlier, time.
        self.work.notify_waiters();
    }

    // Moves every due waiting item into the queue; returns the next ready time, if any.
    fn promote_due(&self, s: &mut State<T>, now: Instant) -> Option<Instant> {
        while let Some(Reverse((ready, _, x))) = s.heap.peek() {
            if s.waiting.get(x) != Some(ready) {
                s.heap.pop(); // stale: re-added with an earlier time, or already promoted
                continue;
            }
            if *ready > now {
                return Some(*ready);
            }
            let Reverse((_, _, x)) = s.heap.pop().expect("peeked");
            s.waiting.remove(&x);
            self.add_locked(s, x);
        }
        None
    }

    /// The next item, waiting while the queue is empty; `None` once shut down and empty.
    pub async fn get(&self) -> Option<T> {
        loop {
            let notified = self.work.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let next_ready = {
                let mut s = self.lock();
                let next_ready = if s.shutting_down || s.heap.is_empty() {
                    None // (no clock read when nothing waits)
                } else {
                    self.promote_due(&mut s, Instant::now())
                };
                if let Some(x) = self.pop_locked(&mut s) {
                    let more = !s.queue.is_empty();
                    drop(s);
                    if more {
                        self.work.notify_one(); // pass the baton: more work for another worker
                    }
                    return Some(x);
                }
                if s.shutting_down {
                    return None;
                }
                next_ready
            };
            match next_ready {
                Some(at) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// `get` without waiting: `None` when nothing is ready now.
    pub fn try_get(&self) -> Option<T> {
        let mut s = self.lock();
        if !s.shutting_down && !s.heap.is_empty() {
            self.promote_due(&mut s, Instant::now());
        }
        self.pop_locked(&mut s)
    }

    fn pop_locked(&self, s: &mut State<T>) -> Option<T> {
        let x = s.queue.pop_front()?;
        let now = Instant::now();
        self.metrics.depth.dec();
        if let Some(added) = s.dirty.remove(&x) {
            s.durations
                .queue
                .observe(now.duration_since(added).as_secs_f64());
            s.durations.observed();
        }
        s.processing.insert(x.clone(), now);
        Some(x)
    }

    /// Ends processing of `x`; requeues it once if it was added meanwhile.
    pub fn done(&self, x: &T) {
        let mut s = self.lock();
        if let Some(started) = s.processing.remove(x) {
            s.durations.work.observe(started.elapsed().as_secs_f64());
            s.durations.observed();
        }
        let requeued = s.dirty.contains_key(x);
        if requeued {
            s.queue.push_back(x.clone());
        }
        let drained = s.processing.is_empty() && s.draining;
        drop(s);
        if requeued {
            self.work.notify_one();
        }
        if drained {
            self.drained.notify_waiters();
        }
    }

    /// Items queued and ready (not those being processed, not those waiting for a delay).
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether no item is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues every item waiting for its `add_after` delay now; returns how many.
    pub fn add_waiting_now(&self) -> usize {
        let mut s = self.lock();
        if s.shutting_down {
            return 0;
        }
        s.heap.clear();
        // In the order they would have become ready.
        let mut items: Vec<(Instant, T)> = s.waiting.drain().map(|(x, at)| (at, x)).collect();
        items.sort_unstable();
        let n = items.len();
        let mut woke = false;
        for (_, x) in items {
            woke |= self.add_locked(&mut s, x);
        }
        drop(s);
        if woke {
            self.work.notify_waiters();
            self.work.notify_one();
        }
        n
    }

    /// Items waiting for their `add_after` delay.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Whether `shut_down` was called.
    pub fn is_shutting_down(&self) -> bool {
        self.lock().shutting_down
    }

    /// Stops accepting adds and wakes every worker; queued items are still handed out.
    pub fn shut_down(&self) {
        let mut s = self.lock();
        s.shutting_down = true;
        s.draining = false;
        s.waiting.clear();
        s.heap.clear();
        s.durations.flush();
        drop(s);
        self.work.notify_waiters();
        self.drained.notify_waiters();
    }

    /// `shut_down`, then waits until every handed-out item is `done`. A later `shut_down`
    /// releases the wait.
    pub async fn shut_down_with_drain(&self) {
        {
            let mut s = self.lock();
            s.shutting_down = true;
            s.draining = true;
            s.waiting.clear();
            s.heap.clear();
        }
        self.work.notify_waiters();
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            {
                let s = self.lock();
                if !s.draining || (s.processing.is_empty() && s.queue.is_empty()) {
                    return;
                }
            }
            drained.await;
        }
    }

    /// Updates the two gauges client-go refreshes every 500 ms: total and oldest age of the
    /// items being processed; also adds the durations observed since the last time to the
    /// shared histograms.
    pub fn update_unfinished_work(&self) {
        let mut s = self.lock();
        s.durations.flush();
        let now = Instant::now();
        let ages = s
            .processing
            .values()
            .map(|t| now.duration_since(*t).as_secs_f64());
        let (total, oldest) = ages.fold((0.0, 0.0f64), |(t, o), a| (t + a, o.max(a)));
        self.metrics.unfinished_work.set(total);
        self.metrics.longest_running.set(oldest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn queue() -> Queue<&'static str> {
        Queue::new(QueueMetrics::unregistered())
    }

    #[test]
    fn durations_reach_the_shared_histograms_at_the_gauge_update_or_every_flush_every() {
        let q = queue();
        let counts = |q: &Queue<&'static str>| {
            (
                q.metrics.queue_duration.get_sample_count(),
                q.metrics.work_duration.get_sample_count(),
            )
        };
        q.add("a");
        let a = q.try_get().unwrap();
        q.done(&a);
        q.update_unfinished_work();
        assert_eq!(counts(&q), (1, 1));
        // Without the gauge update (a queue outside the service): at the latest every
        // FLUSH_EVERY observations.
        for _ in 0..FLUSH_EVERY {
            q.add("b");
            let b = q.try_get().unwrap();
            q.done(&b);
        }
        let (queued, worked) = counts(&q);
        assert!(
            queued + worked > u64::from(FLUSH_EVERY),
            "{queued} + {worked}"
        );
        q.shut_down();
        assert_eq!(
            counts(&q),
            (1 + u64::from(FLUSH_EVERY), 1 + u64::from(FLUSH_EVERY))
        );
    }

    #[test]
    fn basic_fifo_and_collapse() {
        let q = queue();
        q.add("a");
        q.add("b");
        q.add("a");
        assert_eq!(q.len(), 2, "repeated adds collapse");
        assert_eq!(q.try_get(), Some("a"));
        assert_eq!(q.try_get(), Some("b"));
        assert_eq!(q.try_get(), None);
        assert_eq!(q.metrics.adds.get(), 2);
        assert_eq!(q.metrics.depth.get(), 0);
    }

    #[test]
    fn add_while_processing_requeues_once_on_done() {
        let q = queue();
        q.add("a");
        let a = q.try_get().unwrap();
        q.add("a");
        q.add("a");
        assert_eq!(q.try_get(), None, "never handed to two workers at once");
        q.done(&a);
        assert_eq!(q.try_get(), Some("a"));
        q.done(&"a");
        assert_eq!(q.try_get(), None, "requeued once, however many adds");
    }

    #[test]
    fn shut_down_ignores_adds_but_drains_queued_items() {
        let q = queue();
        q.add("a");
        q.shut_down();
        q.add("b");
        assert_eq!(q.try_get(), Some("a"));
        assert_eq!(q.try_get(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn get_blocks_until_add_and_returns_none_after_shutdown() {
        let q = Arc::new(queue());
        let worker = tokio::spawn({
            let q = q.clone();
            async move { (q.get().await, q.get().await) }
        });
        tokio::task::yield_now().await;
        q.add("a");
        tokio::task::yield_now().await;
        q.shut_down();
        assert_eq!(worker.await.unwrap(), (Some("a"), None));
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_with_drain_waits_for_done() {
        let q = Arc::new(queue());
        q.add("a");
        let a = q.get().await.unwrap();
        let drain = tokio::spawn({
            let q = q.clone();
            async move { q.shut_down_with_drain().await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!drain.is_finished(), "still processing");
        q.done(&a);
        drain.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_releases_a_drain() {
        let q = Arc::new(queue());
        q.add("a");
        let _a = q.get().await.unwrap();
        let drain = tokio::spawn({
            let q = q.clone();
            async move { q.shut_down_with_drain().await }
        });
        tokio::task::yield_now().await;
        q.shut_down();
        drain.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn add_after_waits_and_the_earlier_ready_time_wins() {
        let q = Arc::new(queue());
        let start = Instant::now();
        q.add_after("a", Duration::from_millis(50));
        q.add_after("a", Duration::from_millis(10));
        q.add_after("a", Duration::from_millis(30));
        q.add_after("b", Duration::from_millis(20));
        assert_eq!(q.try_get(), None);
        assert_eq!(q.waiting(), 2);
        assert_eq!(q.get().await, Some("a"));
        assert_eq!(start.elapsed(), Duration::from_millis(10));
        assert_eq!(q.get().await, Some("b"));
        assert_eq!(start.elapsed(), Duration::from_millis(20));
        q.done(&"a");
        q.done(&"b");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            q.try_get(),
            None,
            "the later ready times were dropped, not queued again"
        );
        assert_eq!(
            q.metrics.retries.get(),
            4,
            "every add_after counts as a retry"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_blocked_worker_wakes_for_a_delayed_item_added_later() {
        let q = Arc::new(queue());
        let worker = tokio::spawn({
            let q = q.clone();
            async move { q.get().await }
        });
        tokio::task::yield_now().await;
        let start = Instant::now();
        q.add_after("late", Duration::from_secs(3));
        assert_eq!(worker.await.unwrap(), Some("late"));
        assert_eq!(start.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_items_are_dropped_at_shutdown() {
        let q = queue();
        q.add_after("a", Duration::from_secs(1));
        q.shut_down();
        q.add_after("b", Duration::ZERO);
        assert_eq!(q.get().await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn unfinished_work_gauges() {
        let q = queue();
        q.add("a");
        q.add("b");
        let _a = q.try_get().unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        let _b = q.try_get().unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        q.update_unfinished_work();
        assert_eq!(q.metrics.unfinished_work.get(), 4.0);
        assert_eq!(q.metrics.longest_running.get(), 3.0);
    }
}
