//! One fake sink for the pipeline's tests and benches: it accepts, fails, stalls, slows
//! down, refuses as too large, or follows a script of outcomes per hand-over with delayed
//! acknowledgements, and keeps what it accepted in order (as one broker connection stores
//! it).
#![allow(dead_code)] // each test binary uses a different part

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::{FutureExt, future::BoxFuture};
use kube_event_bridge::{
    message::Message,
    pipeline::{
        Delivery,
        route::{DEFAULT_MAX_BYTES_IN_FLIGHT, DEFAULT_MAX_OBJECTS_IN_FLIGHT},
    },
    sinks::{self, Sink},
};

/// What happens to one hand-over of a scripted [`FakeSink`].
#[derive(Debug, Clone, Copy)]
pub enum Outcome {
    /// Stored and acknowledged.
    Stored,
    /// Not stored; the acknowledgement fails (retriable).
    Failed,
    /// Stored, but the acknowledgement is lost (a timeout: retriable).
    LostButStored,
    /// Refused as too large in the acknowledgement, unless it is a reference already (then
    /// stored): the route sends it again trimmed.
    TooLarge,
    /// Refused at the hand-over itself (a full local queue: retriable).
    Refused,
}

/// A message the sink stored: its key, id and payload.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub key: String,
    pub id: String,
    pub payload: serde_json::Value,
}

impl Accepted {
    /// The short CloudEvent type: `added`, `updated`, `deleted` or `synced`.
    pub fn event_type(&self) -> &str {
        self.payload["type"]
            .as_str()
            .unwrap()
            .rsplit('.')
            .next()
            .unwrap()
    }

    /// A CloudEvent attribute of the payload as a string (`""` when absent).
    pub fn attribute(&self, name: &str) -> &str {
        self.payload[name].as_str().unwrap_or_default()
    }
}

/// A sink whose behaviour a test chooses. Without a `script`, each publish completes before
/// its acknowledgement (the [`Sink::submit`] default) and fails as the knobs say; with one,
/// each hand-over takes the script's next outcome (then [`Outcome::Stored`]) and its
/// acknowledgement comes after the scripted delay (milliseconds), so several keys are in
/// flight at once.
#[derive(Default)]
pub struct FakeSink {
    pub name: String,
    /// Every n-th attempt fails with a retriable error (0: never).
    pub fail_every: u64,
    /// Keys whose publishes always fail (retriable).
    pub always_fail: Vec<String>,
    /// Payloads above this size fail for good.
    pub max_size: Option<usize>,
    /// Time each publish takes.
    pub delay: Duration,
    /// Publishes never complete.
    pub stall: bool,
    /// Per hand-over: its outcome and the delay of its acknowledgement in milliseconds.
    pub script: Vec<(Outcome, u8)>,
    /// JetStream's deduplication: a message whose id was stored among the last `window`
    /// messages is acknowledged but not stored again. `None`: every copy is kept (Kafka).
    pub window: Option<usize>,
    /// Count only, keep nothing (a bench's sink that acknowledges at once).
    pub discard: bool,
    /// Attempts that got past a stall and the delay.
    pub attempts: AtomicU64,
    /// Publishes started (a stalled one never counts as an attempt).
    pub publishing: AtomicU64,
    /// The script's next hand-over.
    pub next: AtomicUsize,
    /// What was stored, in order (read it with [`FakeSink::accepted`]).
    pub log: Mutex<Vec<Accepted>>,
    /// Scripted hand-overs whose acknowledgement has not come yet, and the most at once.
    pub unacknowledged: Arc<AtomicUsize>,
    pub peak_unacknowledged: AtomicUsize,
    /// The same in bytes (their messages' `wire_size`), and the largest message handed over.
    pub unacknowledged_bytes: Arc<AtomicUsize>,
    pub peak_unacknowledged_bytes: AtomicUsize,
    pub largest: AtomicUsize,
    /// JetStream's `max_in_flight`: a scripted hand-over waits for one of these permits, and
    /// its acknowledgement gives it back only once it is polled to its end (or dropped), as
    /// async-nats does.
    pub ack_window: Option<Arc<tokio::sync::Semaphore>>,
}

/// Counts one scripted hand-over (and its bytes) out of [`FakeSink::unacknowledged`] when its
/// acknowledgement comes (or is dropped unawaited).
struct Unacknowledged(Arc<AtomicUsize>, Arc<AtomicUsize>, usize);

impl Drop for Unacknowledged {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
        self.1.fetch_sub(self.2, Ordering::SeqCst);
    }
}

/// A route's delivery to `sink` alone: no dead letter, no publish limit, and `max_retries`.
pub fn delivery_to(sink: Arc<FakeSink>, max_retries: Option<u32>) -> Arc<Delivery> {
    Arc::new(Delivery {
        sink,
        dead_letter: None,
        publish_limit: None,
        max_retries,
        in_flight: Delivery::in_flight(DEFAULT_MAX_OBJECTS_IN_FLIGHT, DEFAULT_MAX_BYTES_IN_FLIGHT),
    })
}

impl FakeSink {
    /// A sink that accepts everything at once.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.into(),
            ..Default::default()
        }
    }

    /// Every stored message, in the order stored.
    pub fn accepted(&self) -> Vec<Accepted> {
        self.log.lock().unwrap().clone()
    }

    /// How many messages were stored.
    pub fn stored(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    /// Accepted messages per key: (resourceVersion, type) in acceptance order.
    pub fn by_key(&self) -> std::collections::HashMap<String, Vec<(u64, String)>> {
        let mut out: std::collections::HashMap<String, Vec<(u64, String)>> = Default::default();
        for a in self.log.lock().unwrap().iter() {
            let rv = a.attribute("k8sresourceversion").parse().unwrap();
            let ty = a.event_type().to_owned();
            out.entry(a.key.clone()).or_default().push((rv, ty));
        }
        out
    }

    fn store(&self, m: &Message, payload: serde_json::Value) {
        let mut log = self.log.lock().unwrap();
        if let Some(window) = self.window {
            let from = log.len().saturating_sub(window);
            if log[from..].iter().any(|s| s.id == m.id) {
                return;
            }
        }
        log.push(Accepted {
            key: m.key.clone(),
            id: m.id.clone(),
            payload,
        });
    }

    /// The knobs' publish, to completion.
    async fn publish_now(&self, m: &Message) -> sinks::Result<()> {
        self.publishing.fetch_add(1, Ordering::SeqCst);
        if self.stall {
            futures::future::pending::<()>().await;
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        if (self.fail_every > 0 && attempt.is_multiple_of(self.fail_every))
            || self.always_fail.contains(&m.key)
        {
            return Err(sinks::Error::Io(std::io::Error::other("injected failure")));
        }
        if let Some(max) = self.max_size.filter(|max| m.payload.len() > *max) {
            return Err(sinks::Error::TooLarge {
                size: m.payload.len(),
                max,
            });
        }
        if !self.discard {
            self.store(m, serde_json::from_slice(&m.payload).unwrap());
        }
        Ok(())
    }

    /// The script's hand-over: its outcome's acknowledgement, after the scripted delay.
    fn hand_over(&self, m: &Message) -> sinks::Result<sinks::Ack> {
        let i = self.next.fetch_add(1, Ordering::SeqCst);
        let (outcome, delay) = self.script.get(i).copied().unwrap_or((Outcome::Stored, 0));
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        let reference = v["k8struncated"] == true;
        let result = match outcome {
            Outcome::Refused => {
                return Err(sinks::Error::Io(std::io::Error::other("queue full")));
            }
            Outcome::Stored => {
                self.store(m, v);
                Ok(())
            }
            Outcome::TooLarge if reference => {
                self.store(m, v);
                Ok(())
            }
            Outcome::TooLarge => Err(sinks::Error::TooLarge {
                size: m.payload.len(),
                max: m.payload.len() - 1,
            }),
            Outcome::Failed => Err(sinks::Error::Io(std::io::Error::other("failed"))),
            Outcome::LostButStored => {
                self.store(m, v);
                Err(sinks::Error::Io(std::io::Error::other("ack timed out")))
            }
        };
        let delay = Duration::from_millis(delay as u64);
        let now = self.unacknowledged.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak_unacknowledged.fetch_max(now, Ordering::SeqCst);
        let size = m.wire_size();
        self.largest.fetch_max(size, Ordering::SeqCst);
        let bytes = self.unacknowledged_bytes.fetch_add(size, Ordering::SeqCst) + size;
        self.peak_unacknowledged_bytes
            .fetch_max(bytes, Ordering::SeqCst);
        let pending = Unacknowledged(
            self.unacknowledged.clone(),
            self.unacknowledged_bytes.clone(),
            size,
        );
        Ok(async move {
            tokio::time::sleep(delay).await;
            drop(pending);
            result
        }
        .boxed())
    }
}

impl Sink for FakeSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, sinks::Result<()>> {
        if self.script.is_empty() {
            self.publish_now(m).boxed()
        } else {
            async move { self.hand_over(m)?.await }.boxed()
        }
    }

    fn submit<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, sinks::Result<sinks::Ack>> {
        async move {
            if self.script.is_empty() {
                self.publish_now(m).await?;
                Ok(Box::pin(async { Ok(()) }) as sinks::Ack)
            } else if let Some(window) = &self.ack_window {
                let permit = window.clone().acquire_owned().await.unwrap();
                let ack = self.hand_over(m)?;
                Ok(async move {
                    let result = ack.await;
                    drop(permit);
                    result
                }
                .boxed())
            } else {
                self.hand_over(m)
            }
        }
        .boxed()
    }

    fn flush(&self) -> BoxFuture<'_, sinks::Result<()>> {
        async { Ok(()) }.boxed()
    }
}
