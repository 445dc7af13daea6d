//! Exactly-once into Kafka (`exactly_once: true`): the sink's messages, and the checkpoint
//! records of exactly those messages, are written by one transactional producer and committed
//! together every `transaction_interval`.
//!
//! # Contract
//! - **One producer per term.** [`Transactions::begin_term`] makes the term's producer
//!   (`transactional.id` the same on every replica) and `init_transactions` fences every
//!   earlier producer of that id: a deposed leader's open transaction is aborted, and its
//!   later commits are refused. A standby never makes one (it would fence the leader).
//!   [`Transactions::end_term`] drops it.
//! - **Acknowledged means committed.** A message's acknowledgement resolves when its
//!   transaction commits; a `read_committed` reader sees the message and its checkpoint record
//!   together or neither. So a new leader (or a restart) that loads the checkpoint after its
//!   `init_transactions` resumes exactly after the last committed message: nothing is sent
//!   twice, nothing lost.
//! - **An abort sends again.** When a record of the transaction fails or the commit fails, the
//!   transaction is aborted and every acknowledgement in it fails (a record's own final error,
//!   such as too large, as itself; the others as unavailable): the pipeline sends them again
//!   in the next one. Checkpoint records without a message ([`Transactions::settle`]) are
//!   written again first.
//! - **Fenced is final for the term.** A producer fenced by a newer one (another replica
//!   leads) fails what it holds and is not made again until the next term: making it again
//!   would fence the leader back.
//! - **Order.** Records are produced under the state lock, a key's checkpoint records after
//!   its message and every record of a term in one producer: a key's records keep their order
//!   in the checkpoint topic. A commit holds the gate exclusively: nothing is produced between
//!   its flush and the next `begin_transaction`.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

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
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a term whose producer failed tries to make it again.
const REMAKE_PERIOD: Duration = Duration::from_secs(1);

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
    // Why transactions fail now (readiness), cleared by the next commit.
    problem: Mutex<Option<String>>,
}

#[derive(Default)]
struct State {
    producer: Option<FutureProducer<KafkaContext>>,
    // A term is on: a producer lost to an error is made again (unless fenced).
    wanted: bool,
    // Fenced by a newer producer in this term.
    fenced: bool,
    // When a producer was last made (or tried).
    made_at: Option<tokio::time::Instant>,
    // Messages of the open transaction.
    open: Vec<Handed>,
    // Checkpoint records without a message, in the open transaction.
    silent: Vec<(CheckpointRecord, DeliveryFuture)>,
    // Checkpoint records not produced yet: before anything else is.
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

impl Transactions {
    /// The transactions of sink `sink`; the commit task runs while the returned value lives.
    pub(super) fn new(
        sink: &str,
        id: String,
        client: KafkaClient,
        checkpoint_topic: String,
        interval: Duration,
        timeout: Duration,
        max_message_bytes: usize,
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

    /// A term begins: what the last one held fails, and this term's producer is made (fencing
    /// every earlier producer of the id). An error leaves the commit task trying again.
    pub(super) async fn begin_term(&self) -> Result<()> {
        let _closed = self.gate.write().await;
        let old = {
            let mut st = self.lock();
            fail_all(&mut st, "a new leadership term began");
            st.wanted = true;
            st.fenced = false;
            st.producer.take()
        };
        dispose(old);
        self.make().await
    }

    /// The term ended: what it holds fails and its producer goes.
    pub(super) fn end_term(&self) {
        let old = {
            let mut st = self.lock();
            st.wanted = false;
            fail_all(&mut st, "the leadership term ended");
            st.producer.take()
        };
        dispose(old);
    }

    /// Makes the term's producer (the gate held exclusively).
    async fn make(&self) -> Result<()> {
        self.lock().made_at = Some(tokio::time::Instant::now());
        let (client, id, timeout) = (self.client.clone(), self.id.clone(), self.timeout);
        let made = tokio::task::spawn_blocking(move || {
            let producer = client.transactional_producer(&id, timeout)?;
            producer
                .init_transactions(CALL_TIMEOUT)
                .map_err(|e| format!("init_transactions: {e}{}", acl_hint(&e)))?;
            producer
                .begin_transaction()
                .map_err(|e| format!("begin_transaction: {e}"))?;
            Ok::<_, String>(producer)
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
                warn!(sink = %self.sink, error = %e, "Cannot start transactions; trying again");
                self.set_problem(Some(why.clone()));
                Err(Error::Unavailable(why))
            }
        }
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
        let Some(producer) = st.producer.clone() else {
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
        let checkpoint = checkpoint.and_then(|record| {
            match self.send_checkpoint(&producer, &record) {
                Ok(delivery) => Some(delivery),
                // Produced before the commit, in this transaction still.
                Err(_) => {
                    st.backlog.push_back(record);
                    None
                }
            }
        });
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
        let Some(producer) = st.producer.clone() else {
            st.backlog.push_back(record);
            return;
        };
        if !st.backlog.is_empty() {
            st.backlog.push_back(record);
            return;
        }
        match self.send_checkpoint(&producer, &record) {
            Ok(delivery) => st.silent.push((record, delivery)),
            Err(_) => st.backlog.push_back(record),
        }
    }

    fn no_producer(&self, st: &State) -> String {
        if st.fenced {
            format!(
                "sink {}: fenced: a newer producer of transactional.id {} took over (another \
                 replica leads, or runs without leader election)",
                self.sink, self.id
            )
        } else {
            self.problem()
                .unwrap_or_else(|| format!("sink {}: no transaction open (not leading)", self.sink))
        }
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

    /// Commits the open transaction (also at shutdown), or makes the term's producer again
    /// when it was lost.
    pub(super) async fn commit(&self) {
        let _closed = self.gate.write().await;
        let remake = {
            let st = self.lock();
            st.producer.is_none()
                && st.wanted
                && !st.fenced
                && st.made_at.is_none_or(|at| at.elapsed() >= REMAKE_PERIOD)
        };
        if remake {
            let _ = self.make().await;
            return;
        }
        let (producer, open, silent) = {
            let mut st = self.lock();
            let Some(producer) = st.producer.clone() else {
                return;
            };
            if st.open.is_empty() && st.silent.is_empty() && st.backlog.is_empty() {
                return;
            }
            if self.produce_backlog(&producer, &mut st).is_err() {
                // Committed with the next: room comes as the records in flight are stored.
                return;
            }
            (
                producer,
                std::mem::take(&mut st.open),
                std::mem::take(&mut st.silent),
            )
        };
        let mut results = Vec::with_capacity(open.len());
        let mut failed = None;
        for h in open {
            let own = match h.delivery.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((e, _))) => Err(e),
                Err(_) => Err(KafkaError::Canceled),
            };
            let checkpoint = match h.checkpoint {
                Some(d) => match d.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((e, _))) => Err(e),
                    Err(_) => Err(KafkaError::Canceled),
                },
                None => Ok(()),
            };
            if failed.is_none() {
                failed = match (&own, &checkpoint) {
                    (Err(e), _) => Some(format!("a message to {} failed: {e}", h.topic)),
                    (_, Err(e)) => Some(format!(
                        "a checkpoint record of {} failed: {e}",
                        self.checkpoint_topic
                    )),
                    _ => None,
                };
            }
            results.push((h.done, own, h.topic, h.size));
        }
        let mut silent_records = Vec::with_capacity(silent.len());
        for (record, delivery) in silent {
            if failed.is_none() && !matches!(delivery.await, Ok(Ok(_))) {
                failed = Some(format!(
                    "a checkpoint record of {} failed",
                    self.checkpoint_topic
                ));
            }
            silent_records.push(record);
        }
        let committed = match failed {
            Some(why) => Err(why),
            None => {
                let producer = producer.clone();
                tokio::task::spawn_blocking(move || producer.commit_transaction(CALL_TIMEOUT))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|c| c.map_err(|e| e.to_string()))
            }
        };
        match committed {
            Ok(()) => {
                for (done, _, _, _) in results {
                    let _ = done.send(Ok(()));
                }
                self.set_problem(None);
            }
            Err(why) => {
                let fatal = producer.client().fatal_error().is_some();
                if fatal {
                    error!(sink = %self.sink, transactional_id = %self.id, error = %why, "The transactional producer failed for good (fenced: another replica's producer of this transactional.id took over); nothing is published until the next term");
                } else {
                    warn!(sink = %self.sink, error = %why, messages = results.len(), "Transaction aborted; its messages are sent again");
                }
                let aborted = if fatal {
                    false
                } else {
                    let producer = producer.clone();
                    tokio::task::spawn_blocking(move || producer.abort_transaction(CALL_TIMEOUT))
                        .await
                        .is_ok_and(|a| a.is_ok())
                };
                let reason = format!("sink {}: transaction aborted: {why}", self.sink);
                for (done, own, topic, size) in results {
                    // A message's own final error (too large, denied) is its answer; every
                    // other message of the transaction is sent again.
                    let err =
                        match own.map_err(|e| classify(e, &topic, size, self.max_message_bytes)) {
                            Err(e) if !e.is_retriable() => e,
                            _ => Error::Unavailable(reason.clone()),
                        };
                    let _ = done.send(Err(err));
                }
                self.set_problem(Some(reason));
                let mut st = self.lock();
                if st.producer.as_ref().is_some_and(|p| same(p, &producer)) {
                    // Written again first, in the next transaction.
                    for record in silent_records.into_iter().rev() {
                        st.backlog.push_front(record);
                    }
                    if fatal || !aborted {
                        st.fenced |= fatal;
                        let old = st.producer.take();
                        drop(st);
                        dispose(old);
                        return;
                    }
                }
            }
        }
        let st = self.lock();
        if let Some(p) = st.producer.as_ref().filter(|p| same(p, &producer))
            && let Err(e) = p.begin_transaction()
        {
            drop(st);
            warn!(sink = %self.sink, error = %e, "begin_transaction failed; the producer is made again");
            let mut st = self.lock();
            let old = st.producer.take();
            drop(st);
            dispose(old);
        }
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

/// Drops a producer off the async threads (a drop purges, flushes for up to 500 ms and joins
/// its polling thread).
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
        t.commit().await;
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
