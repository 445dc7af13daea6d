//! client-go's `util/workqueue`: a fair, stingy work queue with delayed and rate-limited adds.
//!
//! - [`Queue`]: add / get / done with client-go's dirty and processing sets, `add_after`,
//!   `shut_down`, `shut_down_with_drain`.
//! - [`rate_limiter`]: per-item exponential failure, token bucket, max-of, and client-go's
//!   default controller limiter.
//! - [`RateLimitingQueue`]: a queue plus a limiter: `add_rate_limited`, `forget`,
//!   `num_requeues`.
//! - [`QueueMetrics`]: client-go's metric names, with the `name` label.

pub mod metrics;
pub mod queue;
pub mod rate_limiter;
pub mod rate_limiting_queue;

pub use metrics::QueueMetrics;
pub use queue::Queue;
pub use rate_limiter::{RateLimiter, TokenBucket};
pub use rate_limiting_queue::RateLimitingQueue;
