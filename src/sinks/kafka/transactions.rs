//! Exactly-once into Kafka (`exactly_once: true`): the sink's messages, and the checkpoint
//! records of exactly those messages, are written by one transactional producer and committed
//! together every `transaction_interval`.
//!
//! # Contract
//! - **One producer per term.** [`Transactions::begin_term`] makes the term's producer
//!   (`transactional.id` the same on every replica) and `init_transactions` fences every
//!   earlier producer of that id: a deposed leader's open transaction is aborted, and its
//!   later commits are refused. Only `begin_term` makes one (a standby never calls it: it
//!   would fence the leader); [`Transactions::end_term`] drops it.
//! - **Acknowledged means committed.** A message's acknowledgement resolves when its
//!   transaction commits; a `read_committed` reader sees the message and its checkpoint record
//!   together or neither. So a new leader (or a restart) that loads the checkpoint after its
//!   `init_transactions` resumes exactly after the last committed message.
//! - **An abort sends again.** When a record of the transaction fails, its own checkpoint
//!   record cannot be produced, or the broker asks for an abort, the transaction is aborted
//!   and every acknowledgement in it fails: a record's own error as itself, the others as
//!   [`Error::Unavailable`] counted in [`Transactions::aborts`] (the pipeline retries them
//!   without counting a retry). Checkpoint records without a message
//!   ([`Transactions::settle`]) are written again first in the next one.
//! - **An unknown outcome stops the term.** A commit that neither succeeded nor was aborted
//!   (fenced by a newer producer, a fatal producer error, a commit call that timed out) may
//!   have been committed: sending its messages again would duplicate them. Its
//!   acknowledgements fail, the producer goes, and nothing is produced until the next
//!   `begin_term`, which resumes from the checkpoint; without leader election `/healthz`
//!   fails ([`Transactions::broken`]) so the pod restarts.
//! - **Order.** Records are produced under the state lock, a message's checkpoint record right
//!   after it, and every record of a term by one producer: a key's records keep their order
//!   in the checkpoint topic. A commit holds the gate exclusively: nothing is produced between
//!   its flush and the next `begin_transaction`.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{StreamExt, future::BoxFuture, stream::FuturesUnordered};
use rdkafka::{
    error::{KafkaError, RDKafkaErrorCode},
    producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer},
};
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::{
    client::{KafkaClient, KafkaContext},
    sink::classify,
};
use crate::sinks::{Ack, Error, Result};

/// How long `init_transactions`, a commit and an abort may take.
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a commit or an abort the brokers answer with a retriable error (a timeout, no
/// coordinator) is tried again.
const RETRY_FOR: Duration = Duration::from_secs(120);

/// A delivery awaited at a commit: the index of its message (`None`: a checkpoint record
/// without one), whether it is the message itself, and its result.
type Waiting = BoxFuture<'static, (Option<usize>, bool, std::result::Result<(), KafkaError>)>;

/// A checkpoint record: key, and value (`None`: a tombstone).
pub(super) type CheckpointRecord = (String, Option<String>);

/// See the module docs.
pub(super) struct Transactions {
    sink: String,
    id: String,
    client: KafkaClient,
    checkpoint_topic: String,
    interval: Duration,
    timeout: Duration,
    max_message_bytes: usize,
    // Shared by hand-overs, exclusive for a commit (and a term's start).
    gate: tokio::sync::RwLock<()>,
    state: Mutex<State>,
    // Why transactions fail now (readiness), cleared by the next commit and a term's end.
    problem: Mutex<Option<String>>,
    // Transactions aborted so far (see `aborts`).
    aborted: AtomicU64,
    // Transactions committed and aborted (`keb_kafka_transactions_total`).
    outcomes: [prometheus::IntCounter; 2],
}

#[derive(Default)]
struct State {
    producer: Option<FutureProducer<KafkaContext>>,
    // A term is on (between `begin_term` and `end_term`).
    wanted: bool,
    // Why nothing may be produced until the next term (see "An unknown outcome").
    broken: Option<String>,
    // Why the open transaction must be aborted (a message's checkpoint record could not be
    // produced after it).
    poisoned: Option<String>,
    // Messages of the open transaction.
    open: Vec<Handed>,
    // Checkpoint records without a message, in the open transaction.
    silent: Vec<(CheckpointRecord, DeliveryFuture)>,
    // Checkpoint records without a message not produced yet: before anything else is.
    backlog: VecDeque<CheckpointRecord>,
}

/// A message of the open transaction.
struct Handed {
    delivery: DeliveryFuture,
    checkpoint: Option<DeliveryFuture>,
    done: oneshot::Sender<Result<()>>,
    // For the classification of its error.
    topic: String,
    size: usize,
}

/// How a commit attempt ended.
enum Outcome {
    Committed,
    /// Aborted: nothing of it is visible; its messages may go again.
    Aborted(String),
    /// Maybe committed: nothing may go again in this term.
    Unknown(String),
}

impl Transactions {
    /// The transactions of sink `sink`; the commit task runs while the returned value lives.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        sink: &str,
        id: String,
        client: KafkaClient,
        checkpoint_topic: String,
        interval: Duration,
        timeout: Duration,
        max_message_bytes: usize,
        outcomes: [prometheus::IntCounter; 2],
    ) -> Arc<Self> {
        let this = Arc::new(Self {
            sink: sink.to_owned(),
            id,
            client,
            checkpoint_topic,
            interval,
            timeout,
            max_message_bytes,
            gate: tokio::sync::RwLock::new(()),
            state: Mutex::default(),
            problem: Mutex::default(),
            aborted: AtomicU64::new(0),
            outcomes,
        });
        tokio::spawn(commit_every_interval(Arc::downgrade(&this)));
        this
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_problem(&self, problem: Option<String>) {
        *self.problem.lock().unwrap_or_else(|e| e.into_inner()) = problem;
    }

    /// Why transactions fail now, if they do (for `/readyz`).
    pub(super) fn problem(&self) -> Option<String> {
        self.problem
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Why nothing can be published until the next term (for `/healthz`), if so.
    pub(super) fn broken(&self) -> Option<String> {
        self.lock().broken.clone()
    }

    /// Transactions aborted so far: a failure of a message after it changed may be the abort,
    /// not the message's own (see [`crate::sinks::Sink::abandoned`]).
    pub(super) fn aborts(&self) -> u64 {
        self.aborted.load(Ordering::SeqCst)
    }

    /// A term begins: what the last one held fails, and this term's producer is made (fencing
    /// every earlier producer of the id). On an error nothing is produced; the caller tries
    /// again while the term lasts.
    pub(super) async fn begin_term(&self) -> Result<()> {
        let _closed = self.gate.write().await;
        let old = {
            let mut st = self.lock();
            fail_all(&mut st, "a new leadership term began");
            st.wanted = true;
            st.broken = None;
            st.poisoned = None;
            st.producer.take()
        };
        dispose(old);
        let (client, id, timeout) = (self.client.clone(), self.id.clone(), self.timeout);
        let made = tokio::task::spawn_blocking(move || {
            let producer = client.transactional_producer(&id, timeout)?;
            let started = producer
                .init_transactions(CALL_TIMEOUT)
                .map_err(|e| format!("init_transactions: {e}{}", acl_hint(&e)))
                .and_then(|()| {
                    producer
                        .begin_transaction()
                        .map_err(|e| format!("begin_transaction: {e}"))
                });
            match started {
                Ok(()) => Ok(producer),
                Err(e) => {
                    drop(producer);
                    Err(e)
                }
            }
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|made| made);
        match made {
            Ok(producer) => {
                let mut st = self.lock();
                if !st.wanted {
                    // The term ended meanwhile.
                    drop(st);
                    dispose(Some(producer));
                    return Err(Error::Unavailable("the leadership term ended".into()));
                }
                st.producer = Some(producer);
                drop(st);
                self.set_problem(None);
                info!(sink = %self.sink, transactional_id = %self.id, "Transactions on: earlier producers of this transactional.id are fenced");
                Ok(())
            }
            Err(e) => {
                let why = format!(
                    "sink {}: cannot start transactions (transactional.id {}): {e}",
                    self.sink, self.id
                );
                self.set_problem(Some(why.clone()));
                Err(Error::Unavailable(why))
            }
        }
    }

    /// The term ended: what it holds fails and its producer goes.
    pub(super) fn end_term(&self) {
        let old = {
            let mut st = self.lock();
            st.wanted = false;
            st.broken = None;
            st.poisoned = None;
            fail_all(&mut st, "the leadership term ended");
            st.producer.take()
        };
        dispose(old);
        self.set_problem(None);
    }

    /// Hands `record` to the open transaction with its checkpoint record, and returns the
    /// acknowledgement, which resolves at the commit.
    pub(super) async fn submit<K, P>(
        &self,
        record: FutureRecord<'_, K, P>,
        checkpoint: Option<CheckpointRecord>,
        topic: &str,
        size: usize,
    ) -> Result<Ack>
    where
        K: rdkafka::message::ToBytes + ?Sized,
        P: rdkafka::message::ToBytes + ?Sized,
    {
        let _open = self.gate.read().await;
        let mut st = self.lock();
        let Some(producer) = st.producer.clone().filter(|_| st.broken.is_none()) else {
            return Err(Error::Unavailable(self.no_producer(&st)));
        };
        self.produce_backlog(&producer, &mut st)?;
        let delivery = match producer.send_result(record) {
            Ok(delivery) => delivery,
            Err((e, _)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull) => {
                return Err(Error::Unavailable("the producer's queue is full".into()));
            }
            Err((e, _)) => return Err(classify(e, topic, size, self.max_message_bytes)),
        };
        let checkpoint = match checkpoint {
            None => None,
            Some(record) => match self.send_checkpoint(&producer, &record) {
                Ok(delivery) => Some(delivery),
                // The message is in the transaction without its record: it must not commit.
                Err(e) => {
                    st.poisoned.get_or_insert_with(|| {
                        format!("a message's checkpoint record could not be produced: {e}")
                    });
                    None
                }
            },
        };
        let (done, acknowledged) = oneshot::channel();
        st.open.push(Handed {
            delivery,
            checkpoint,
            done,
            topic: topic.to_owned(),
            size,
        });
        Ok(Box::pin(async move {
            acknowledged.await.unwrap_or_else(|_| {
                Err(Error::Unavailable(
                    "the transaction was dropped before its commit".into(),
                ))
            })
        }) as Ack)
    }

    /// Writes a checkpoint record without a message in the open transaction (or the next,
    /// before anything else).
    pub(super) fn settle(&self, record: CheckpointRecord) {
        let Ok(_open) = self.gate.try_read() else {
            self.lock().backlog.push_back(record);
            return;
        };
        let mut st = self.lock();
        let producer = match st.producer.clone() {
            Some(p) if st.backlog.is_empty() && st.broken.is_none() => p,
            _ => {
                st.backlog.push_back(record);
                return;
            }
        };
        match self.send_checkpoint(&producer, &record) {
            Ok(delivery) => st.silent.push((record, delivery)),
            Err(_) => st.backlog.push_back(record),
        }
    }

    fn no_producer(&self, st: &State) -> String {
        st.broken
            .clone()
            .or_else(|| self.problem())
            .unwrap_or_else(|| format!("sink {}: no transaction open (not leading)", self.sink))
    }

    fn send_checkpoint(
        &self,
        producer: &FutureProducer<KafkaContext>,
        (key, value): &CheckpointRecord,
    ) -> std::result::Result<DeliveryFuture, KafkaError> {
        let mut record = FutureRecord::<String, String>::to(&self.checkpoint_topic).key(key);
        if let Some(v) = value {
            record = record.payload(v);
        }
        producer.send_result(record).map_err(|(e, _)| e)
    }

    /// Produces the backlog (the state locked, the gate held).
    fn produce_backlog(
        &self,
        producer: &FutureProducer<KafkaContext>,
        st: &mut State,
    ) -> Result<()> {
        while let Some(record) = st.backlog.pop_front() {
            match self.send_checkpoint(producer, &record) {
                Ok(delivery) => st.silent.push((record, delivery)),
                Err(e) => {
                    st.backlog.push_front(record);
                    return Err(Error::Unavailable(format!(
                        "checkpoint records wait for room in the producer: {e}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Commits the open transaction (every interval, and at shutdown); an error says it was
    /// not committed.
    pub(super) async fn commit(&self) -> Result<()> {
        let _closed = self.gate.write().await;
        let (producer, open, silent, poisoned) = {
            let mut st = self.lock();
            let Some(producer) = st.producer.clone().filter(|_| st.broken.is_none()) else {
                return match &st.broken {
                    Some(why) => Err(Error::Unavailable(why.clone())),
                    None => Ok(()),
                };
            };
            if st.open.is_empty() && st.silent.is_empty() && st.backlog.is_empty() {
                return Ok(());
            }
            // On failure committed with the next: room comes as the records in flight are
            // stored.
            self.produce_backlog(&producer, &mut st)?;
            (
                producer,
                std::mem::take(&mut st.open),
                std::mem::take(&mut st.silent),
                st.poisoned.take(),
            )
        };
        // Every record's delivery first (a commit flushes them anyway, and a failed one names
        // the cause); at the first failure the transaction is aborted at once, which fails
        // the records still waiting (librdkafka would hold them until their timeout).
        let mut waiting = FuturesUnordered::new();
        let mut results = Vec::with_capacity(open.len());
        for (i, h) in open.into_iter().enumerate() {
            waiting.push(
                Box::pin(async move { (Some(i), true, delivered(h.delivery).await) }) as Waiting,
            );
            if let Some(d) = h.checkpoint {
                waiting.push(Box::pin(
                    async move { (Some(i), false, delivered(d).await) },
                ));
            }
            results.push((h.done, Ok(()), h.topic, h.size));
        }
        let mut silent_records = Vec::with_capacity(silent.len());
        for (record, delivery) in silent {
            waiting.push(Box::pin(
                async move { (None, false, delivered(delivery).await) },
            ));
            silent_records.push(record);
        }
        let mut failed = poisoned;
        let mut aborting = None;
        while let Some((i, message, result)) = waiting.next().await {
            let Err(e) = result else { continue };
            if failed.is_none() {
                failed = Some(match i.filter(|_| message) {
                    Some(i) => format!("a message to {} failed: {e}", results[i].2),
                    None => format!(
                        "a checkpoint record of {} failed: {e}",
                        self.checkpoint_topic
                    ),
                });
            }
            if let (Some(i), true) = (i, message) {
                results[i].1 = Err(e);
            }
            if aborting.is_none()
                && let Some(why) = failed.clone()
            {
                aborting = Some(self.abort_in_background(&producer, why));
            }
        }
        if aborting.is_none()
            && let Some(why) = failed.clone()
        {
            aborting = Some(self.abort_in_background(&producer, why));
        }
        let outcome = match aborting {
            Some(aborted) => aborted
                .await
                .unwrap_or_else(|e| Outcome::Unknown(format!("the abort task failed: {e}"))),
            None => self.try_commit(&producer).await,
        };
        let result = match outcome {
            Outcome::Committed => {
                self.outcomes[0].inc();
                for (done, _, _, _) in results {
                    let _ = done.send(Ok(()));
                }
                self.set_problem(None);
                let st = self.lock();
                if let Some(p) = st.producer.as_ref().filter(|p| same(p, &producer))
                    && let Err(e) = p.begin_transaction()
                {
                    drop(st);
                    self.stop(&producer, format!("begin_transaction failed: {e}"));
                }
                Ok(())
            }
            Outcome::Aborted(why) => {
                self.outcomes[1].inc();
                // Counted before the acknowledgements fail: their workers see it changed.
                self.aborted.fetch_add(1, Ordering::SeqCst);
                warn!(sink = %self.sink, error = %why, messages = results.len(), "Transaction aborted; its messages are sent again");
                let reason = format!("sink {}: transaction aborted: {why}", self.sink);
                for (done, own, topic, size) in results {
                    // A message's own error is its answer (too large, denied: final; a
                    // missing topic: retried with its backoff); every other message of the
                    // transaction is sent again.
                    let err = match own {
                        Err(e) => classify(e, &topic, size, self.max_message_bytes),
                        Ok(()) => Error::Unavailable(reason.clone()),
                    };
                    let _ = done.send(Err(err));
                }
                self.set_problem(Some(reason.clone()));
                let mut st = self.lock();
                if st.producer.as_ref().is_some_and(|p| same(p, &producer)) {
                    // Written again first, in the next transaction (the gate is still held:
                    // before anything settled after this).
                    for record in silent_records.into_iter().rev() {
                        st.backlog.push_front(record);
                    }
                    if let Err(e) = st.producer.as_ref().expect("checked").begin_transaction() {
                        drop(st);
                        self.stop(&producer, format!("begin_transaction failed: {e}"));
                    }
                }
                Err(Error::Unavailable(reason))
            }
            Outcome::Unknown(why) => {
                self.outcomes[1].inc();
                self.aborted.fetch_add(1, Ordering::SeqCst);
                let reason = format!(
                    "sink {}: a transaction may or may not have been committed ({why}); \
                     nothing is published until the next term resumes from the checkpoint",
                    self.sink
                );
                for (done, _, _, _) in results {
                    let _ = done.send(Err(Error::Unavailable(reason.clone())));
                }
                self.stop(&producer, reason.clone());
                Err(Error::Unavailable(reason))
            }
        };
        dispose(Some(producer));
        result
    }

    /// Commits, trying a retriable failure again (a commit that timed out may only be
    /// retried: its outcome is the coordinator's); an abortable one is aborted.
    async fn try_commit(&self, producer: &FutureProducer<KafkaContext>) -> Outcome {
        match retrying(&self.sink, "commit", producer, |p| {
            p.commit_transaction(CALL_TIMEOUT)
        })
        .await
        {
            Ok(()) => Outcome::Committed,
            Err(ref e @ KafkaError::Transaction(ref r)) if r.txn_requires_abort() => {
                self.abort(producer, format!("commit: {e}")).await
            }
            Err(e) => Outcome::Unknown(format!("commit: {e}")),
        }
    }

    /// Aborts the open transaction (nothing of it was committed: a commit was not asked for,
    /// or the broker asked for the abort).
    async fn abort(&self, producer: &FutureProducer<KafkaContext>, why: String) -> Outcome {
        self.abort_in_background(producer, why)
            .await
            .unwrap_or_else(|e| Outcome::Unknown(format!("the abort task failed: {e}")))
    }

    /// [`Self::abort`] as a task, started now (what it purges fails meanwhile).
    fn abort_in_background(
        &self,
        producer: &FutureProducer<KafkaContext>,
        why: String,
    ) -> tokio::task::JoinHandle<Outcome> {
        let (sink, p) = (self.sink.clone(), producer.clone());
        tokio::spawn(async move {
            match retrying(&sink, "abort", &p, |p| p.abort_transaction(CALL_TIMEOUT)).await {
                Ok(()) => Outcome::Aborted(why),
                // Not committed, but the producer cannot go on (fenced, fatal): nothing of the
                // transaction is visible, yet the term stops as for an unknown outcome.
                Err(e) => Outcome::Unknown(format!("{why}; the abort failed: {e}")),
            }
        })
    }

    /// Stops publishing until the next term: `producer` (if still the term's) goes.
    fn stop(&self, producer: &FutureProducer<KafkaContext>, why: String) {
        let fenced = producer.client().fatal_error().is_some();
        error!(sink = %self.sink, transactional_id = %self.id, fenced, error = %why, "Transactions stopped; nothing is published until the next term (or the restart /healthz asks for)");
        let mut st = self.lock();
        if st.producer.as_ref().is_some_and(|p| same(p, producer)) {
            let old = st.producer.take();
            st.broken = Some(why.clone());
            drop(st);
            dispose(old);
        }
        self.set_problem(Some(why));
    }
}

/// Calls `call` (a commit or an abort) on a blocking thread until it succeeds, fails other
/// than retriably, or [`RETRY_FOR`] has passed (brokers down: the gate stays closed, so
/// hand-overs wait meanwhile).
async fn retrying(
    sink: &str,
    what: &str,
    producer: &FutureProducer<KafkaContext>,
    call: fn(&FutureProducer<KafkaContext>) -> rdkafka::error::KafkaResult<()>,
) -> std::result::Result<(), KafkaError> {
    let deadline = tokio::time::Instant::now() + RETRY_FOR;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let p = producer.clone();
        let result = tokio::task::spawn_blocking(move || call(&p))
            .await
            .unwrap_or(Err(KafkaError::Canceled));
        match result {
            Err(KafkaError::Transaction(ref r))
                if r.is_retriable() && !r.is_fatal() && tokio::time::Instant::now() < deadline =>
            {
                if attempt == 1 {
                    warn!(sink, error = %KafkaError::Transaction(r.clone()), "Transaction {what} failed; trying it again");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            other => return other,
        }
    }
}

/// A delivery report's result.
async fn delivered(delivery: DeliveryFuture) -> std::result::Result<(), KafkaError> {
    match delivery.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(e),
        Err(_) => Err(KafkaError::Canceled),
    }
}

/// Fails what `st` holds, and forgets its checkpoint records (the next term resumes from the
/// checkpoint).
fn fail_all(st: &mut State, why: &str) {
    for h in st.open.drain(..) {
        let _ = h.done.send(Err(Error::Unavailable(why.to_owned())));
    }
    st.silent.clear();
    st.backlog.clear();
}

/// Drops a producer off the async threads (a last drop purges, flushes for up to 500 ms and
/// joins its polling thread).
fn dispose(producer: Option<FutureProducer<KafkaContext>>) {
    if let Some(p) = producer {
        tokio::task::spawn_blocking(move || drop(p));
    }
}

fn same(a: &FutureProducer<KafkaContext>, b: &FutureProducer<KafkaContext>) -> bool {
    a.client().native_ptr() == b.client().native_ptr()
}

async fn commit_every_interval(this: Weak<Transactions>) {
    let Some(interval) = this.upgrade().map(|t| t.interval) else {
        return;
    };
    loop {
        tokio::time::sleep(interval).await;
        let Some(t) = this.upgrade() else {
            return;
        };
        // A failure is logged and answered where it happens.
        let _ = t.commit().await;
    }
}

fn acl_hint(e: &KafkaError) -> &'static str {
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::TransactionalIdAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed,
        ) => " (grant this principal WRITE and DESCRIBE on the transactional id)",
        _ => "",
    }
}
