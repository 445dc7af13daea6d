//! client-go's `RateLimitingInterface`: a [`Queue`] whose retries wait as a
//! [`RateLimiter`] says.

use std::{hash::Hash, ops::Deref};

use super::{Queue, QueueMetrics, RateLimiter};

/// A queue plus a rate limiter. Derefs to the [`Queue`] for add/get/done/shut_down.
pub struct RateLimitingQueue<T> {
    queue: Queue<T>,
    limiter: Box<dyn RateLimiter<T>>,
}

impl<T> Deref for RateLimitingQueue<T> {
    type Target = Queue<T>;
    fn deref(&self) -> &Queue<T> {
        &self.queue
    }
}

impl<T: Clone + Eq + Hash + Ord> RateLimitingQueue<T> {
    /// A queue whose retries `limiter` paces.
    pub fn new(limiter: Box<dyn RateLimiter<T>>, metrics: QueueMetrics) -> Self {
        Self {
            queue: Queue::new(metrics),
            limiter,
        }
    }

    /// Adds `x` after the limiter's delay for it.
    pub fn add_rate_limited(&self, x: T) {
        let delay = self.limiter.when(&x);
        self.queue.add_after(x, delay);
    }

    /// Clears `x`'s retry history (it does not call `done`).
    pub fn forget(&self, x: &T) {
        self.limiter.forget(x);
    }

    /// How many times `x` was retried since it was last forgotten.
    pub fn num_requeues(&self, x: &T) -> u32 {
        self.limiter.num_requeues(x)
    }

    /// The destination works again after failures: every item waiting out a retry delay is
    /// queued now, and the limiter's overall pacing starts afresh (per-item backoff histories
    /// stay, so an item that fails again waits longer, as before). Returns how many were
    /// brought forward.
    pub fn recovered(&self) -> usize {
        self.limiter.recovered();
        self.queue.add_waiting_now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workqueue::rate_limiter::ItemExponentialFailureRateLimiter;
    use std::time::Duration;
    use tokio::time::Instant;

    #[tokio::test(start_paused = true)]
    async fn retries_back_off_per_item_until_forgotten() {
        let q = RateLimitingQueue::new(
            Box::new(ItemExponentialFailureRateLimiter::new(
                Duration::from_millis(100),
                Duration::from_secs(10),
            )),
            QueueMetrics::unregistered(),
        );
        let start = Instant::now();
        for expected_ms in [100, 300, 700] {
            q.add_rate_limited("x");
            let x = q.get().await.unwrap();
            q.done(&x);
            assert_eq!(start.elapsed(), Duration::from_millis(expected_ms));
        }
        assert_eq!(q.num_requeues(&"x"), 3);
        q.forget(&"x");
        assert_eq!(q.num_requeues(&"x"), 0);
        q.add_rate_limited("x");
        q.get().await.unwrap();
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(800),
            "back to the base delay"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn recovery_brings_waiting_retries_forward_and_refills_the_bucket() {
        // client-go's default shape: 5 ms doubling per item, and 10/s with a burst of 100.
        let q = RateLimitingQueue::new(
            Box::new(crate::workqueue::rate_limiter::default_controller_rate_limiter()),
            QueueMetrics::unregistered(),
        );
        // An outage failed 1,000 objects: the bucket spaces their retries over 90 s.
        for i in 0..1000 {
            q.add_rate_limited(i);
        }
        assert_eq!(q.waiting(), 1000);
        // The first 100 (the burst) go after their own 5 ms.
        for i in 0..100 {
            let x = q.get().await.unwrap();
            assert_eq!(x, i);
            q.done(&x);
        }
        let start = Instant::now();
        assert_eq!(q.recovered(), 900);
        let mut got = Vec::new();
        while let Some(x) = q.try_get() {
            got.push(x);
            q.done(&x);
        }
        assert_eq!(
            got,
            (100..1000).collect::<Vec<_>>(),
            "in their retry order, now"
        );
        assert_eq!(start.elapsed(), Duration::ZERO);
        // The bucket starts afresh: a failure now waits its own backoff, not 90 s of debt.
        q.add_rate_limited(5);
        assert_eq!(q.waiting(), 1);
        let x = q.get().await.unwrap();
        assert_eq!(x, 5);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(10),
            "5 ms doubled once"
        );
        assert_eq!(q.num_requeues(&5), 2, "the object's own history is kept");
    }
}
