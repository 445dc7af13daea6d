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
//!   [`Error::Aborted`] (the pipeline retries them without counting a retry). Checkpoint
//!   records without a message
//!   ([`Transactions::settle`]) are written again first in the next one.
//! - **Retriable, then unknown.** A commit or abort the brokers answer retriably is tried
//!   again until shortly before the broker would abort the transaction itself. A commit that
//!   neither succeeded nor was aborted then (fenced by a newer producer, a fatal producer
//!   error, still failing) may have been committed: sending its messages again would
//!   duplicate them. Its acknowledgements fail, the producer goes, and nothing is produced
//!   until the next `begin_term`, which resumes from the checkpoint; `/healthz` fails
//!   ([`Transactions::broken`]) so the pod restarts.
//! - **Fenced shows until the next term.** A producer of this replica that a newer producer
//!   of the id fenced (a thawed or slow deposed leader: its commit or its term's closing abort
//!   is refused, or its lost lease is seen held by another: [`Transactions::deposed`]) is
//!   reported by [`Transactions::broken`] and `keb_kafka_producer_fenced` whichever came
//!   first, the lease's loss or the refusal, until a term of this replica starts its own
//!   producer: ending the term does not clear it.
//! - **A deposed producer never aborts.** Once another replica may hold the lease
//!   ([`crate::leader::Fence::may_be_taken`]), nothing of the term is aborted: the producer
//!   goes with its transaction open, which the new holder's producer aborts (see
//!   `NOT_ABORTED`).
//! - **Order.** Records are produced under the state lock, a message's checkpoint record right
//!   after it, and every record of a term by one producer: a key's records keep their order
//!   in the checkpoint topic. A commit holds the gate exclusively: nothing is produced between
//!   its flush and the next `begin_transaction`.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use futures::{StreamExt, future::BoxFuture, stream::FuturesUnordered};
use rdkafka::{
    error::{KafkaError, RDKafkaErrorCode},
    producer::{FutureRecord, Producer},
};
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::{
    client::{KafkaClient, SinkProducer},
    config::{CALL_TIMEOUT, transactional_id},
    error::{acl_hint, classify, is_consequence, is_retriable},
    producer::{DeliveryFuture, Record},
    record::CheckpointRecord,
};
use crate::{
    leader::Fence,
    sinks::{Ack, Error, Result},
};

/// How long before the broker would abort a transaction itself (`transaction_timeout` after
/// it began) a commit or an abort the brokers answer retriably stops being tried again.
const MARGIN: Duration = Duration::from_secs(5);

/// A delivery awaited at a commit: the index of its message (`None`: a checkpoint record
/// without one), whether it is the message itself, and its result.
type Waiting = BoxFuture<'static, (Option<usize>, bool, std::result::Result<(), KafkaError>)>;

/// What every producer of a sink's transactions is made with.
#[derive(Clone)]
pub(super) struct Settings {
    /// The sink's name.
    pub(super) sink: String,
    /// Its clients' settings.
    pub(super) client: KafkaClient,
    /// Where the checkpoint records go.
    pub(super) checkpoint_topic: String,
    /// `transaction_interval`.
    pub(super) interval: Duration,
    /// `transaction_timeout`.
    pub(super) timeout: Duration,
    /// The producer's `message.max.bytes`.
    pub(super) max_message_bytes: usize,
    /// Transactions committed and aborted (`keb_kafka_transactions_total`).
    pub(super) outcomes: [prometheus::IntCounter; 2],
    /// Transactional ids whose producer here was fenced (`keb_kafka_producer_fenced`).
    pub(super) fenced: prometheus::IntGauge,
}

/// See the module docs.
pub(super) struct Transactions {
    settings: Settings,
    id: String,
    // Shared by hand-overs, exclusive for a commit (and a term's start, whose producer is
    // made under it even when the caller gives up: a shutdown waits for it).
    gate: Arc<tokio::sync::RwLock<()>>,
    state: Mutex<State>,
    // Why transactions fail now (readiness), cleared by the next commit and a term's end.
    problem: Mutex<Option<String>>,
    // Whether a producer of this replica was fenced (liveness), cleared only by the next term's
    // producer: shared with the task that aborts an ended term's transaction.
    fenced: Arc<Fenced>,
}

/// A fence found on one of this replica's producers of a transactional id: kept until a new
/// term's producer starts, whatever ended the term meanwhile, and counted in the sink's
/// `keb_kafka_producer_fenced`.
struct Fenced {
    state: Mutex<FenceState>,
    gauge: prometheus::IntGauge,
}

#[derive(Default)]
struct FenceState {
    // Why, if fenced.
    why: Option<String>,
    // How many terms began here: a fence found on an older term's producer after a newer
    // term began is that term's producer's doing (this replica retook the lease), not
    // reported.
    started: u64,
    // The producer of the last term that started one, as a deposal judges it.
    last: LastProducer,
}

/// The producer of the last term that started one (see [`Fenced::deposed`]).
#[derive(Default, Clone, Copy)]
enum LastProducer {
    /// None since the last term began.
    #[default]
    None,
    /// Started, and not closed cleanly (still in its term, or dropped with an unknown
    /// outcome, a failed abort or a fatal error).
    Open,
    /// Its transaction aborted (or none open) and the producer dropped without a fatal
    /// error, at this instant.
    ClosedAt(tokio::time::Instant),
}

impl Fenced {
    fn lock(&self) -> std::sync::MutexGuard<'_, FenceState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self) -> Option<String> {
        self.lock().why.clone()
    }

    /// How many terms began here so far.
    fn started(&self) -> u64 {
        self.lock().started
    }

    /// A term begins: its producer may fence the older ones of this replica.
    fn term_begins(&self) {
        let mut state = self.lock();
        state.started += 1;
        state.last = LastProducer::None;
    }

    /// The term's producer started: a fence found before is over.
    fn producer_started(&self) {
        let mut state = self.lock();
        state.last = LastProducer::Open;
        if state.why.take().is_some() {
            self.gauge.dec();
        }
    }

    /// The producer of the `started`-th term was closed cleanly (see [`LastProducer`]) now.
    fn closed(&self, started: u64) {
        let mut state = self.lock();
        if state.started == started && matches!(state.last, LastProducer::Open) {
            state.last = LastProducer::ClosedAt(tokio::time::Instant::now());
        }
    }

    /// Records a fence if `producer` reports one (its fatal error is a fence), naming `id`,
    /// unless a term began here after the `started`-th.
    fn note(&self, sink: &str, id: &str, producer: &SinkProducer, started: u64) -> bool {
        let Some((code, reason)) = producer
            .client()
            .fatal_error()
            .filter(|(c, _)| is_fence(*c))
        else {
            return false;
        };
        self.set(
            sink,
            id,
            started,
            format!(
                "sink {sink}: its producer of transactional.id {id} was fenced ({code:?}: {reason}): \
                 a newer producer of the id took over (another replica leads); this one publishes \
                 nothing of it until it starts a term again (or restarts)"
            ),
        )
    }

    /// The lease of the last term, lost while leading, is held by `holder`, who could take it
    /// from `takeable_from`: that one's producer of `id` fences the last term's (at its
    /// term's start), whether or not the broker ever tells this one, unless it was closed
    /// cleanly before then. Recorded if so and no term began here since.
    fn deposed(
        &self,
        sink: &str,
        id: &str,
        holder: &str,
        takeable_from: tokio::time::Instant,
    ) -> bool {
        let started = {
            let state = self.lock();
            match state.last {
                LastProducer::None => return false,
                LastProducer::ClosedAt(at) if at < takeable_from => return false,
                LastProducer::Open | LastProducer::ClosedAt(_) => state.started,
            }
        };
        self.set(
            sink,
            id,
            started,
            format!(
                "sink {sink}: its producer of transactional.id {id} is fenced: the lease was lost \
                 while this replica led and {holder} holds it now, whose producer of the id \
                 fences this one's (not closed before the lease could be taken); nothing of it \
                 is published here until this replica starts a term again (or restarts)"
            ),
        )
    }

    fn set(&self, sink: &str, id: &str, started: u64, why: String) -> bool {
        let mut state = self.lock();
        if started != state.started {
            return false;
        }
        if state.why.is_none() {
            self.gauge.inc();
            error!(sink, transactional_id = id, error = %why, "This replica's producer was fenced: another one took over its transactional.id; /healthz fails until this replica starts a term again");
        }
        state.why = Some(why);
        true
    }
}

/// Whether a producer's fatal error `code` says a newer producer of its transactional id
/// fenced it.
fn is_fence(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
    )
}

#[derive(Default)]
struct State {
    producer: Option<SinkProducer>,
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
    // When the open transaction began: the broker aborts it `transaction_timeout` later.
    opened_at: Option<tokio::time::Instant>,
    // The term's lease (`None` without leader election): once another replica may hold it,
    // nothing of this term is aborted (see `NOT_ABORTED`).
    fence: Option<Fence>,
}

/// Why a deposed producer's transaction is left to the new holder's producer (whose start
/// aborts it) instead of aborted: librdkafka bumps the producer's epoch after aborting a
/// transaction that failed (a record refused with an old epoch), and Kafka 4 can take the
/// bump of the older epoch for a retry and grant it, fencing the new holder's producer.
const NOT_ABORTED: &str = "not aborted: another replica may hold the lease by now, and an \
     abort could fence its producer (its start aborts this transaction)";

/// The least time left before the lease could be another's for an abort to begin.
const MIN_ABORT: Duration = Duration::from_millis(500);

/// How long before the lease could be another's an abort must have ended: the producer is
/// dropped once it returns, and what librdkafka still sends of an abort that timed out goes
/// out meanwhile.
const ABORT_MARGIN: Duration = Duration::from_millis(250);

/// How long an abort begun now may take: until `ABORT_MARGIN` before the lease could be
/// another's (`takeable`, see [`NOT_ABORTED`]; `None`: without leader election), at most
/// `CALL_TIMEOUT`; `None` when it is too late to begin one. Best effort: librdkafka goes on
/// with an abort that timed out until the producer is dropped, and a taker's producer starts
/// as soon as it takes the lease (before any takeover wait), so a request of it sent after
/// `takeable` could still fence the taker's producer (its transaction's outcome unknown,
/// `/healthz` restarts it; nothing is lost).
fn abort_budget(takeable: Option<tokio::time::Instant>) -> Option<Duration> {
    let Some(takeable) = takeable else {
        return Some(CALL_TIMEOUT);
    };
    let left = takeable.saturating_duration_since(tokio::time::Instant::now());
    (left >= MIN_ABORT).then(|| (left - ABORT_MARGIN).min(CALL_TIMEOUT))
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

/// What a commit took from the state (see `Transactions::take_open`).
struct Closing {
    producer: SinkProducer,
    open: Vec<Handed>,
    silent: Vec<(CheckpointRecord, DeliveryFuture)>,
    poisoned: Option<String>,
    /// Shortly before the broker would abort the transaction itself.
    deadline: Option<tokio::time::Instant>,
    /// From when the lease could be another's (see `abort_budget`).
    takeable: Option<tokio::time::Instant>,
}

/// A message of a transaction being ended: where its answer goes, its own delivery's result,
/// and its topic and size (for the classification of its error).
struct Answer {
    done: oneshot::Sender<Result<()>>,
    own: std::result::Result<(), KafkaError>,
    topic: String,
    size: usize,
}

/// An abort under way on a blocking thread.
type AbortTask = tokio::task::JoinHandle<rdkafka::error::KafkaResult<()>>;

/// How a commit attempt ended.
enum Outcome {
    Committed,
    /// Aborted: nothing of it is visible; its messages may go again.
    Aborted(String),
    /// Maybe committed: nothing may go again in this term.
    Unknown(String),
}

impl Transactions {
    /// Transactions of `transactional.id` `id`; the commit task runs while the returned
    /// value lives.
    pub(super) fn new(settings: Settings, id: String) -> Arc<Self> {
        let fenced = Arc::new(Fenced {
            state: Mutex::default(),
            gauge: settings.fenced.clone(),
        });
        let this = Arc::new(Self {
            fenced,
            settings,
            id,
            gate: Arc::new(tokio::sync::RwLock::new(())),
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

    /// Why nothing can be published until the next term (for `/healthz`), if so: an unknown
    /// outcome in this term, or a producer of this replica fenced (this term's or an ended
    /// one's).
    pub(super) fn broken(&self) -> Option<String> {
        self.lock().broken.clone().or_else(|| self.fenced.get())
    }

    /// A term begins: what the last one held fails, and this term's producer is made (fencing
    /// every earlier producer of the id), but only while `fence`'s lease is held (during its
    /// takeover wait too: the producer publishes nothing before the fence is valid, and
    /// fencing the last holder's at once ends its open transaction, which would hold
    /// `read_committed` readers back): `init_transactions` is given no longer than the lease
    /// is held. On an error nothing is produced; the caller tries again while the term lasts.
    pub(super) async fn begin_term(&self, fence: Option<Fence>) -> Result<()> {
        let closed = self.gate.clone().write_owned().await;
        // From here a producer of this replica may fence the last one: a fence found on that
        // one later is this term's doing.
        self.fenced.term_begins();
        let old = {
            let mut st = self.lock();
            fail_all(&mut st, "a new leadership term began");
            st.wanted = true;
            st.broken = None;
            st.poisoned = None;
            st.fence = fence.clone();
            st.producer.take()
        };
        dispose(old);
        let timeout = match fence.as_ref().map(Fence::held_until) {
            None => CALL_TIMEOUT,
            Some(until) => {
                let left = until.map_or(Duration::ZERO, |u| {
                    u.saturating_duration_since(tokio::time::Instant::now())
                });
                if left < Duration::from_millis(100) {
                    return Err(Error::Aborted("the lease is not held any more".into()));
                }
                left.min(CALL_TIMEOUT)
            }
        };
        let (client, id, txn_timeout) = (
            self.settings.client.clone(),
            self.id.clone(),
            self.settings.timeout,
        );
        // The gate goes with the blocking call: a caller that gives up (a shutdown) leaves it
        // closed until the call returned, so nothing after it (a release of the lease, after
        // the shutdown's commit) overtakes an init still on its way to the broker.
        let made = tokio::task::spawn_blocking(move || {
            let _closed = closed;
            let producer = client.transactional_producer(&id, txn_timeout)?;
            let started = producer
                .init_transactions(timeout)
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
                    return Err(Error::Aborted("the leadership term ended".into()));
                }
                st.producer = Some(producer);
                st.opened_at = Some(tokio::time::Instant::now());
                drop(st);
                self.set_problem(None);
                self.fenced.producer_started();
                info!(sink = %self.settings.sink, transactional_id = %self.id, "Transactions on: earlier producers of this transactional.id are fenced");
                Ok(())
            }
            Err(e) => {
                let why = format!(
                    "sink {}: cannot start transactions (transactional.id {}): {e}",
                    self.settings.sink, self.id
                );
                self.set_problem(Some(why.clone()));
                Err(Error::Unavailable(why))
            }
        }
    }

    /// The term ended: what it holds fails and its producer goes, its open transaction
    /// aborted (left open, it would hold `read_committed` readers of its partitions back
    /// until the next owner's producer or the broker's timeout ended it), unless another
    /// replica may hold the lease by now (see [`NOT_ABORTED`]).
    pub(super) fn end_term(&self) {
        let (old, takeable) = {
            let mut st = self.lock();
            st.wanted = false;
            st.broken = None;
            st.poisoned = None;
            fail_all(&mut st, "the leadership term ended");
            let fence = st.fence.take();
            (
                st.producer.take(),
                fence.as_ref().and_then(Fence::takeable_at),
            )
        };
        self.set_problem(None);
        if let Some(producer) = old {
            // After a commit under way (its acknowledgements stand), under the gate. An abort
            // refused because a newer producer fenced this one (the lease was lost first, the
            // fence found now) is reported as the commit's refusal would have been.
            let (gate, fenced) = (self.gate.clone(), self.fenced.clone());
            let (sink, id) = (self.settings.sink.clone(), self.id.clone());
            // A term started here before the abort runs fenced this producer itself.
            let started = self.fenced.started();
            tokio::spawn(async move {
                let closed = gate.write_owned().await;
                let _ = tokio::task::spawn_blocking(move || {
                    let _closed = closed;
                    // A term begun here since fenced this producer: nothing to abort.
                    let budget = abort_budget(takeable).filter(|_| fenced.started() == started);
                    if budget.is_none() && fenced.started() == started {
                        warn!(sink = %sink, transactional_id = %id, "The term's producer goes without aborting its transaction: {NOT_ABORTED}");
                    }
                    if let Some(budget) = budget
                        && producer.client().fatal_error().is_none()
                    {
                        // Nothing open (a commit ended it) is an error of state: as clean.
                        let aborted = match producer.abort_transaction(budget) {
                            Ok(()) => true,
                            Err(KafkaError::Transaction(e)) => e.code() == RDKafkaErrorCode::State,
                            Err(_) => false,
                        };
                        if aborted && producer.client().fatal_error().is_none() {
                            fenced.closed(started);
                        }
                    }
                    fenced.note(&sink, &id, &producer, started);
                    drop(producer);
                })
                .await;
            });
        }
    }

    /// The lease of the last term, lost while this replica led, is held by `holder` now, who
    /// could take it from `takeable_from`: the last term's producer, unless it closed cleanly
    /// before then, counts as fenced (see [`Fenced::deposed`]) until a term begins here again.
    pub(super) fn deposed(&self, holder: &str, takeable_from: tokio::time::Instant) {
        self.fenced
            .deposed(&self.settings.sink, &self.id, holder, takeable_from);
    }

    /// Hands `record` to the open transaction with its checkpoint record, and returns the
    /// acknowledgement, which resolves at the commit.
    pub(super) async fn submit(
        &self,
        record: Record<'_>,
        checkpoint: Option<CheckpointRecord>,
        topic: &str,
        size: usize,
    ) -> Result<Ack> {
        let _open = self.gate.read().await;
        let mut st = self.lock();
        // Not the message's failure (none is counted as its retry): no transaction open.
        let Some(producer) = st.producer.clone().filter(|_| st.broken.is_none()) else {
            return Err(Error::Aborted(self.no_producer(&st)));
        };
        self.produce_backlog(&producer, &mut st).map_err(|e| {
            Error::Unavailable(format!("checkpoint records wait to be produced first: {e}"))
        })?;
        let delivery = match producer.send(record) {
            Ok(delivery) => delivery,
            Err((e, _)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull) => {
                return Err(Error::Unavailable("the producer's queue is full".into()));
            }
            // The transaction failed and waits for its abort (the next commit).
            Err((e, _)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::State) => {
                return Err(Error::Aborted(format!("the open transaction failed: {e}")));
            }
            Err((e, _)) => return Err(classify(e, topic, size, self.settings.max_message_bytes)),
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
            .unwrap_or_else(|| {
                format!(
                    "sink {}: no transaction open (not leading)",
                    self.settings.sink
                )
            })
    }

    fn send_checkpoint(
        &self,
        producer: &SinkProducer,
        (key, value): &CheckpointRecord,
    ) -> std::result::Result<DeliveryFuture, KafkaError> {
        let mut record =
            FutureRecord::<String, String>::to(&self.settings.checkpoint_topic).key(key);
        if let Some(v) = value {
            record = record.payload(v);
        }
        producer.send_result(record).map_err(|(e, _)| e)
    }

    /// Produces the backlog (the state locked, the gate held); on an error what is left of it
    /// stays for the next attempt.
    fn produce_backlog(
        &self,
        producer: &SinkProducer,
        st: &mut State,
    ) -> std::result::Result<(), KafkaError> {
        while let Some(record) = st.backlog.pop_front() {
            match self.send_checkpoint(producer, &record) {
                Ok(delivery) => st.silent.push((record, delivery)),
                Err(e) => {
                    st.backlog.push_front(record);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Commits the open transaction (every interval, and at shutdown); an error says it was
    /// not committed.
    pub(super) async fn commit(&self) -> Result<()> {
        let _closed = self.gate.write().await;
        let Some(Closing {
            producer,
            open,
            silent,
            poisoned,
            deadline,
            takeable,
        }) = self.take_open()?
        else {
            return Ok(());
        };
        let (answers, silent_records, failed, aborting) = self
            .deliveries(&producer, open, silent, poisoned, takeable)
            .await;
        let outcome = match (aborting, failed) {
            (Some(aborting), Some(why)) => match aborting.await {
                Ok(Ok(())) => Outcome::Aborted(why),
                Ok(Err(e)) if is_retriable(&e) => {
                    self.abort(&producer, why, deadline, takeable).await
                }
                Ok(Err(e)) => Outcome::Unknown(format!("{why}; the abort failed: {e}")),
                Err(e) => Outcome::Unknown(format!("{why}; the abort task failed: {e}")),
            },
            (None, Some(why)) => Outcome::Unknown(format!("{why}; {NOT_ABORTED}")),
            _ => self.try_commit(&producer, deadline, takeable).await,
        };
        let result = self.conclude(outcome, &producer, answers, silent_records);
        dispose(Some(producer));
        result
    }

    /// Takes the open transaction for its commit (the gate held), its checkpoint backlog
    /// produced into it first; `None` when there is nothing to commit, an error when the term
    /// cannot commit (broken) or the backlog waits for room.
    fn take_open(&self) -> Result<Option<Closing>> {
        let mut st = self.lock();
        let Some(producer) = st.producer.clone().filter(|_| st.broken.is_none()) else {
            return match &st.broken {
                Some(why) => Err(Error::Unavailable(why.clone())),
                None => Ok(None),
            };
        };
        let deadline = st
            .opened_at
            .map(|at| at + self.settings.timeout.saturating_sub(MARGIN));
        if st.open.is_empty() && st.silent.is_empty() && st.backlog.is_empty() {
            return Ok(None);
        }
        // Without room, committed with the next: room comes as the records in flight are
        // stored. Any other refusal (the transaction failed and waits for its abort, the
        // producer fenced) aborts this one (or stops the term), the backlog kept for the
        // next: returning here would leave it open for good.
        match self.produce_backlog(&producer, &mut st) {
            Ok(()) => {}
            Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull) => {
                return Err(Error::Unavailable(format!(
                    "checkpoint records wait for room in the producer: {e}"
                )));
            }
            Err(e) => {
                st.poisoned.get_or_insert_with(|| {
                    format!("a checkpoint record could not be produced: {e}")
                });
            }
        }
        Ok(Some(Closing {
            producer,
            open: std::mem::take(&mut st.open),
            silent: std::mem::take(&mut st.silent),
            poisoned: st.poisoned.take(),
            deadline,
            takeable: st.fence.as_ref().and_then(Fence::takeable_at),
        }))
    }

    /// Awaits every record's delivery (a commit flushes them anyway, and a failed one names
    /// the cause); at the first failure the transaction is aborted at once (if it still may
    /// be, see [`abort_budget`]), which fails the records still waiting (librdkafka would hold
    /// them until their timeout). Returns each message's answer to give, the silent
    /// checkpoint records, why the transaction failed (if it did) and the abort under way.
    async fn deliveries(
        &self,
        producer: &SinkProducer,
        open: Vec<Handed>,
        silent: Vec<(CheckpointRecord, DeliveryFuture)>,
        poisoned: Option<String>,
        takeable: Option<tokio::time::Instant>,
    ) -> (
        Vec<Answer>,
        Vec<CheckpointRecord>,
        Option<String>,
        Option<AbortTask>,
    ) {
        let mut waiting = FuturesUnordered::new();
        let mut answers = Vec::with_capacity(open.len());
        for (i, h) in open.into_iter().enumerate() {
            waiting.push(
                Box::pin(async move { (Some(i), true, h.delivery.outcome().await) }) as Waiting,
            );
            if let Some(d) = h.checkpoint {
                waiting.push(Box::pin(async move { (Some(i), false, d.outcome().await) }));
            }
            answers.push(Answer {
                done: h.done,
                own: Ok(()),
                topic: h.topic,
                size: h.size,
            });
        }
        let mut silent_records = Vec::with_capacity(silent.len());
        for (record, delivery) in silent {
            waiting.push(Box::pin(
                async move { (None, false, delivery.outcome().await) },
            ));
            silent_records.push(record);
        }
        let mut failed = poisoned;
        let mut aborting = None;
        while let Some((i, message, result)) = waiting.next().await {
            let Err(e) = result else { continue };
            if failed.is_none() {
                failed = Some(match i.filter(|_| message) {
                    Some(i) => format!("a message to {} failed: {e}", answers[i].topic),
                    None => format!(
                        "a checkpoint record of {} failed: {e}",
                        self.settings.checkpoint_topic
                    ),
                });
            }
            if let (Some(i), true) = (i, message) {
                answers[i].own = Err(e);
            }
            if aborting.is_none() && failed.is_some() {
                aborting = abort_in_background(producer, takeable);
            }
        }
        if aborting.is_none() && failed.is_some() {
            aborting = abort_in_background(producer, takeable);
        }
        (answers, silent_records, failed, aborting)
    }

    /// Answers the transaction's messages as `outcome` says, and goes on: the next
    /// transaction (after an abort, with the silent checkpoint records again first) or, for
    /// an unknown outcome, no more until the next term.
    fn conclude(
        &self,
        outcome: Outcome,
        producer: &SinkProducer,
        answers: Vec<Answer>,
        silent_records: Vec<CheckpointRecord>,
    ) -> Result<()> {
        match outcome {
            Outcome::Committed => {
                self.settings.outcomes[0].inc();
                for a in answers {
                    let _ = a.done.send(Ok(()));
                }
                self.set_problem(None);
                self.next_transaction(producer, None);
                Ok(())
            }
            Outcome::Aborted(why) => {
                self.settings.outcomes[1].inc();
                warn!(sink = %self.settings.sink, error = %why, messages = answers.len(), "Transaction aborted; its messages are sent again");
                let reason = format!("sink {}: transaction aborted: {why}", self.settings.sink);
                for a in answers {
                    // A message's own error is its answer (too large, denied: final; a
                    // missing topic: retried with its backoff); every other message of the
                    // transaction is sent again.
                    let err = match a.own {
                        Err(e) if !is_consequence(&e) => {
                            classify(e, &a.topic, a.size, self.settings.max_message_bytes)
                        }
                        _ => Error::Aborted(reason.clone()),
                    };
                    let _ = a.done.send(Err(err));
                }
                self.next_transaction(producer, Some((silent_records, reason.clone())));
                Err(Error::Unavailable(reason))
            }
            Outcome::Unknown(why) => {
                self.settings.outcomes[1].inc();
                let reason = format!(
                    "sink {}: a transaction may or may not have been committed ({why}); \
                     nothing is published until the next term resumes from the checkpoint",
                    self.settings.sink
                );
                for a in answers {
                    let _ = a.done.send(Err(Error::Aborted(reason.clone())));
                }
                self.stop(producer, reason.clone());
                Err(Error::Unavailable(reason))
            }
        }
    }

    /// Begins the next transaction on `producer` if it is still the term's (the gate is
    /// still held: before anything settled after this); after an abort, its silent
    /// checkpoint records are written again first and the reason stays the sink's problem
    /// until a commit succeeds.
    fn next_transaction(
        &self,
        producer: &SinkProducer,
        aborted: Option<(Vec<CheckpointRecord>, String)>,
    ) {
        let mut st = self.lock();
        if !st.producer.as_ref().is_some_and(|p| same(p, producer)) {
            return;
        }
        let problem = aborted.map(|(silent_records, reason)| {
            for record in silent_records.into_iter().rev() {
                st.backlog.push_front(record);
            }
            reason
        });
        match st.producer.as_ref().expect("checked").begin_transaction() {
            Ok(()) => {
                st.opened_at = Some(tokio::time::Instant::now());
                drop(st);
                if problem.is_some() {
                    self.set_problem(problem);
                }
            }
            Err(e) => {
                drop(st);
                self.stop(producer, format!("begin_transaction failed: {e}"));
            }
        }
    }

    /// Commits, trying a retriable failure again until `deadline` (a commit that timed out may
    /// only be retried: its outcome is the coordinator's); an abortable one is aborted.
    async fn try_commit(
        &self,
        producer: &SinkProducer,
        deadline: Option<tokio::time::Instant>,
        takeable: Option<tokio::time::Instant>,
    ) -> Outcome {
        match self
            .retrying("commit", producer, deadline, |p| {
                p.commit_transaction(CALL_TIMEOUT)
            })
            .await
        {
            Ok(()) => Outcome::Committed,
            Err(ref e @ KafkaError::Transaction(ref r)) if r.txn_requires_abort() => {
                self.abort(producer, format!("commit: {e}"), deadline, takeable)
                    .await
            }
            Err(e) => Outcome::Unknown(format!("commit: {e}")),
        }
    }

    /// Aborts the open transaction (nothing of it was committed: a commit was not asked for,
    /// or the broker asked for the abort), trying a retriable failure again until `deadline`
    /// and while no other replica may hold the lease (see [`NOT_ABORTED`]).
    async fn abort(
        &self,
        producer: &SinkProducer,
        why: String,
        deadline: Option<tokio::time::Instant>,
        takeable: Option<tokio::time::Instant>,
    ) -> Outcome {
        if abort_budget(takeable).is_none() {
            return Outcome::Unknown(format!("{why}; {NOT_ABORTED}"));
        }
        // No attempt begins too late (see `abort_budget`).
        let deadline = match (deadline, takeable.map(|t| t - MIN_ABORT)) {
            (Some(d), Some(t)) => Some(d.min(t)),
            (d, t) => d.or(t),
        };
        match self
            .retrying("abort", producer, deadline, move |p| {
                p.abort_transaction(abort_budget(takeable).unwrap_or(MIN_ABORT))
            })
            .await
        {
            Ok(()) => Outcome::Aborted(why),
            // Not committed, but the producer cannot go on (fenced, fatal): nothing of the
            // transaction is visible, yet the term stops as for an unknown outcome.
            Err(e) => Outcome::Unknown(format!("{why}; the abort failed: {e}")),
        }
    }

    /// Calls `call` (a commit or an abort) on a blocking thread until it succeeds, fails other
    /// than retriably, `deadline` (shortly before the broker aborts the transaction itself)
    /// has passed, or `producer` is not the term's any more. Brokers down: the gate stays
    /// closed, so hand-overs wait meanwhile.
    async fn retrying(
        &self,
        what: &str,
        producer: &SinkProducer,
        deadline: Option<tokio::time::Instant>,
        call: impl Fn(&SinkProducer) -> rdkafka::error::KafkaResult<()> + Copy + Send + 'static,
    ) -> std::result::Result<(), KafkaError> {
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let p = producer.clone();
            let result = tokio::task::spawn_blocking(move || call(&p))
                .await
                .unwrap_or(Err(KafkaError::Canceled));
            let again = deadline.is_some_and(|d| tokio::time::Instant::now() < d)
                && self
                    .lock()
                    .producer
                    .as_ref()
                    .is_some_and(|p| same(p, producer));
            match result {
                Err(ref e) if is_retriable(e) && again => {
                    if attempt == 1 {
                        warn!(sink = %self.settings.sink, error = %e, "Transaction {what} failed; trying it again");
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                other => return other,
            }
        }
    }

    /// Stops publishing until the next term: `producer` (if still the term's) goes.
    fn stop(&self, producer: &SinkProducer, why: String) {
        // Fenced is kept past this term (its end clears `broken`), whether or not `producer`
        // is still the term's (a commit holds the gate, so no newer term's producer started
        // since it took `producer`: the fence is another replica's).
        let started = self.fenced.started();
        let fenced = self
            .fenced
            .note(&self.settings.sink, &self.id, producer, started);
        error!(sink = %self.settings.sink, transactional_id = %self.id, fenced, error = %why, "Transactions stopped; nothing is published until the next term (or the restart /healthz asks for)");
        let mut st = self.lock();
        if st.producer.as_ref().is_some_and(|p| same(p, producer)) {
            let old = st.producer.take();
            st.broken = Some(why.clone());
            drop(st);
            dispose(old);
            self.set_problem(Some(why));
        }
    }
}

/// One abort call on a blocking thread, started now (what it purges fails meanwhile), unless
/// it is too late to begin one (see [`abort_budget`]).
fn abort_in_background(
    producer: &SinkProducer,
    takeable: Option<tokio::time::Instant>,
) -> Option<AbortTask> {
    let budget = abort_budget(takeable)?;
    let p = producer.clone();
    Some(tokio::task::spawn_blocking(move || {
        p.abort_transaction(budget)
    }))
}

/// Fails what `st` holds, and forgets its checkpoint records (the next term resumes from the
/// checkpoint).
fn fail_all(st: &mut State, why: &str) {
    for h in st.open.drain(..) {
        let _ = h.done.send(Err(Error::Aborted(why.to_owned())));
    }
    st.silent.clear();
    st.backlog.clear();
}

/// Drops a producer off the async threads (a last drop purges, flushes for up to 500 ms and
/// joins its reports thread).
pub(super) fn dispose(producer: Option<SinkProducer>) {
    if let Some(p) = producer {
        tokio::task::spawn_blocking(move || drop(p));
    }
}

fn same(a: &SinkProducer, b: &SinkProducer) -> bool {
    a.client().native_ptr() == b.client().native_ptr()
}

async fn commit_every_interval(this: Weak<Transactions>) {
    let Some(interval) = this.upgrade().map(|t| t.settings.interval) else {
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

/// The transactions of one sink: one producer per shard (the unit a hand-over moves, so one
/// shard's new owner fences only that shard's last owner), each made as its shard's term
/// begins. Without sharding there is one, of key `""`.
pub(super) struct TransactionSet {
    settings: Settings,
    cluster: String,
    by_shard: Mutex<std::collections::HashMap<String, Arc<Transactions>>>,
}

impl TransactionSet {
    /// The transactions of `settings`' sink in cluster `cluster` (their ids:
    /// [`transactional_id`]).
    pub(super) fn new(settings: Settings, cluster: String) -> Self {
        Self {
            settings,
            cluster,
            by_shard: Mutex::default(),
        }
    }

    fn map(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Arc<Transactions>>> {
        self.by_shard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The key of `shard`: its label, or `""` for the whole keyspace.
    pub(super) fn key(shard: crate::shard::Shard) -> String {
        if shard.is_whole() {
            String::new()
        } else {
            shard.label()
        }
    }

    /// The key of the shard route `route` (`{kind}[#{i}-of-{n}]/{sink}`, this sink's)
    /// serves.
    pub(super) fn key_of_route<'a>(&self, route: &'a str) -> &'a str {
        crate::shard::label_of_route(route, &self.settings.sink)
    }

    /// The transactions of `shard`, made when asked for the first time.
    pub(super) fn of(&self, shard: crate::shard::Shard) -> Arc<Transactions> {
        self.map()
            .entry(Self::key(shard))
            .or_insert_with(|| {
                let id = transactional_id(&self.cluster, &self.settings.sink, shard);
                Transactions::new(self.settings.clone(), id)
            })
            .clone()
    }

    /// The transactions of shard `key`, if its term ever began here.
    pub(super) fn get(&self, key: &str) -> Option<Arc<Transactions>> {
        self.map().get(key).cloned()
    }

    /// Every shard's transactions.
    pub(super) fn all(&self) -> Vec<Arc<Transactions>> {
        self.map().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Fenced, TransactionSet};
    use crate::shard::Shard;
    use std::time::Duration;
    use tokio::time::Instant;

    fn fenced() -> Fenced {
        Fenced {
            state: Default::default(),
            gauge: prometheus::IntGauge::new("fenced", "fenced").unwrap(),
        }
    }

    /// A deposal fences a producer still open or closed after the lease could be taken; one
    /// closed cleanly before, none started since the term began, or a newer term's, not; a
    /// started producer clears the report.
    #[tokio::test(start_paused = true)]
    async fn a_deposal_fences_what_was_not_closed_before_the_lease_could_be_taken() {
        let f = fenced();
        let deposed = |f: &Fenced, since| f.deposed("out", "id", "b", since);
        // A term whose producer never started (it ended in the takeover wait).
        f.term_begins();
        assert!(!deposed(&f, Instant::now()), "no producer");
        // Started, then dropped uncleanly (an unknown outcome): fenced.
        f.producer_started();
        assert!(deposed(&f, Instant::now()));
        assert!(f.get().unwrap().contains("b holds it now"));
        assert_eq!(f.gauge.get(), 1);
        // The next term's producer clears it.
        f.term_begins();
        f.producer_started();
        assert_eq!((f.get(), f.gauge.get()), (None, 0));
        // Closed cleanly before the lease could be taken (stepped down at the renew
        // deadline, aborted at once): not fenced.
        f.closed(f.started());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(!deposed(&f, Instant::now()), "closed before");
        // Closed only after (a process frozen past the lease's expiry): fenced.
        assert!(deposed(&f, Instant::now() - Duration::from_secs(6)));
        f.term_begins();
        f.producer_started();
        // A close reported for an older term does not count.
        f.closed(f.started() - 1);
        assert!(deposed(&f, Instant::now() + Duration::from_secs(60)));
        // A deposal of an older term after a newer one began (its producer not started yet):
        // nothing.
        f.term_begins();
        f.producer_started();
        f.term_begins();
        assert!(!deposed(&f, Instant::now()));
    }

    #[test]
    fn a_route_names_the_shard_whose_transactions_it_writes_in() {
        use crate::shard::label_of_route as key_of_route;
        assert_eq!(key_of_route("configmap/kafka", "kafka"), "");
        assert_eq!(key_of_route("configmap#3-of-12/kafka", "kafka"), "3-of-12");
        assert_eq!(
            key_of_route("all/widgets.example.com#0-of-2/kafka", "kafka"),
            "0-of-2"
        );
        assert_eq!(key_of_route("all/widgets.example.com/kafka", "kafka"), "");
        // A sink's name holding `/` or `#` is not read as the shard.
        assert_eq!(key_of_route("cm#0-of-4/team/out", "team/out"), "0-of-4");
        assert_eq!(key_of_route("cm#0-of-4/x#1-of-4/y", "x#1-of-4/y"), "0-of-4");
        assert_eq!(key_of_route("x#1-of-2/out", "out"), "1-of-2");
        assert_eq!(key_of_route("x#a-of-2/out", "out"), "");
        assert_eq!(TransactionSet::key(Shard::WHOLE), "");
        assert_eq!(
            TransactionSet::key(Shard {
                index: 3,
                count: 12
            }),
            "3-of-12"
        );
    }
}
