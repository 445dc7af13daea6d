//! Producing to Kafka with rdkafka (the sink's own `SinkProducer`, see `producer.rs`).
//!
//! # Contract
//! - A publish resolves once the message's delivery report arrived without error: with
//!   `enable.idempotence=true` and `acks=all`, every in-sync replica has it.
//! - Many messages are in flight at once (one per pipeline worker); librdkafka batches them.
//!   One object's messages are published one after another, so they reach their partition
//!   in order (same key, same partition).
//! - Errors are classified: retriable (local queue full, transport, leader not available,
//!   timeouts, unknown topic) or final (message too large, authorization, invalid topic).
//! - State mode: the value is the newest object; a delete is a tombstone (no value).
//!
//! # Recovery
//! librdkafka retries within `delivery_timeout`; after that the pipeline retries with its
//! backoff. A background task asks the brokers for metadata every 10 s: `/readyz` reports a
//! sink whose brokers did not answer.

use std::{
    borrow::Cow,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{FutureExt, future::BoxFuture};
use rdkafka::{
    admin::{AdminOptions, NewTopic, TopicReplication},
    error::{KafkaError, RDKafkaErrorCode},
    producer::Producer,
};
use tracing::{error, info, warn};

use super::{
    client::{KafkaClient, SinkProducer},
    config::{KafkaMode, KafkaSinkConfig, is_valid_topic},
    error::{classify, fatal},
    producer::{Headers, Record},
    record::{CheckpointRecord, record_of},
    transactions::TransactionSet,
};
use crate::{
    message::Message,
    sinks::{
        Ack, Error, Result, Sink,
        template::{Field, Template},
    },
};

/// How long start-up waits for the brokers' metadata.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// How often readiness asks the brokers for metadata.
const HEALTH_PERIOD: Duration = Duration::from_secs(10);

/// See the module docs.
pub struct KafkaSink {
    // Shared with each acknowledgement (named in the fatal error's log line).
    name: Arc<str>,
    /// What its clients are made from (the checkpoint store's and admin clients too).
    client: Arc<KafkaClient>,
    producer: SinkProducer,
    topic: Template,
    key: Option<Template>,
    headers: Vec<(String, String)>,
    mode: KafkaMode,
    max_message_bytes: usize,
    healthy: Arc<AtomicBool>,
    // Whether the producer's fatal error was logged (once).
    fatal_logged: Arc<AtomicBool>,
    brokers: String,
    // Where records go without `exactly_once` and without sharding: the producer above.
    lane: Arc<Lane>,
    // The lanes of the shard views (see `Sink::shard_view`), for shutdown and health.
    shard_lanes: Mutex<Vec<Arc<Lane>>>,
    // With `exactly_once`.
    transactions: Option<Arc<TransactionSet>>,
}

/// Where the records of a term go without `exactly_once`: the sink's own producer (one
/// leader), or a shard's own ([`KafkaShardSink`]), made when a term begins. A shard's
/// producer outlives its term while it still holds records (a purge leaves those already in
/// a request to a broker), and the next term here goes on with it: records of one partition
/// keep their order across the two terms, as with one producer (this replica may take its
/// own lease back at once, without a takeover wait). Once it holds nothing, it is dropped.
struct Lane {
    /// The producer; `None` between a shard's terms once the last one held nothing.
    producer: RwLock<Option<SinkProducer>>,
    /// Whether a term of the shard runs here (a shard lane's producer is dropped only
    /// between terms).
    in_term: AtomicBool,
    /// Why the last term could not start (its producer could not be made), for readiness.
    problem: Mutex<Option<String>>,
    /// Terms ended with their queue purged so far (see `abandon_queued`): a hand-over waiting
    /// for room in librdkafka's queue gives up when its term ends.
    ended: AtomicU64,
    /// Terms begun and ended so far (a shard's): a record handed over in one term is never
    /// sent in the next, even on the same producer.
    terms: AtomicU64,
    /// Held (shared) around each hand-over to librdkafka and (exclusive) around an
    /// abandonment's count and purge: a record is either purged with the count already
    /// raised, or sent after the purge (never purged by an abandonment its worker did not
    /// see counted, which would count the purge as a delivery failure).
    abandoning: RwLock<()>,
}

impl Lane {
    /// A lane with `producer` (the sink's own, always in a term), or none yet (a shard's).
    fn of(producer: Option<SinkProducer>) -> Self {
        Self {
            in_term: AtomicBool::new(producer.is_some()),
            producer: RwLock::new(producer),
            problem: Mutex::new(None),
            ended: AtomicU64::new(0),
            terms: AtomicU64::new(0),
            abandoning: RwLock::new(()),
        }
    }

    /// A clone of the producer, for blocking work (a clone dropped on an async thread may
    /// be the last one, whose drop blocks).
    fn producer(&self) -> Option<SinkProducer> {
        self.producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn has_producer(&self) -> bool {
        self.producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The fatal error of the producer, if it has one.
    fn fatal(&self) -> Option<String> {
        self.producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(fatal)
    }

    /// Counts a term's end and purges what the producer still queues (`rd_kafka_purge`;
    /// records already in a request to a broker cannot be taken back).
    fn abandon(&self) {
        let _abandoning = self.abandoning.write().unwrap_or_else(|e| e.into_inner());
        self.ended.fetch_add(1, Ordering::SeqCst);
        if let Some(producer) = self
            .producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            producer.purge(rdkafka::producer::PurgeConfig::default().queue());
        }
    }

    /// Drops the producer (off the async threads) if no term runs and it holds no record.
    fn drop_idle(&self) {
        let mut producer = self.producer.write().unwrap_or_else(|e| e.into_inner());
        if !self.in_term.load(Ordering::SeqCst)
            && producer.as_ref().is_some_and(|p| p.in_flight_count() == 0)
        {
            super::transactions::dispose(producer.take());
        }
    }

    /// A shard's term here ended: its producer goes once it holds nothing (looked at every
    /// 100 ms), unless the next term began meanwhile.
    fn end_term(self: &Arc<Self>) {
        self.terms.fetch_add(1, Ordering::SeqCst);
        self.in_term.store(false, Ordering::SeqCst);
        *self.problem.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.drop_idle();
        if !self.has_producer() {
            return;
        }
        let lane = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Some(lane) = lane.upgrade() else { return };
                lane.drop_idle();
                if lane.in_term.load(Ordering::SeqCst) || !lane.has_producer() {
                    return;
                }
            }
        });
    }
}

/// Topic names: placeholder values as they are, an empty group as `core`, the namespace of a
/// cluster-scoped object as `_`. Characters Kafka does not allow make the topic invalid (a
/// final error for that message), rather than being rewritten into another topic's name.
fn topic_value(field: Field, value: &str, out: &mut String) {
    match (field, value) {
        (Field::Group, "") => out.push_str("core"),
        (_, "") => out.push('_'),
        _ => out.push_str(value),
    }
}

impl KafkaSink {
    /// Creates the producer, checks that the brokers answer (so that bad addresses, TLS or
    /// SASL settings fail the start with a clear error), and starts the health task.
    pub async fn connect(name: &str, cfg: &KafkaSinkConfig) -> Result<Self> {
        let setup = |what: String| Error::Setup(format!("sink {name}: {what}"));
        let brokers = cfg.brokers.join(",");
        let client = KafkaClient::new(name, cfg).map_err(setup)?;
        // With OAUTHBEARER, the producer's creation asks the token endpoint for a token.
        let producer = tokio::task::spawn_blocking({
            let client = client.clone();
            move || client.producer()
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|made| made)
        .map_err(|e| setup(format!("{e} (brokers {brokers})")))?;
        if let Err(e) = fetch_metadata(&producer).await {
            // The metadata error is generic ("broker transport failure"); what librdkafka
            // reported meanwhile says why (authentication failed, certificate not trusted).
            let why = client
                .newest_error()
                .map(|e| format!("; the newest client error: {e}"))
                .unwrap_or_default();
            return Err(setup(format!(
                "cannot reach the Kafka brokers {brokers}: {e}{why}"
            )));
        }
        let healthy = Arc::new(AtomicBool::new(true));
        tokio::spawn(watch_health(
            name.to_owned(),
            producer.clone(),
            client.clone(),
            Arc::downgrade(&healthy),
        ));
        info!(sink = %name, brokers = %brokers, mode = ?cfg.mode, "Connected to Kafka");
        let max_message_bytes = cfg
            .properties
            .get("message.max.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1_000_000);
        Ok(Self {
            name: name.into(),
            client: Arc::new(client),
            topic: Template::parse(&cfg.topic).map_err(|e| setup(format!("topic: {e}")))?,
            key: cfg
                .key
                .as_deref()
                .map(Template::parse)
                .transpose()
                .map_err(|e| setup(format!("key: {e}")))?,
            headers: cfg
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            mode: cfg.mode,
            max_message_bytes,
            healthy,
            fatal_logged: Arc::default(),
            brokers,
            lane: Arc::new(Lane::of(Some(producer.clone()))),
            producer,
            shard_lanes: Mutex::default(),
            transactions: None,
        })
    }

    /// With `exactly_once` in `cfg`: publishes in transactions of `transactional.id`
    /// `kube-event-bridge.{cluster}.{sink}` (`.{shard}` added with sharding: one producer per
    /// shard; see [`super::transactions`]), counted in
    /// `metrics` (`keb_kafka_transactions_total`).
    pub fn with_transactions(
        mut self,
        cluster: &str,
        cfg: &KafkaSinkConfig,
        metrics: &crate::metrics::Metrics,
    ) -> Self {
        if cfg.exactly_once {
            let settings = super::transactions::Settings {
                sink: self.name.to_string(),
                client: (*self.client).clone(),
                checkpoint_topic: cfg.checkpoint_topic.clone(),
                interval: cfg.transaction_interval,
                timeout: cfg.transaction_timeout,
                max_message_bytes: self.max_message_bytes,
                outcomes: ["committed", "aborted"].map(|outcome| {
                    metrics
                        .kafka_transactions
                        .with_label_values(&[&*self.name, outcome])
                }),
                fenced: metrics
                    .kafka_producer_fenced
                    .with_label_values(&[&*self.name]),
            };
            self.transactions = Some(Arc::new(TransactionSet::new(settings, cluster.to_owned())));
        }
        self
    }

    /// The transactions, with `exactly_once` (for the checkpoint store's writes).
    pub(super) fn transactions(&self) -> Option<&Arc<TransactionSet>> {
        self.transactions.as_ref()
    }

    /// The sink's producer (idempotent, acks=all), shared with its checkpoint store.
    pub(super) fn producer(&self) -> &SinkProducer {
        &self.producer
    }

    /// What the sink's clients are made from, for its checkpoint store's.
    pub(super) fn client(&self) -> &KafkaClient {
        &self.client
    }

    /// The topic `message` goes to.
    pub fn topic_for(&self, message: &Message) -> String {
        self.topic.render(message, topic_value)
    }

    /// Whether the topic template uses `{namespace}`.
    pub fn topic_uses_namespace(&self) -> bool {
        self.topic.segments().iter().any(|s| {
            matches!(
                s,
                crate::sinks::template::Segment::Placeholder(Field::Namespace)
            )
        })
    }

    /// The topics messages about `resource` can go to, when that is known without objects:
    /// the template does not use `{namespace}`, or the resource lists its namespaces.
    /// `None` when topics depend on objects.
    pub fn topics_for(&self, sample: &Message, namespaces: &[String]) -> Option<Vec<String>> {
        let uses_namespace = self.topic.segments().iter().any(|s| {
            matches!(
                s,
                crate::sinks::template::Segment::Placeholder(Field::Namespace)
            )
        });
        if !uses_namespace {
            return Some(vec![self.topic_for(sample)]);
        }
        if namespaces.is_empty() {
            return None;
        }
        Some(
            namespaces
                .iter()
                .map(|ns| {
                    let mut m = sample.clone();
                    m.namespace = Some(ns.clone());
                    self.topic_for(&m)
                })
                .collect(),
        )
    }

    /// Creates the topics that do not exist yet (`cleanup.policy=compact` in state mode).
    pub async fn create_topics(
        &self,
        topics: &[String],
        partitions: i32,
        replication: i32,
    ) -> Result<()> {
        // With the sink's security settings: a broker that requires SASL or TLS refuses an
        // admin client without them.
        let admin = tokio::task::spawn_blocking({
            let client = Arc::clone(&self.client);
            move || client.admin()
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|made| made)
        .map_err(|e| Error::Setup(format!("sink {}: {e}", self.name)))?;
        let compact = self.mode == KafkaMode::State;
        let new: Vec<NewTopic> = topics
            .iter()
            .map(|t| {
                let topic = NewTopic::new(t, partitions, TopicReplication::Fixed(replication));
                if compact {
                    topic.set("cleanup.policy", "compact")
                } else {
                    topic
                }
            })
            .collect();
        let options = AdminOptions::new().operation_timeout(Some(METADATA_TIMEOUT));
        let results = admin.create_topics(&new, &options).await;
        super::client::close_later(admin);
        let results = results.map_err(|e| {
            Error::Setup(format!(
                "sink {}: cannot create topics {topics:?}: {e}",
                self.name
            ))
        })?;
        for r in results {
            match r {
                Ok(topic) => info!(sink = %self.name, topic, "Created topic"),
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => {
                    return Err(Error::Setup(format!(
                        "sink {}: cannot create topic {topic}: {code}",
                        self.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// See [`Sink::submit`]; with transactions, `checkpoint` goes in the message's transaction,
    /// the one of shard `shard` (a [`TransactionSet`] key); without, the record goes to
    /// `lane`'s producer.
    async fn hand_over(
        &self,
        m: &Message,
        checkpoint: Option<CheckpointRecord>,
        shard: &str,
        lane: &Arc<Lane>,
    ) -> Result<Ack> {
        let topic = self.topic_for(m);
        if !is_valid_topic(&topic) {
            return Err(Error::InvalidDestination {
                destination: topic,
                reason: "Kafka topics hold letters, digits, `.`, `_` and `-`, at most 249".into(),
            });
        }
        let key = self.key_for(m);
        let tombstone = self.mode == KafkaMode::State && m.payload.is_empty();
        let mut record = Record {
            topic: &topic,
            key: key.as_bytes(),
            // Shared with librdkafka until its report, not copied.
            payload: (!tombstone).then(|| m.payload.clone()),
            headers: self.headers_for(m),
        };
        let size = m.payload.len();
        let max = self.max_message_bytes;
        if let Some(set) = &self.transactions {
            let Some(t) = set.get(shard) else {
                return Err(Error::Aborted(format!(
                    "sink {}: no transaction open for this shard (not leading it)",
                    self.name
                )));
            };
            return t.submit(record, checkpoint, &topic, size).await;
        }
        let no_term = || {
            Error::Unavailable(format!(
                "sink {}: shard {shard} has no term here (not leading it)",
                self.name
            ))
        };
        let mut waited = Duration::ZERO;
        // The term it is handed over in: a record never goes in a later one (see `Lane`).
        let term = (
            lane.ended.load(Ordering::SeqCst),
            lane.terms.load(Ordering::SeqCst),
        );
        let delivery = loop {
            let sent = {
                let _sending = lane.abandoning.read().unwrap_or_else(|e| e.into_inner());
                // Under the lane's lock, never a clone: the producer is dropped only between
                // terms, by `drop_idle` (which takes it exclusively).
                let producer = lane.producer.read().unwrap_or_else(|e| e.into_inner());
                let current = (
                    lane.ended.load(Ordering::SeqCst),
                    lane.terms.load(Ordering::SeqCst),
                );
                match producer.as_ref() {
                    Some(p) if lane.in_term.load(Ordering::SeqCst) && current == term => {
                        p.send(record).map_err(|(e, r)| (e, r, fatal(p)))
                    }
                    _ if current != term => {
                        return Err(Error::Unavailable(
                            "the leadership term ended while waiting for room in the queue".into(),
                        ));
                    }
                    _ => return Err(no_term()),
                }
            };
            match sent {
                Ok(delivery) => break delivery,
                // The local queue is full: reports are on their way; wait for room, as
                // any producer must, but not forever.
                Err((e, r, _))
                    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull)
                        && waited < QUEUE_FULL_PATIENCE =>
                {
                    record = r;
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                    waited += QUEUE_FULL_PAUSE;
                }
                Err((_, _, Some(cause))) => return Err(Error::Unavailable(cause)),
                Err((e, _, None)) => return Err(classify(e, &topic, size, max)),
            }
        };
        let (name, logged, lane) = (self.name.clone(), self.fatal_logged.clone(), lane.clone());
        Ok(Box::pin(async move {
            match delivery.await {
                Ok(Ok(_)) => Ok(()),
                // A fatal error stops the producer for good: the message stays with the
                // route (retried, never lost) and readiness names the cause. (The lane's
                // producer, not a clone: a last clone dropped here would block this thread.)
                Ok(Err(_)) if let Some(cause) = lane.fatal() => {
                    if !logged.swap(true, Ordering::SeqCst) {
                        error!(sink = %name, cause = %cause, "The Kafka producer failed for good; nothing is published until the process restarts (readiness says so)");
                    }
                    Err(Error::Unavailable(cause))
                }
                Ok(Err((e, _))) => Err(classify(e, &topic, size, max)),
                Err(_) => Err(Error::Unavailable(
                    "the producer dropped the message".into(),
                )),
            }
        }) as Ack)
    }

    /// The shard views' lanes.
    fn shard_lanes(&self) -> Vec<Arc<Lane>> {
        self.shard_lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn key_for<'m>(&self, m: &'m Message) -> Cow<'m, str> {
        match &self.key {
            Some(t) => Cow::Owned(t.render(m, |_, v, out| out.push_str(v))),
            None => Cow::Borrowed(&m.key),
        }
    }

    fn headers_for(&self, m: &Message) -> Headers {
        let mut h = Headers::with_capacity(self.headers.len() + m.attributes.len() + 1);
        for (k, v) in &self.headers {
            h.add(k, v.as_bytes());
        }
        let content_type = if self.mode == KafkaMode::State {
            "application/json"
        } else {
            m.content_type
        };
        h.add("content-type", content_type.as_bytes());
        let mut name = String::with_capacity(32);
        for (attribute, value) in &m.attributes {
            name.clear();
            name.push_str("ce_");
            name.push_str(attribute);
            h.add(&name, value.as_bytes());
        }
        h
    }
}

/// Pause while librdkafka's local queue is full, and how long a record may wait for room
/// before its hand-over fails (and is retried through the work queue).
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(2);
const QUEUE_FULL_PATIENCE: Duration = Duration::from_secs(30);

/// Waits until `producer` has sent everything it holds (10 s at most).
async fn flush(producer: SinkProducer) -> Result<()> {
    tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(10)))
        .await
        .map_err(|e| Error::Unavailable(e.to_string()))?
        .map_err(|e| Error::Unavailable(e.to_string()))
}

async fn fetch_metadata(producer: &SinkProducer) -> std::result::Result<(), KafkaError> {
    let producer = producer.clone();
    tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(None, METADATA_TIMEOUT)
            .map(|_| ())
    })
    .await
    .unwrap_or(Err(KafkaError::Canceled))
}

async fn watch_health(
    name: String,
    producer: SinkProducer,
    client: KafkaClient,
    healthy: std::sync::Weak<AtomicBool>,
) {
    loop {
        tokio::time::sleep(HEALTH_PERIOD).await;
        let Some(flag) = healthy.upgrade() else {
            return;
        };
        let ok = match fetch_metadata(&producer).await {
            Ok(()) => true,
            Err(e) => {
                // As at start: what librdkafka reported meanwhile says why (a token refresh
                // refused, a certificate no longer trusted).
                let newest = client.newest_error().unwrap_or_default();
                warn!(sink = %name, error = %e, newest_client_error = %newest,
                      "Kafka brokers did not answer a metadata request");
                false
            }
        };
        flag.store(ok, Ordering::Relaxed);
    }
}

impl Sink for KafkaSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(self.max_message_bytes)
    }

    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<()>> {
        async move { self.submit(m).await?.await }.boxed()
    }

    /// Enqueues the record in librdkafka (waiting while its local queue is full) and returns
    /// its delivery report. With idempotence, records of one partition keep their order.
    fn submit<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<Ack>> {
        self.hand_over(m, None, "", &self.lane).boxed()
    }

    fn in_transactions(&self) -> bool {
        self.transactions.is_some()
    }

    fn submit_settling<'a>(
        &'a self,
        message: &'a Message,
        route: &'a str,
        change: Option<crate::sinks::checkpoint::Change>,
    ) -> BoxFuture<'a, Result<Ack>> {
        let record = change.map(|c| record_of(route, c));
        let shard = self
            .transactions
            .as_ref()
            .map_or("", |set| set.key_of_route(route));
        self.hand_over(message, record, shard, &self.lane).boxed()
    }

    fn settle_silently(&self, route: &str, change: crate::sinks::checkpoint::Change) {
        // Without the shard's term nothing is written: the next term resumes from the
        // checkpoint.
        if let Some(t) = self
            .transactions
            .as_ref()
            .and_then(|set| set.get(set.key_of_route(route)))
        {
            t.settle(record_of(route, change));
        }
    }

    fn begin_term(
        &self,
        shard: crate::shard::Shard,
        fence: Option<crate::leader::Fence>,
    ) -> BoxFuture<'_, Result<()>> {
        async move {
            match &self.transactions {
                Some(set) => set.of(shard).begin_term(fence).await,
                None => Ok(()),
            }
        }
        .boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<()>> {
        async move {
            for t in self.transactions.iter().flat_map(|set| set.all()) {
                t.commit().await?;
            }
            let lanes = self.shard_lanes();
            let producers = std::iter::once(self.producer.clone())
                .chain(lanes.iter().filter_map(|l| l.producer()));
            for producer in producers {
                flush(producer).await?;
            }
            Ok(())
        }
        .boxed()
    }

    /// Purges the records still in librdkafka's local queue (`rd_kafka_purge`; those already
    /// in a request to a broker cannot be taken back), the shard views' too (shutdown).
    fn abandoned(&self) -> u64 {
        self.lane.ended.load(Ordering::SeqCst)
    }

    fn abandon_queued(&self) {
        self.lane.abandon();
        self.shard_lanes().iter().for_each(|l| l.abandon());
    }

    fn shard_view(self: Arc<Self>, shard: crate::shard::Shard) -> Option<Arc<dyn Sink>> {
        let lane = Arc::new(Lane::of(None));
        self.shard_lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(lane.clone());
        Some(Arc::new(KafkaShardSink {
            sink: self,
            shard,
            key: TransactionSet::key(shard),
            lane,
        }))
    }

    fn end_term(&self, shard: crate::shard::Shard) {
        if let Some(t) = self
            .transactions
            .as_ref()
            .and_then(|set| set.get(&TransactionSet::key(shard)))
        {
            t.end_term();
        }
    }

    fn deposed(
        &self,
        shard: crate::shard::Shard,
        holder: &str,
        takeable_from: tokio::time::Instant,
    ) {
        if let Some(t) = self
            .transactions
            .as_ref()
            .and_then(|set| set.get(&TransactionSet::key(shard)))
        {
            t.deposed(holder, takeable_from);
        }
    }

    fn commit_term(&self, shard: crate::shard::Shard) -> BoxFuture<'_, Result<()>> {
        async move {
            match self
                .transactions
                .as_ref()
                .and_then(|set| set.get(&TransactionSet::key(shard)))
            {
                Some(t) => t.commit().await,
                None => Ok(()),
            }
        }
        .boxed()
    }

    fn end_terms(&self) {
        for t in self.transactions.iter().flat_map(|set| set.all()) {
            t.end_term();
        }
        self.shard_lanes().iter().for_each(|l| l.end_term());
    }

    fn broken(&self) -> Option<String> {
        if let Some(why) = self
            .transactions
            .iter()
            .flat_map(|set| set.all())
            .find_map(|t| t.broken())
        {
            return Some(why);
        }
        // Only the producers of running terms count: one kept past its term to drain is
        // dropped once it holds nothing.
        let lanes = self.shard_lanes();
        self.lane
            .fatal()
            .or_else(|| {
                lanes
                    .iter()
                    .filter(|l| l.in_term.load(Ordering::SeqCst))
                    .find_map(|l| l.fatal())
            })
            .map(|cause| {
                format!(
                    "sink {}: {cause}; it publishes nothing until the process restarts (what it \
                 holds is published again from the checkpoint after the restart)",
                    self.name
                )
            })
    }

    fn health(&self) -> std::result::Result<(), String> {
        if let Some(broken) = self.broken() {
            return Err(broken);
        }
        if let Some(problem) = self
            .shard_lanes()
            .iter()
            .find_map(|l| l.problem.lock().unwrap_or_else(|e| e.into_inner()).clone())
        {
            return Err(problem);
        }
        if let Some(problem) = self
            .transactions
            .iter()
            .flat_map(|set| set.all())
            .find_map(|t| t.problem())
        {
            return Err(problem);
        }
        if self.healthy.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err(format!(
                "sink {}: Kafka brokers {} did not answer the last metadata request",
                self.name, self.brokers
            ))
        }
    }
}

/// A Kafka sink as the routes of one shard use it (see [`Sink::shard_view`]). Without
/// `exactly_once`, each term of the shard publishes with an idempotent producer of its own,
/// made when the term begins and purged when it is abandoned, so a hand-over of one shard
/// never purges another's records; with `exactly_once`, the shard's transactions already are
/// its own, and so is what a dead-letter record goes in.
struct KafkaShardSink {
    sink: Arc<KafkaSink>,
    shard: crate::shard::Shard,
    /// The shard's [`TransactionSet`] key.
    key: String,
    lane: Arc<Lane>,
}

impl Sink for KafkaShardSink {
    fn name(&self) -> &str {
        self.sink.name()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        self.sink.max_message_bytes()
    }

    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<()>> {
        async move { self.submit(m).await?.await }.boxed()
    }

    fn submit<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<Ack>> {
        self.sink.hand_over(m, None, &self.key, &self.lane).boxed()
    }

    fn in_transactions(&self) -> bool {
        self.sink.in_transactions()
    }

    fn submit_settling<'a>(
        &'a self,
        message: &'a Message,
        route: &'a str,
        change: Option<crate::sinks::checkpoint::Change>,
    ) -> BoxFuture<'a, Result<Ack>> {
        if self.sink.in_transactions() {
            self.sink.submit_settling(message, route, change)
        } else {
            self.submit(message)
        }
    }

    fn settle_silently(&self, route: &str, change: crate::sinks::checkpoint::Change) {
        self.sink.settle_silently(route, change);
    }

    fn flush(&self) -> BoxFuture<'_, Result<()>> {
        async move {
            match self.lane.producer() {
                Some(producer) => flush(producer).await,
                None => Ok(()),
            }
        }
        .boxed()
    }

    fn abandoned(&self) -> u64 {
        self.lane.ended.load(Ordering::SeqCst)
    }

    fn abandon_queued(&self) {
        self.lane.abandon();
    }

    fn begin_term(
        &self,
        shard: crate::shard::Shard,
        fence: Option<crate::leader::Fence>,
    ) -> BoxFuture<'_, Result<()>> {
        debug_assert_eq!(shard, self.shard);
        async move {
            if self.sink.transactions.is_some() {
                return self.sink.begin_term(shard, fence).await;
            }
            // The last term's producer goes on while it holds records (see `Lane`).
            self.lane.terms.fetch_add(1, Ordering::SeqCst);
            self.lane.in_term.store(true, Ordering::SeqCst);
            if self.lane.has_producer() {
                return Ok(());
            }
            // With OAUTHBEARER, making a producer asks the token endpoint (blocking).
            let client = self.sink.client.clone();
            let made = tokio::task::spawn_blocking(move || client.producer())
                .await
                .map_err(|e| e.to_string())
                .and_then(|made| made)
                .map_err(|e| {
                    format!(
                        "sink {}: {}: cannot make the term's producer: {e}",
                        self.sink.name, self.shard
                    )
                });
            let mut problem = self.lane.problem.lock().unwrap_or_else(|e| e.into_inner());
            let producer = match made {
                Ok(producer) => producer,
                Err(why) => {
                    *problem = Some(why.clone());
                    return Err(Error::Unavailable(why));
                }
            };
            *problem = None;
            let mut current = self
                .lane
                .producer
                .write()
                .unwrap_or_else(|e| e.into_inner());
            // A term that ended meanwhile makes none (its end found nothing to drop).
            if self.lane.in_term.load(Ordering::SeqCst) && current.is_none() {
                *current = Some(producer);
            } else {
                super::transactions::dispose(Some(producer));
            }
            Ok(())
        }
        .boxed()
    }

    fn end_term(&self, shard: crate::shard::Shard) {
        self.sink.end_term(shard);
        self.lane.end_term();
    }

    fn deposed(
        &self,
        shard: crate::shard::Shard,
        holder: &str,
        takeable_from: tokio::time::Instant,
    ) {
        self.sink.deposed(shard, holder, takeable_from);
    }

    fn commit_term(&self, shard: crate::shard::Shard) -> BoxFuture<'_, Result<()>> {
        self.sink.commit_term(shard)
    }

    fn end_terms(&self) {
        self.end_term(self.shard);
    }

    fn broken(&self) -> Option<String> {
        self.sink.broken()
    }

    fn health(&self) -> std::result::Result<(), String> {
        self.sink.health()
    }
}
