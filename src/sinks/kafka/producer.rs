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
//! - [`send`](ReportingProducer::send) hands librdkafka a [`Record`]'s payload without a
//!   copy: the record's `Bytes` stay with the message's report until librdkafka reported it
//!   (rdkafka's `send` has librdkafka copy every payload, about a microsecond per 10 KB
//!   besides the allocation). Topics are named by handles made once per topic and kept
//!   until the producer goes (librdkafka keeps each topic it produced to anyway); a topic
//!   named by its string takes the client's write lock at each message.

use std::{
    collections::HashMap,
    ffi::{CString, c_void},
    ops::Deref,
    pin::Pin,
    sync::{Arc, Condvar, Mutex, RwLock},
    task::{Context, Poll},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use bytes::Bytes;
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
    /// The handle of each topic produced to so far, by name; destroyed before `base`.
    topics: RwLock<HashMap<Box<str>, Topic>>,
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

/// A topic handle of the producer (`rd_kafka_topic_new`).
struct Topic(*mut rd::rd_kafka_topic_t);

// SAFETY: librdkafka's topic handles may be used from any thread; the handle is destroyed
// once, in `Drop`, before the client.
unsafe impl Send for Topic {}
unsafe impl Sync for Topic {}

impl Drop for Topic {
    fn drop(&mut self) {
        // SAFETY: our own reference, taken by `rd_kafka_topic_new`; destroyed once. Messages
        // still queued hold references of their own.
        unsafe { rd::rd_kafka_topic_destroy(self.0) }
    }
}

/// A message to [`send`](ReportingProducer::send): its payload (none: a tombstone) goes to
/// librdkafka uncopied.
pub struct Record<'a> {
    pub topic: &'a str,
    pub key: &'a [u8],
    pub payload: Option<Bytes>,
    pub headers: Headers,
}

/// A message's headers, in librdkafka's own list (which takes them over with the message).
pub struct Headers(*mut rd::rd_kafka_headers_t);

// SAFETY: the list is only reached through `&mut self` or by value.
unsafe impl Send for Headers {}
unsafe impl Sync for Headers {}

impl Headers {
    /// An empty list with room for `capacity` headers (it grows beyond).
    pub fn with_capacity(capacity: usize) -> Self {
        // SAFETY: allocates a list (librdkafka aborts if it cannot).
        Self(unsafe { rd::rd_kafka_headers_new(capacity) })
    }

    /// Adds header `name` with `value` (both copied).
    pub fn add(&mut self, name: &str, value: &[u8]) {
        // SAFETY: the list is ours and writable (librdkafka refuses only read-only lists); the
        // name and value are read with their lengths, not up to a NUL.
        unsafe {
            rd::rd_kafka_header_add(
                self.0,
                name.as_ptr().cast(),
                name.len() as isize,
                value.as_ptr().cast(),
                value.len() as isize,
            );
        }
    }
}

impl Drop for Headers {
    fn drop(&mut self) {
        // SAFETY: ours (librdkafka's, once it took a message, is forgotten: see `send`).
        unsafe { rd::rd_kafka_headers_destroy(self.0) }
    }
}

/// What librdkafka holds of a message until its report: where the report goes, and the
/// payload librdkafka reads from without a copy.
pub struct Pending {
    tx: oneshot::Sender<OwnedDeliveryResult>,
    _payload: Option<Bytes>,
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
            topics: RwLock::default(),
            queue: Some(queue),
            wake,
            thread: Some(thread),
        })))
    }

    /// Sends `record`, its payload copied by librdkafka; if librdkafka does not take it (its
    /// queue is full, say), the error and the record are returned at once.
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
            delivery_opaque: Box::new(Pending { tx, _payload: None }),
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

    /// Sends `record` without copying its payload (see the module docs); if librdkafka does
    /// not take it (its queue is full, say), the error and the record are returned at once.
    #[allow(clippy::result_large_err)]
    pub fn send<'a>(&self, record: Record<'a>) -> Result<DeliveryFuture, (KafkaError, Record<'a>)> {
        let topic = match self.topic(record.topic) {
            Ok(topic) => topic,
            Err(e) => return Err((e, record)),
        };
        let (tx, rx) = oneshot::channel();
        let (ptr, len) = record
            .payload
            .as_ref()
            .map_or((std::ptr::null_mut(), 0), |p| {
                (p.as_ptr() as *mut c_void, p.len())
            });
        let Record {
            topic: name,
            key,
            payload,
            headers,
        } = record;
        let opaque = Box::into_raw(Box::new(Pending {
            tx,
            _payload: payload,
        }));
        let headers_ptr = headers.0;
        let vu = |vtype, u| rd::rd_kafka_vu_t { vtype, u };
        use rd::{rd_kafka_vtype_t as V, rd_kafka_vu_s__bindgen_ty_1 as U};
        let args = [
            vu(V::RD_KAFKA_VTYPE_RKT, U { rkt: topic }),
            // No `RD_KAFKA_MSG_F_COPY`: librdkafka reads the payload where it is.
            vu(V::RD_KAFKA_VTYPE_MSGFLAGS, U { i: 0 }),
            vu(
                V::RD_KAFKA_VTYPE_VALUE,
                U {
                    mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 { ptr, size: len },
                },
            ),
            vu(
                V::RD_KAFKA_VTYPE_KEY,
                U {
                    mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                        ptr: key.as_ptr() as *mut c_void,
                        size: key.len(),
                    },
                },
            ),
            vu(V::RD_KAFKA_VTYPE_OPAQUE, U { ptr: opaque.cast() }),
            vu(
                V::RD_KAFKA_VTYPE_HEADERS,
                U {
                    headers: headers_ptr,
                },
            ),
        ];
        // SAFETY: the client and the topic handle are live (the handle until `Inner::drop`);
        // the key and headers are read (or taken) before this returns; the payload lives in
        // `opaque` until the report hands `opaque` back (`Reports::delivery`), or is handed
        // back below if librdkafka did not take the message.
        let error = unsafe {
            rd::rd_kafka_produceva(self.0.base.client().native_ptr(), args.as_ptr(), args.len())
        };
        if error.is_null() {
            // librdkafka owns the headers now.
            std::mem::forget(headers);
            return Ok(DeliveryFuture(rx));
        }
        // SAFETY: librdkafka did not take the message: `opaque` and the headers are ours
        // again; `error` is ours to destroy.
        let (code, pending) = unsafe {
            let code = rd::rd_kafka_error_code(error);
            rd::rd_kafka_error_destroy(error);
            (code, Box::from_raw(opaque))
        };
        let record = Record {
            topic: name,
            key,
            payload: pending._payload,
            headers,
        };
        Err((KafkaError::MessageProduction(code.into()), record))
    }

    /// The handle of topic `name`, made at its first message.
    fn topic(&self, name: &str) -> KafkaResult<*mut rd::rd_kafka_topic_t> {
        let read = |topics: &HashMap<Box<str>, Topic>| topics.get(name).map(|t| t.0);
        if let Some(topic) = read(&self.0.topics.read().unwrap_or_else(|e| e.into_inner())) {
            return Ok(topic);
        }
        let mut topics = self.0.topics.write().unwrap_or_else(|e| e.into_inner());
        if let Some(topic) = read(&topics) {
            return Ok(topic);
        }
        let c_name = CString::new(name)?;
        // SAFETY: the client is live; a null configuration is the default one.
        let handle = unsafe {
            rd::rd_kafka_topic_new(
                self.0.base.client().native_ptr(),
                c_name.as_ptr(),
                std::ptr::null_mut(),
            )
        };
        if handle.is_null() {
            // SAFETY: reads this thread's last librdkafka error.
            let code = unsafe { rd::rd_kafka_last_error() };
            return Err(KafkaError::MessageProduction(code.into()));
        }
        topics.insert(name.into(), Topic(handle));
        Ok(handle)
    }
}

impl<C: ClientContext + 'static> ReportingProducer<C> {
    /// Sends `record` (its payload copied), waiting up to `queue_timeout` (in steps of 100
    /// ms) for room in librdkafka's queue, and awaits its delivery report.
    pub async fn send_copied<K, P>(
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
        // Before the client, as librdkafka wants.
        self.topics
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
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
    type DeliveryOpaque = Box<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Self::DeliveryOpaque) {
        let owned = match result {
            Ok(message) => Ok(Delivery {
                partition: message.partition(),
                offset: message.offset(),
                timestamp: message.timestamp(),
            }),
            Err((error, message)) => Err((error.clone(), message.detach())),
        };
        // The payload goes first, after `owned` copied it (an error's message): the sender
        // keeps its own share until the report reaches it, so the buffer is freed by the
        // thread that allocated it (mimalloc frees across threads by a slower path).
        let Pending { tx, _payload } = *pending;
        drop(_payload);
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
        let sent = producer.send_copied(
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

    /// Records sent uncopied to two topics: librdkafka reads each payload (and its key and
    /// headers) where the record left it until the report, whose message still has them
    /// after the sender dropped its own reference; a record librdkafka does not take (its
    /// queue full) comes back whole.
    #[tokio::test]
    async fn an_uncopied_payload_stays_until_its_report() {
        let producer = unreachable("300");
        let sent: Vec<(String, Bytes, DeliveryFuture)> = (0..10)
            .map(|i| {
                let topic = ["t", "u"][i % 2];
                let payload = Bytes::from(vec![i as u8; 10_000 + i]);
                let mut headers = Headers::with_capacity(1);
                headers.add("content-type", b"application/json");
                let key = format!("key-{i}");
                let record = Record {
                    topic,
                    key: key.as_bytes(),
                    payload: Some(payload.clone()),
                    headers,
                };
                let future = producer.send(record).map_err(|(e, _)| e).unwrap();
                (key, payload, future)
            })
            .collect();
        assert_eq!(
            producer.0.topics.read().unwrap().len(),
            2,
            "a handle per topic"
        );
        for (key, payload, future) in sent {
            let expected = payload.to_vec();
            drop(payload);
            let (error, message) = failed(future, Duration::from_secs(30)).await;
            assert_eq!(
                error.rdkafka_error_code(),
                Some(RDKafkaErrorCode::MessageTimedOut)
            );
            assert_eq!(message.key(), Some(key.as_bytes()));
            assert_eq!(
                message.payload(),
                Some(&expected[..]),
                "the payload, intact"
            );
            let headers = message.headers().expect("its headers");
            let header = rdkafka::message::Headers::get(headers, 0);
            assert_eq!(
                (header.key, header.value),
                ("content-type", Some(&b"application/json"[..]))
            );
        }
        tokio::task::spawn_blocking(move || drop(producer))
            .await
            .unwrap();

        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", "127.0.0.1:9")
            .set("queue.buffering.max.messages", "1")
            .set("log_level", "0");
        let producer: ReportingProducer<KafkaContext> =
            ReportingProducer::create(&config, KafkaContext::default()).unwrap();
        let record = |payload: &'static [u8]| Record {
            topic: "t",
            key: b"k",
            payload: Some(Bytes::from_static(payload)),
            headers: Headers::with_capacity(0),
        };
        let _first = producer.send(record(b"first")).map_err(|(e, _)| e).unwrap();
        let (error, back) = producer
            .send(record(b"second"))
            .err()
            .expect("a full queue");
        assert_eq!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::QueueFull)
        );
        assert_eq!(
            (back.topic, back.key, back.payload.as_deref()),
            ("t", &b"k"[..], Some(&b"second"[..]))
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
