//! Reading Kafka topics from their first offset to their current end: what the checkpoint
//! store and the `state` command need (a compacted topic folded into its last value per key).
//!
//! # Recovery
//! Reads are `read_committed`: a transaction's records once it committed, never an aborted
//! one's. The end of a read is each partition's high watermark as it was when the read began
//! (as a `read_uncommitted` client sees it). The read first waits until every transaction
//! open at that moment has ended (each partition's last stable offset reached the
//! watermark), whichever producer's transaction held the others back; then it consumes, and a
//! partition is read once the broker reports its end (`PartitionEOF`, at a last stable offset
//! now at or past the watermark) or a record at or past the watermark's last offset arrives
//! (while other writers keep the partition busy the consumer need never find itself at its
//! end). A transaction still open after [`STALL`], or a read that receives nothing for
//! [`STALL`], is an error naming how far it got (a transaction left open by a killed producer
//! holds it back until a new producer of its id aborts it, or the broker does after its
//! timeout): a partial read is never taken for the whole topic (a checkpoint missing its
//! newest records would lose the deletes made while down, or delete live objects, or send
//! again what was delivered).

use std::{collections::HashMap, time::Duration};

use rdkafka::{
    Message as _, Offset, TopicPartitionList,
    consumer::{BaseConsumer, Consumer},
    message::{BorrowedMessage, Headers},
};

use super::client::{KafkaClient, KafkaContext};

/// How long the brokers get to answer metadata requests.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// A read that receives nothing at all for this long ends, whatever the watermarks say.
pub const STALL: Duration = Duration::from_secs(10);

/// One record as read: key, value (`None` for a tombstone) and headers.
#[derive(Debug, Clone)]
pub struct Record {
    /// The topic it came from.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset in the partition.
    pub offset: i64,
    /// The record's key (empty when it has none).
    pub key: Vec<u8>,
    /// The value; `None` for a tombstone.
    pub value: Option<Vec<u8>>,
    /// Headers, in order, values as text.
    pub headers: Vec<(String, String)>,
}

impl Record {
    /// The record a consumer received.
    pub fn from(m: &BorrowedMessage<'_>) -> Self {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().unwrap_or_default().to_vec(),
            value: m.payload().map(<[u8]>::to_vec),
            headers,
        }
    }
}

/// A consumer made by [`consumer`].
pub type ReaderConsumer = BaseConsumer<KafkaContext>;

/// How many messages, and how many KB (of 1,000 bytes), a reader's consumer fetches ahead at
/// most (`queued.min.messages`, `queued.max.messages.kbytes`).
const READ_AHEAD_MESSAGES: &str = "50000";
const READ_AHEAD_KBYTES: &str = "16384";

/// A consumer with a sink's brokers and security settings, for manual assignment: no group
/// membership, no committed offsets (the producer settings of `config` are left out). It
/// reports the end of each partition (`KafkaError::PartitionEOF`) from `poll`, which the
/// context does not log. Blocking with `OAUTHBEARER` (a token request, unless the newest token
/// is young).
pub fn consumer(client: impl Into<KafkaClient>) -> Result<ReaderConsumer, String> {
    // What a transaction committed, never what one aborted or has not committed yet
    // (exactly-once sinks).
    reader(client.into(), "read_committed", None)
}

/// A consumer like [`consumer`] for a read to the end: an empty fetch (how the end shows)
/// comes back after 20 ms, not after librdkafka's default 500 ms wait for more.
fn reading_to_end(client: &KafkaClient) -> Result<ReaderConsumer, String> {
    reader(client.clone(), "read_committed", Some("20"))
}

fn reader(
    client: KafkaClient,
    isolation: &str,
    fetch_wait_ms: Option<&str>,
) -> Result<ReaderConsumer, String> {
    let mut config = client.config.clone();
    for producer_only in [
        "enable.idempotence",
        "acks",
        "compression.type",
        "linger.ms",
        "message.timeout.ms",
    ] {
        config.remove(producer_only);
    }
    config
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", isolation)
        .set("group.id", "kube-event-bridge-reader");
    if let Some(ms) = fetch_wait_ms {
        config.set("fetch.wait.max.ms", ms);
    }
    // What librdkafka fetches ahead of the reader (its defaults: 100,000 messages or 65,536
    // KB; the partitions' queues are forwarded to the consumer's, so for all of them). A
    // read to the end consumes as fast as it fetches, and what was fetched ahead sits in the
    // C library's heap: with the defaults, reading a checkpoint of 50,000 keys held about 48
    // MiB there, a third of the process (docs/src/performance.md). Once the queue was full, the next fetch goes after 10 ms, not librdkafka's default
    // second (which made a load of 100,000 keys take 2.4 s); 0 would keep the broker thread
    // spinning while a slow reader (a paused `tail`) leaves the queue full.
    config
        .set("queued.min.messages", READ_AHEAD_MESSAGES)
        .set("queued.max.messages.kbytes", READ_AHEAD_KBYTES)
        .set("fetch.queue.backoff.ms", "10");
    client
        .create(&config, |c: &ReaderConsumer| c.client())
        .map_err(|e| format!("consumer: {e}"))
}

/// Reads every partition of `topics` from its first offset to its end (blocking; run it off
/// the async threads) and hands each record to `each`, in offset order per partition.
/// `client` holds the brokers and security settings; consumer settings are added here.
/// Errors are the reason, for the caller to name what it was reading. Each topic's consumers
/// are closed once it is read.
pub fn read_to_end(
    client: impl Into<KafkaClient>,
    topics: &[String],
    each: impl FnMut(Record),
) -> Result<(), String> {
    read_topics(client.into(), topics, each, close)
}

/// [`read_to_end`] for the service: each topic's consumers are closed on a blocking thread of
/// the runtime, not waited for. Closing a consumer waits for its threads to end, about 100 ms
/// each here, which the read's caller (a start, a new leader's resume) has no reason to wait
/// for; the runtime waits for it as it shuts down.
pub fn read_to_end_closing_later(
    client: impl Into<KafkaClient>,
    topics: &[String],
    each: impl FnMut(Record),
) -> Result<(), String> {
    read_topics(client.into(), topics, each, |consumers| {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(move || close(consumers))),
            // Outside a runtime there is nothing to wait for it: closed now.
            Err(_) => close(consumers),
        }
    })
}

/// Closes a read's consumers (waiting for their threads), then gives back what their fetch
/// buffers held.
fn close(consumers: Vec<ReaderConsumer>) {
    drop(consumers);
    give_back_freed_memory();
}

/// Reads `topics` (see [`read_to_end`]), handing each topic's consumers to `close` once it is
/// read (or failed).
fn read_topics(
    client: KafkaClient,
    topics: &[String],
    mut each: impl FnMut(Record),
    mut close: impl FnMut(Vec<ReaderConsumer>),
) -> Result<(), String> {
    // One topic at a time: the end of a partition (`PartitionEOF`) names no topic, and with
    // transactions it is how a read ends (the commit markers after the last record leave its
    // next offset below the high watermark).
    topics.iter().try_for_each(|topic| {
        let mut consumers = Vec::new();
        let read = read_topic_to_end(&client, topic, &mut each, &mut consumers);
        close(consumers);
        read
    })
}

/// Returns what the C allocator holds free to the system: the fetch buffers of a reader's
/// consumer are glibc's (librdkafka allocates with `malloc`, the process's Rust code with
/// mimalloc), and glibc keeps a thread's freed memory mapped in its arena for good, so a
/// read would otherwise leave its peak behind. Not needed elsewhere: producers reuse theirs.
fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: takes no pointer; glibc locks each arena while it trims it.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Reads `topic` to its end; its consumers go to `consumers`, for the caller to close.
fn read_topic_to_end(
    client: &KafkaClient,
    topic: &str,
    each: &mut impl FnMut(Record),
    consumers: &mut Vec<ReaderConsumer>,
) -> Result<(), String> {
    let consumer = reading_to_end(client)?;
    // The end: each partition's high watermark now, as a read_uncommitted client sees it. A
    // read_committed one sees the last stable offset, which any open transaction holds back
    // (another shard's, another replica's): reading only to there would miss what was
    // committed after that transaction began.
    let peek = uncommitted(client)?;
    let read = read_with(&consumer, &peek, topic, each);
    consumers.extend([consumer, peek]);
    read
}

/// [`read_topic_to_end`] with its consumers made: `consumer` reads committed, `peek` tells
/// the high watermarks.
fn read_with(
    consumer: &ReaderConsumer,
    peek: &ReaderConsumer,
    topic: &str,
    each: &mut impl FnMut(Record),
) -> Result<(), String> {
    let metadata = consumer.fetch_metadata(Some(topic), TIMEOUT).map_err(|e| {
        format!("metadata of {topic}: {e} (does this client have DESCRIBE and READ on it?)")
    })?;
    let mut assignment = TopicPartitionList::new();
    let mut target = HashMap::new();
    let mut done = std::collections::HashSet::new();
    for t in metadata.topics() {
        if let Some(e) = t.error() {
            return Err(format!("topic {topic}: {e:?}"));
        }
        for p in t.partitions() {
            let (low, high) = peek
                .fetch_watermarks(topic, p.id(), TIMEOUT)
                .map_err(|e| format!("watermarks of {topic}/{}: {e}", p.id()))?;
            target.insert(p.id(), high);
            if high <= low {
                done.insert(p.id());
            }
            assignment
                .add_partition_offset(topic, p.id(), Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
    }
    // First, every transaction open at the start ends (committed or aborted): each
    // partition's last stable offset (what a read_committed client is told) reaches the
    // target. From then on the end a read_committed consumer reports (`PartitionEOF`, at the
    // last stable offset of its fetch) lies at or past the target: whatever was committed
    // below it was handed on.
    let lso = |p: i32| {
        consumer
            .fetch_watermarks(topic, p, TIMEOUT)
            .map(|(_, lso)| lso)
    };
    let began = std::time::Instant::now();
    loop {
        let behind: Vec<String> = target
            .iter()
            .filter(|(p, _)| !done.contains(*p))
            .filter_map(|(&p, &t)| match lso(p) {
                Ok(l) if l >= t => None,
                Ok(l) => Some(format!("{topic}/{p}: last stable offset {l} of {t}")),
                Err(e) => Some(format!("{topic}/{p}: {e}")),
            })
            .collect();
        if behind.is_empty() {
            break;
        }
        if began.elapsed() >= STALL {
            return Err(format!(
                "read stalled: a transaction open at the start did not end within {STALL:?} \
                 ({}; it holds read_committed readers back until its producer ends it, a new \
                 producer of its id aborts it, or the broker does after its timeout)",
                behind.join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    consumer
        .assign(&assignment)
        .map_err(|e| format!("assign: {e}"))?;
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut last_record = std::time::Instant::now();
    loop {
        if done.len() == target.len() {
            return Ok(());
        }
        if last_record.elapsed() >= STALL {
            let behind: Vec<String> = target
                .iter()
                .filter(|(p, _)| !done.contains(*p))
                .map(|(p, t)| format!("{topic}/{p} at offset {} of {t}", next.get(p).unwrap_or(&0)))
                .collect();
            return Err(format!(
                "read stalled: nothing arrived for {STALL:?} before the end ({})",
                behind.join(", ")
            ));
        }
        let Some(result) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = match result {
            // At or past the target (above); a compacted partition can end in offsets that
            // hold no record any more, and a transactional one in control records.
            Err(rdkafka::error::KafkaError::PartitionEOF(p)) => {
                // Checked again unless a record showed it: a new partition leader's last
                // stable offset may lag for a moment.
                if next.get(&p).is_some_and(|n| *n >= target[&p])
                    || lso(p).is_ok_and(|l| l >= target[&p])
                {
                    done.insert(p);
                }
                continue;
            }
            other => other.map_err(|e| format!("read: {e}"))?,
        };
        last_record = std::time::Instant::now();
        let p = m.partition();
        next.insert(p, m.offset() + 1);
        // A record past the target (committed after the read began) is kept too.
        each(Record::from(&m));
        // A record at the target's last offset or past it ends the partition too: the
        // consumer receives records in offset order, so everything committed below it was
        // received. Under a steady stream of writes this is how a read ends: the consumer may
        // never find itself at the end while records keep arriving.
        if m.offset() + 1 >= target[&p] {
            done.insert(p);
        }
    }
}

/// A consumer like [`consumer`] that reads uncommitted (for the high watermark only).
fn uncommitted(client: &KafkaClient) -> Result<ReaderConsumer, String> {
    reader(client.clone(), "read_uncommitted", None)
}
