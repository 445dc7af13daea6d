//! The sink's producer (`client::SinkProducer`): rdkafka's `BaseProducer`, whose delivery
//! reports (and errors and token refreshes) a thread of its own serves when librdkafka says
//! one is queued.
//!
//! rdkafka's `FutureProducer` serves them from a thread that polls every 100 ms, and rdkafka
//! 0.39 truncates what is left of each poll's deadline to whole milliseconds: the last
//! millisecond of every poll spins with a timeout of 0, about 9 ms of CPU per second per
//! producer while idle, and a wake-up per report while busy. Here librdkafka calls back when
//! its main queue goes from empty to non-empty (`rd_kafka_queue_cb_event_enable`); the thread
//! then serves everything queued and sleeps again. It also serves the queue every
//! [`SAFETY_POLL`] unasked (as rdkafka's thread does), so that no report waits long on a
//! wake-up that never came.
//!
//! # Contract
//! - A delivery future resolves exactly as rdkafka's `DeliveryFuture` does: the delivery (its
//!   partition, offset and timestamp), or the error with the message, or `Canceled` if the
//!   producer is dropped first. (As with rdkafka's: a report still queued when the client is
//!   destroyed, after the drop's 500 ms flush, is never resolved. The sink drops a producer
//!   only once nothing is in flight.)
//! - The last clone dropped stops the thread, then drops the `BaseProducer` (which purges
//!   and flushes for up to 500 ms: drop it off the async threads).
//! - Reports are served on this thread, and by the calls that flush (`flush`,
//!   `commit_transaction`, the last drop) on their caller's: never from an async thread as
//!   long as those calls are made off them (a token refresh is a blocking request).

use std::{
    ffi::c_void,
    ops::Deref,
    pin::Pin,
    sync::{Arc, Condvar, Mutex},
    task::{Context, Poll},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use futures::channel::oneshot;
use rdkafka::{
    ClientConfig, ClientContext, bindings as rd,
    client::OAuthToken,
    config::RDKafkaLogLevel,
    error::{KafkaError, KafkaResult, RDKafkaErrorCode},
    message::{Message as _, ToBytes},
    producer::{
        BaseProducer, BaseRecord, DeliveryResult, FutureRecord, NoCustomPartitioner, Producer as _,
        ProducerContext,
        future_producer::{Delivery, OwnedDeliveryResult},
    },
    statistics::Statistics,
};

/// How often the thread serves the queue though librdkafka did not call back.
pub const SAFETY_POLL: Duration = Duration::from_millis(100);

/// A producer whose client context is `C` (the sink's is `client::SinkProducer`). Cheap to
/// clone: clones share one librdkafka producer and thread.
pub struct ReportingProducer<C: ClientContext + 'static>(Arc<Inner<C>>);

impl<C: ClientContext + 'static> Clone for ReportingProducer<C> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

struct Inner<C: ClientContext + 'static> {
    base: Arc<BaseProducer<Reports<C>>>,
    /// Destroyed in `Drop`, before `base` (librdkafka wants a client's queue handles
    /// destroyed before the client).
    queue: Option<Arc<MainQueue>>,
    wake: Arc<Wake>,
    thread: Option<JoinHandle<()>>,
}

/// A handle of the producer's main queue (where librdkafka puts delivery reports).
struct MainQueue(*mut rd::rd_kafka_queue_t);

// SAFETY: librdkafka's queues are thread-safe; the handle is destroyed once, in `Drop`, after
// the thread that uses it was joined.
unsafe impl Send for MainQueue {}
unsafe impl Sync for MainQueue {}

impl MainQueue {
    fn len(&self) -> usize {
        // SAFETY: the handle is live until `Drop`.
        unsafe { rd::rd_kafka_queue_length(self.0) }
    }
}

impl Drop for MainQueue {
    fn drop(&mut self) {
        // SAFETY: our own reference, taken by `rd_kafka_queue_get_main`; destroyed once.
        unsafe { rd::rd_kafka_queue_destroy(self.0) }
    }
}

/// What wakes the thread: a report queued, or the producer dropped.
#[derive(Default)]
struct Wake {
    state: Mutex<(bool, bool)>,
    cond: Condvar,
}

impl Wake {
    fn queued(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 = true;
        self.cond.notify_one();
    }

    fn stop(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.cond.notify_one();
    }

    /// Waits until a report is queued or `safety` passed; false once stopped.
    fn wait(&self, safety: Duration) -> bool {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (mut state, _) = self
            .cond
            .wait_timeout_while(state, safety, |(queued, stop)| !*queued && !*stop)
            .unwrap_or_else(|e| e.into_inner());
        state.0 = false;
        !state.1
    }
}

/// Called by librdkafka (under its queue's lock) when the main queue stops being empty.
unsafe extern "C" fn queued(_rk: *mut rd::rd_kafka_t, opaque: *mut c_void) {
    // SAFETY: `opaque` is the `Wake` of a live `Inner`: the callback is switched off (under
    // the same lock) before that `Wake` can go.
    let wake = unsafe { &*(opaque as *const Wake) };
    wake.queued();
}

impl<C: ClientContext + 'static> ReportingProducer<C> {
    /// Creates a producer with `config` and `context`, and starts its thread.
    pub fn create(config: &ClientConfig, context: C) -> KafkaResult<Self> {
        Self::serving_every(config, context, SAFETY_POLL)
    }

    /// [`create`](Self::create), the thread serving the queue unasked every `safety`.
    fn serving_every(config: &ClientConfig, context: C, safety: Duration) -> KafkaResult<Self> {
        let base: Arc<BaseProducer<Reports<C>>> =
            Arc::new(config.create_with_context(Reports(context))?);
        // SAFETY: the client is live; the queue reference is ours until `MainQueue::drop`.
        let queue = Arc::new(MainQueue(unsafe {
            rd::rd_kafka_queue_get_main(base.client().native_ptr())
        }));
        let wake = Arc::new(Wake::default());
        // SAFETY: the queue is live; `wake` outlives the callback (see `Inner::drop`).
        unsafe {
            rd::rd_kafka_queue_cb_event_enable(
                queue.0,
                Some(queued),
                Arc::as_ptr(&wake) as *mut c_void,
            )
        };
        let spawned = std::thread::Builder::new()
            .name("kafka reports".into())
            .spawn({
                let (base, queue, wake) = (base.clone(), queue.clone(), wake.clone());
                move || {
                    // Serves what is queued at once too: a report may have come before the
                    // callback was set. Each poll takes one operation off the queue.
                    loop {
                        while queue.len() > 0 {
                            base.poll(Duration::ZERO);
                        }
                        if !wake.wait(safety) {
                            break;
                        }
                    }
                }
            });
        let thread = match spawned {
            Ok(thread) => thread,
            Err(e) => {
                // SAFETY: as above; `wake` is not used once this returns.
                unsafe { rd::rd_kafka_queue_cb_event_enable(queue.0, None, std::ptr::null_mut()) };
                return Err(KafkaError::ClientCreation(format!(
                    "cannot start the producer's thread: {e}"
                )));
            }
        };
        Ok(Self(Arc::new(Inner {
            base,
            queue: Some(queue),
            wake,
            thread: Some(thread),
        })))
    }

    /// Sends `record`; if librdkafka does not take it (its queue is full, say), the error and
    /// the record are returned at once.
    #[allow(clippy::result_large_err)]
    pub fn send_result<'a, K, P>(
        &self,
        record: FutureRecord<'a, K, P>,
    ) -> Result<DeliveryFuture, (KafkaError, FutureRecord<'a, K, P>)>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        let (tx, rx) = oneshot::channel();
        let base = BaseRecord {
            topic: record.topic,
            partition: record.partition,
            payload: record.payload,
            key: record.key,
            timestamp: record.timestamp,
            headers: record.headers,
            delivery_opaque: Box::new(tx),
        };
        self.0
            .base
            .send(base)
            .map(|()| DeliveryFuture(rx))
            .map_err(|(e, r)| {
                (
                    e,
                    FutureRecord {
                        topic: r.topic,
                        partition: r.partition,
                        payload: r.payload,
                        key: r.key,
                        timestamp: r.timestamp,
                        headers: r.headers,
                    },
                )
            })
    }
}

impl<C: ClientContext + 'static> ReportingProducer<C> {
    /// Sends `record`, waiting up to `queue_timeout` (in steps of 100 ms) for room in
    /// librdkafka's queue, and awaits its delivery report.
    pub async fn send<K, P>(
        &self,
        mut record: FutureRecord<'_, K, P>,
        queue_timeout: Duration,
    ) -> Result<(), KafkaError>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        let started = Instant::now();
        loop {
            match self.send_result(record) {
                Ok(delivery) => return delivery.outcome().await,
                Err((e, r))
                    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull)
                        && started.elapsed() < queue_timeout =>
                {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }
}

impl<C: ClientContext + 'static> Deref for ReportingProducer<C> {
    type Target = BaseProducer<Reports<C>>;

    fn deref(&self) -> &Self::Target {
        &self.0.base
    }
}

impl<C: ClientContext + 'static> Drop for Inner<C> {
    fn drop(&mut self) {
        if let Some(queue) = &self.queue {
            // SAFETY: the queue is live. librdkafka calls back under the queue's lock, which
            // this takes too: once it returns, no callback runs or will run with `wake`.
            unsafe { rd::rd_kafka_queue_cb_event_enable(queue.0, None, std::ptr::null_mut()) };
        }
        self.wake.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // The thread's references are gone: this destroys the handle.
        drop(self.queue.take());
        // `base` goes next (the last reference now): it purges and flushes, serving the
        // reports itself.
    }
}

/// A message's delivery report, as rdkafka's `DeliveryFuture` gives it.
pub struct DeliveryFuture(oneshot::Receiver<OwnedDeliveryResult>);

impl DeliveryFuture {
    /// Whether the message was delivered, and if not why (`Canceled`: the producer was
    /// dropped first).
    pub async fn outcome(self) -> Result<(), KafkaError> {
        match self.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => Err(e),
            Err(_) => Err(KafkaError::Canceled),
        }
    }
}

impl Future for DeliveryFuture {
    type Output = Result<OwnedDeliveryResult, oneshot::Canceled>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

/// The producer's context: the client context `C`, and delivery reports sent to the
/// message's [`DeliveryFuture`].
pub struct Reports<C>(C);

impl<C: ClientContext + 'static> ClientContext for Reports<C> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = C::ENABLE_REFRESH_OAUTH_TOKEN;

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.0.log(level, fac, log_message);
    }

    fn stats(&self, statistics: Statistics) {
        self.0.stats(statistics);
    }

    fn stats_raw(&self, statistics: &[u8]) {
        self.0.stats_raw(statistics);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.0.error(error, reason);
    }

    fn generate_oauth_token(
        &self,
        oauthbearer_config: Option<&str>,
    ) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        self.0.generate_oauth_token(oauthbearer_config)
    }
}

impl<C: ClientContext + 'static> ProducerContext<NoCustomPartitioner> for Reports<C> {
    type DeliveryOpaque = Box<oneshot::Sender<OwnedDeliveryResult>>;

    fn delivery(&self, result: &DeliveryResult<'_>, tx: Self::DeliveryOpaque) {
        let owned = match result {
            Ok(message) => Ok(Delivery {
                partition: message.partition(),
                offset: message.offset(),
                timestamp: message.timestamp(),
            }),
            Err((error, message)) => Err((error.clone(), message.detach())),
        };
        // The future may be gone (its message was abandoned): nobody waits for the report.
        let _ = tx.send(owned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::sinks::kafka::KafkaContext;

    /// A producer whose broker refuses connections (a port nobody listens on).
    /// With the thread serving the queue unasked only every hour: a report served within the
    /// tests' patience was served on librdkafka's call-back.
    fn unreachable(message_timeout_ms: &str) -> ReportingProducer<KafkaContext> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", format!("127.0.0.1:{port}"))
            .set("message.timeout.ms", message_timeout_ms)
            .set("log_level", "0");
        let hour = Duration::from_secs(3600);
        ReportingProducer::serving_every(&config, KafkaContext::default(), hour).unwrap()
    }

    /// The failure `future` reports within `patience` (a report, not a dropped sender).
    async fn failed(
        future: DeliveryFuture,
        patience: Duration,
    ) -> (KafkaError, rdkafka::message::OwnedMessage) {
        tokio::time::timeout(patience, future)
            .await
            .expect("the report is served")
            .expect("reported, not dropped unreported")
            .expect_err("nobody took the message")
    }

    #[tokio::test]
    async fn the_thread_serves_each_report_to_its_own_future() {
        let producer = unreachable("300");
        let keys: Vec<String> = (0..50).map(|i| format!("key-{i}")).collect();
        let futures: Vec<DeliveryFuture> = keys
            .iter()
            .map(|k| {
                let record = FutureRecord::<String, String>::to("t").key(k).payload(k);
                producer.send_result(record).map_err(|(e, _)| e).unwrap()
            })
            .collect();
        for (key, future) in keys.iter().zip(futures) {
            let (error, message) = failed(future, Duration::from_secs(30)).await;
            assert_eq!(
                error.rdkafka_error_code(),
                Some(RDKafkaErrorCode::MessageTimedOut)
            );
            assert_eq!(
                message.key(),
                Some(key.as_bytes()),
                "the report of this message"
            );
        }
        let sent = producer.send(
            FutureRecord::<str, str>::to("t").key("one").payload("one"),
            Duration::ZERO,
        );
        let error = sent.await.expect_err("nobody took the message");
        assert_eq!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::MessageTimedOut)
        );
        tokio::task::spawn_blocking(move || drop(producer))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_dropped_producer_resolves_what_it_held_and_stops_its_thread() {
        let producer = unreachable("60000");
        let futures: Vec<DeliveryFuture> = (0..20)
            .map(|i| {
                let key = format!("k{i}");
                let record = FutureRecord::<String, String>::to("t").key(&key);
                producer.send_result(record).map_err(|(e, _)| e).unwrap()
            })
            .collect();
        // The thread holds the librdkafka producer until it ends; the last drop ends it.
        let base = Arc::downgrade(&producer.0.base);
        let clone = producer.clone();
        drop(producer);
        tokio::task::spawn_blocking(move || drop(clone))
            .await
            .unwrap();
        assert!(
            base.upgrade().is_none(),
            "the last drop joined the thread and dropped the producer"
        );
        for future in futures {
            // Purged by the drop, the report served by its flush.
            let (error, _) = failed(future, Duration::from_secs(10)).await;
            assert_eq!(
                error.rdkafka_error_code(),
                Some(RDKafkaErrorCode::PurgeQueue)
            );
        }
    }
}
