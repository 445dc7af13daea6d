//! client-go's rate limiters (`util/workqueue/default_rate_limiters.go`).
//!
//! - [`ItemExponentialFailureRateLimiter`]: per item, `base · 2^failures`, capped at `max`.
//! - [`BucketRateLimiter`]: one token bucket shared by all items (`golang.org/x/time/rate`
//!   reservation semantics: every call takes a token and returns how long to wait for it).
//! - [`MaxOfRateLimiter`]: asks every limiter (all advance) and returns the longest delay.
//! - [`default_controller_rate_limiter`]: max-of(exponential 5 ms..1000 s, bucket 10 qps
//!   burst 100), client-go's `DefaultControllerRateLimiter`.

use std::{collections::HashMap, hash::Hash, sync::Mutex, time::Duration};

use tokio::time::Instant;

/// How long an item waits before its next retry.
pub trait RateLimiter<T>: Send + Sync {
    /// The delay for `item`'s next retry; records the attempt.
    fn when(&self, item: &T) -> Duration;
    /// Forgets `item`'s history (after it succeeded).
    fn forget(&self, item: &T);
    /// How many times `item` was retried since it was last forgotten.
    fn num_requeues(&self, item: &T) -> u32;
    /// The destination works again: overall pacing starts afresh (a token bucket refills and
    /// forgets the retries it spaced out); per-item histories are kept.
    fn recovered(&self) {}
}

/// Per-item exponential backoff: `base · 2^n` for the n-th failure, at most `max`.
///
/// An item's `when` and `forget` must come from one holder of it at a time, one after the
/// other (as a work queue's worker calls them): `forget` of an item takes no lock while no
/// item has failed, which is only sound when its own `when` happened before.
pub struct ItemExponentialFailureRateLimiter<T> {
    base: Duration,
    max: Duration,
    failures: Mutex<HashMap<T, u32, super::queue::FastHash>>,
    // How many items `failures` holds: `forget` of an item that never failed (nearly every
    // call) takes no lock when none has.
    tracked: std::sync::atomic::AtomicUsize,
}

impl<T> ItemExponentialFailureRateLimiter<T> {
    /// A limiter starting at `base` and capped at `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            failures: Mutex::new(HashMap::default()),
            tracked: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

impl<T: Clone + Eq + Hash + Send + Sync> RateLimiter<T> for ItemExponentialFailureRateLimiter<T> {
    fn when(&self, item: &T) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = failures.entry(item.clone()).or_insert(0);
        let exp = *n;
        *n = n.saturating_add(1);
        self.tracked
            .store(failures.len(), std::sync::atomic::Ordering::Release);
        // Overflow (2^exp beyond u32, or the product beyond Duration) means "max".
        2u32.checked_pow(exp)
            .and_then(|f| self.base.checked_mul(f))
            .map_or(self.max, |d| d.min(self.max))
    }

    fn forget(&self, item: &T) {
        // An item's `when` and `forget` come from the worker that holds it, one after the
        // other (the work queue's lock orders them), so a count of 0 seen here includes it.
        if self.tracked.load(std::sync::atomic::Ordering::Acquire) == 0 {
            return;
        }
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(item);
        self.tracked
            .store(failures.len(), std::sync::atomic::Ordering::Release);
    }

    fn num_requeues(&self, item: &T) -> u32 {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(item)
            .copied()
            .unwrap_or(0)
    }
}

/// A token bucket with `golang.org/x/time/rate` reservation semantics: `reserve` always takes
/// a token, letting the balance go negative, and returns how long until that token exists.
/// Used for retries (through [`BucketRateLimiter`]) and for a sink's publish rate limit.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// `rate` tokens per second, at most `burst` saved up; starts full.
    pub fn new(rate: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            rate,
            burst,
            state: Mutex::new((burst, Instant::now())),
        }
    }

    /// Takes one token; returns how long to wait before using it.
    pub fn reserve(&self) -> Duration {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let elapsed = now.duration_since(s.1).as_secs_f64();
        s.0 = (s.0 + elapsed * self.rate).min(self.burst) - 1.0;
        s.1 = now;
        if s.0 >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-s.0 / self.rate)
        }
    }

    /// Gives back a token [`reserve`](Self::reserve) took, for a request dropped before its
    /// wait ended (as Go's `Reservation.Cancel`): requests given up on leave no debt behind.
    pub fn cancel(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0 = (s.0 + 1.0).min(self.burst);
    }

    /// Full again, with no reservation outstanding.
    pub fn refill(&self) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = (self.burst, Instant::now());
    }
}

/// One token bucket shared by every item.
pub struct BucketRateLimiter {
    bucket: TokenBucket,
}

impl BucketRateLimiter {
    /// `qps` retries per second overall, `burst` at once.
    pub fn new(qps: f64, burst: u32) -> Self {
        Self {
            bucket: TokenBucket::new(qps, burst),
        }
    }
}

impl<T> RateLimiter<T> for BucketRateLimiter {
    fn when(&self, _item: &T) -> Duration {
        self.bucket.reserve()
    }
    fn forget(&self, _item: &T) {}
    fn num_requeues(&self, _item: &T) -> u32 {
        0
    }
    fn recovered(&self) {
        self.bucket.refill();
    }
}

/// The longest delay of several limiters; every limiter sees every call.
pub struct MaxOfRateLimiter<T> {
    limiters: Vec<Box<dyn RateLimiter<T>>>,
}

impl<T> MaxOfRateLimiter<T> {
    /// Combines `limiters`.
    pub fn new(limiters: Vec<Box<dyn RateLimiter<T>>>) -> Self {
        Self { limiters }
    }
}

impl<T> RateLimiter<T> for MaxOfRateLimiter<T> {
    fn when(&self, item: &T) -> Duration {
        self.limiters
            .iter()
            .map(|l| l.when(item))
            .max()
            .unwrap_or_default()
    }
    fn forget(&self, item: &T) {
        self.limiters.iter().for_each(|l| l.forget(item));
    }
    fn num_requeues(&self, item: &T) -> u32 {
        self.limiters
            .iter()
            .map(|l| l.num_requeues(item))
            .max()
            .unwrap_or(0)
    }
    fn recovered(&self) {
        self.limiters.iter().for_each(|l| l.recovered());
    }
}

/// Settings of [`default_controller_rate_limiter`]-shaped limiters.
#[derive(Debug, Clone, Copy)]
pub struct RetrySettings {
    /// First per-item delay.
    pub base: Duration,
    /// Largest per-item delay.
    pub max: Duration,
    /// Retries per second over all items.
    pub qps: f64,
    /// Retries allowed at once over all items.
    pub burst: u32,
}

impl Default for RetrySettings {
    /// client-go's `DefaultControllerRateLimiter`: 5 ms .. 1000 s per item, 10 qps burst 100.
    fn default() -> Self {
        Self {
            base: Duration::from_millis(5),
            max: Duration::from_secs(1000),
            qps: 10.0,
            burst: 100,
        }
    }
}

/// max-of(per-item exponential, overall bucket) with `settings`.
pub fn controller_rate_limiter<T: Clone + Eq + Hash + Send + Sync + 'static>(
    settings: RetrySettings,
) -> MaxOfRateLimiter<T> {
    MaxOfRateLimiter::new(vec![
        Box::new(ItemExponentialFailureRateLimiter::new(
            settings.base,
            settings.max,
        )),
        Box::new(BucketRateLimiter::new(settings.qps, settings.burst)),
    ])
}

/// client-go's `DefaultControllerRateLimiter`.
pub fn default_controller_rate_limiter<T: Clone + Eq + Hash + Send + Sync + 'static>()
-> MaxOfRateLimiter<T> {
    controller_rate_limiter(RetrySettings::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn item_exponential_doubles_per_item_and_forget_resets() {
        let l = ItemExponentialFailureRateLimiter::new(MS, Duration::from_secs(1));
        let delays: Vec<Duration> = (0..5).map(|_| l.when(&"one")).collect();
        assert_eq!(delays, [MS, 2 * MS, 4 * MS, 8 * MS, 16 * MS]);
        assert_eq!(l.when(&"two"), MS, "items are independent");
        assert_eq!(l.num_requeues(&"one"), 5);
        l.forget(&"one");
        assert_eq!(l.num_requeues(&"one"), 0);
        assert_eq!(l.when(&"one"), MS);
    }

    #[test]
    fn item_exponential_caps_and_survives_overflow() {
        let l = ItemExponentialFailureRateLimiter::new(
            Duration::from_millis(5),
            Duration::from_secs(1000),
        );
        let delays: Vec<Duration> = (0..100).map(|_| l.when(&"x")).collect();
        // client-go: "failure 18 waits 655.36 s and failure 19 hits the 1000 s cap".
        assert_eq!(delays[17], Duration::from_millis(655_360));
        assert_eq!(delays[18], Duration::from_secs(1000));
        assert_eq!(
            delays[99],
            Duration::from_secs(1000),
            "no overflow panic at 2^99"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bucket_gives_burst_then_spaces_calls() {
        let l = BucketRateLimiter::new(10.0, 3);
        let first: Vec<Duration> = (0..5)
            .map(|_| RateLimiter::<&str>::when(&l, &"x"))
            .collect();
        assert_eq!(
            first,
            [
                Duration::ZERO,
                Duration::ZERO,
                Duration::ZERO,
                100 * MS,
                200 * MS
            ]
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        // 1 s refills 10 tokens, of which 2 repay the debt and the bucket holds at most 3.
        assert_eq!(RateLimiter::<&str>::when(&l, &"x"), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn max_of_takes_the_longest_and_advances_all() {
        let l = MaxOfRateLimiter::new(vec![
            Box::new(ItemExponentialFailureRateLimiter::new(
                MS,
                Duration::from_secs(1),
            )),
            Box::new(ItemExponentialFailureRateLimiter::new(
                10 * MS,
                Duration::from_secs(1),
            )),
        ]);
        assert_eq!(l.when(&"x"), 10 * MS);
        assert_eq!(l.when(&"x"), 20 * MS);
        assert_eq!(l.num_requeues(&"x"), 2);
        l.forget(&"x");
        assert_eq!(l.num_requeues(&"x"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn default_controller_limiter_matches_client_go() {
        let l = default_controller_rate_limiter::<u32>();
        // Per item: 5 ms for a first failure; overall: the first 100 calls are free.
        for i in 0..100 {
            assert_eq!(l.when(&i), 5 * MS);
        }
        // The 101st call waits for the bucket: 100 ms at 10 qps.
        assert_eq!(l.when(&1000), 100 * MS);
    }
}
