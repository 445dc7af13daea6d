//! Reading Kafka topics from their first offset to their current end: what the checkpoint
//! store and the `state` command need (a compacted topic folded into its last value per key).
//!
//! # Recovery
//! Reads are `read_committed`: a transaction's records once it committed, never an aborted
//! one's. The end of a read is each partition's high watermark as it was when the read began
//! (or the end the broker reports: with transactions, the last stable offset), and also quiet: a read that has reached every watermark ends once nothing arrived for
//! [`QUIET`] (some Kafka-protocol brokers report the watermark of a multi-record batch late or
//! early; nothing is taken as the end while records still come). A read that receives nothing
//! at all for [`STALL`] before the watermarks is an error naming how far it got: a partial
//! read is never taken for the whole topic (a checkpoint missing its newest records would
//! lose the deletes made while down, or delete live objects).

use std::{collections::HashMap, time::Duration};

use rdkafka::{
    Message as _, Offset, TopicPartitionList,
    consumer::{BaseConsumer, Consumer},
    message::{BorrowedMessage, Headers},
};

use super::client::{KafkaClient, KafkaContext};

/// How long the brokers get to answer metadata requests.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// A read at every high watermark that receives nothing for this long is complete.
pub const QUIET: Duration = Duration::from_millis(500);
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

/// A consumer with a sink's brokers and security settings, for manual assignment: no group
/// membership, no committed offsets (the producer settings of `config` are left out). It
/// reports the end of each partition (`KafkaError::PartitionEOF`) from `poll`, which the
/// context does not log. Blocking with `OAUTHBEARER` (a token request, unless the newest token
/// is young).
pub fn consumer(client: impl Into<KafkaClient>) -> Result<ReaderConsumer, String> {
    let client = client.into();
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
        // What a transaction committed, never what one aborted or has not committed yet
        // (exactly-once sinks): the end of a partition is its last stable offset.
        .set("isolation.level", "read_committed")
        .set("group.id", "kube-event-bridge-reader");
    client
        .create(&config, |c: &ReaderConsumer| c.client())
        .map_err(|e| format!("consumer: {e}"))
}

/// Reads every partition of `topics` from its first offset to its end (blocking; run it off
/// the async threads) and hands each record to `each`, in offset order per partition.
/// `client` holds the brokers and security settings; consumer settings are added here.
/// Errors are the reason, for the caller to name what it was reading.
pub fn read_to_end(
    client: impl Into<KafkaClient>,
    topics: &[String],
    mut each: impl FnMut(Record),
) -> Result<(), String> {
    let client = client.into();
    // One topic at a time: the end of a partition (`PartitionEOF`) names no topic, and with
    // transactions it is how a read ends (the commit markers after the last record leave its
    // next offset below the high watermark).
    for topic in topics {
        read_topic_to_end(&client, std::slice::from_ref(topic), &mut each)?;
    }
    Ok(())
}

fn read_topic_to_end(
    client: &KafkaClient,
    topics: &[String],
    each: &mut impl FnMut(Record),
) -> Result<(), String> {
    let consumer = consumer(client)?;
    let mut assignment = TopicPartitionList::new();
    let mut high = HashMap::new();
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), TIMEOUT).map_err(|e| {
            format!("metadata of {topic}: {e} (does this client have DESCRIBE and READ on it?)")
        })?;
        for t in metadata.topics() {
            if let Some(e) = t.error() {
                return Err(format!("topic {topic}: {e:?}"));
            }
            for p in t.partitions() {
                let (_, hi) = consumer
                    .fetch_watermarks(topic, p.id(), TIMEOUT)
                    .map_err(|e| format!("watermarks of {topic}/{}: {e}", p.id()))?;
                high.insert((topic.clone(), p.id()), hi);
                assignment
                    .add_partition_offset(topic, p.id(), Offset::Beginning)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    consumer
        .assign(&assignment)
        .map_err(|e| format!("assign: {e}"))?;
    let mut next: HashMap<(String, i32), i64> = high.keys().map(|k| (k.clone(), 0)).collect();
    // Partitions the broker said were read to their end (a compacted topic can end in offsets
    // that hold no record any more, so `next` may never reach the watermark). The EOF names a
    // partition but not its topic: it counts only when one topic is read.
    let mut at_end: std::collections::HashSet<(String, i32)> = Default::default();
    let mut last_record = std::time::Instant::now();
    loop {
        let done = next
            .iter()
            .all(|(k, n)| *n >= high[k] || at_end.contains(k));
        if done && last_record.elapsed() >= QUIET {
            return Ok(());
        }
        if last_record.elapsed() >= STALL {
            let behind: Vec<String> = next
                .iter()
                .filter(|(k, n)| **n < high[*k])
                .map(|((t, p), n)| format!("{t}/{p} at offset {n} of {}", high[&(t.clone(), *p)]))
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
            Err(rdkafka::error::KafkaError::PartitionEOF(p)) => {
                if let [topic] = topics {
                    at_end.insert((topic.clone(), p));
                }
                continue;
            }
            other => other.map_err(|e| format!("read: {e}"))?,
        };
        last_record = std::time::Instant::now();
        next.insert((m.topic().to_owned(), m.partition()), m.offset() + 1);
        at_end.remove(&(m.topic().to_owned(), m.partition()));
        each(Record::from(&m));
    }
}
