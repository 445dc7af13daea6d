//! Waiting for what a test expects to happen: poll a condition until it holds, and fail
//! naming it when it does not within the test's patience.
//!
//! Time is tokio's, so that a test with paused time waits in virtual time. Benches include
//! this file with `#[path]`: it uses nothing of the `support` module around it.
#![allow(dead_code)] // each test binary and bench uses a different part

use std::{fmt::Display, time::Duration};

use tokio::time::Instant;

/// How long a test waits for something that should happen.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// How often a wait looks again unless told otherwise.
pub const POLL: Duration = Duration::from_millis(20);

/// How long to wait, and how often to look: `Patience::of(limit)` polls every [`POLL`];
/// a plain [`Duration`] converts to that.
#[derive(Clone, Copy, Debug)]
pub struct Patience {
    limit: Duration,
    every: Duration,
}

impl Patience {
    /// Waits up to `limit`, looking every [`POLL`].
    pub const fn of(limit: Duration) -> Self {
        Self { limit, every: POLL }
    }

    /// The same limit, looking every `every`.
    pub const fn polling(self, every: Duration) -> Self {
        Self { every, ..self }
    }
}

impl From<Duration> for Patience {
    fn from(limit: Duration) -> Self {
        Self::of(limit)
    }
}

/// Waits until `cond` holds, looking at once and then as often as `patience` says; panics
/// naming `what` once its limit has passed. Returns how long it took.
pub async fn until(
    what: impl Display,
    patience: impl Into<Patience>,
    cond: impl AsyncFnMut() -> bool,
) -> Duration {
    let patience = patience.into();
    let start = Instant::now();
    if !within(patience, cond).await {
        panic!("timed out after {:?} waiting for {what}", patience.limit);
    }
    start.elapsed()
}

/// Waits until `cond` holds, like [`until`], but returns whether it did instead of
/// panicking: for a test that checks the outcome itself.
pub async fn within(patience: impl Into<Patience>, mut cond: impl AsyncFnMut() -> bool) -> bool {
    let patience = patience.into();
    let deadline = Instant::now() + patience.limit;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(patience.every).await;
    }
}

/// Waits until `count` stops changing: the same for `still`, looking every 500 ms; panics
/// ("never quiet") once `limit` has passed. Returns the last count.
pub async fn quiet(
    still: Duration,
    limit: Duration,
    mut count: impl AsyncFnMut() -> usize,
) -> usize {
    let (mut last, mut since) = (0, tokio::time::Instant::now());
    let deadline = tokio::time::Instant::now() + limit;
    while since.elapsed() < still {
        assert!(tokio::time::Instant::now() < deadline, "never quiet");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let n = count().await;
        if n != last {
            (last, since) = (n, tokio::time::Instant::now());
        }
    }
    last
}
