//! Exactly-once into Apache Kafka (`kafka.exactly_once`), checked as a `read_committed`
//! consumer sees it: every message id once, nothing of an aborted transaction, and folded per
//! key in topic order the last message of every object equals the API server's. A replica is
//! SIGKILLed with a transaction open and started again (its checkpoint records are in the same
//! transactions as its messages, so it resumes exactly after the last commit); a frozen leader
//! (SIGSTOP) is replaced by the standby, whose producer fences it, and thawed: its late commit
//! is refused. Objects change all along, deletes included.

mod support;

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use serde_json::{Value, json};
use support::{
    ApiServer,
    config::{ConfigBuilder, kafka_sink},
    kafka::{Kafka, read_topic},
    objects::{configmap, configmap_with_data, typed},
    replica::Replica,
    wait::{self, Patience},
};

const TOPIC: &str = "k8s.test.core.configmaps";
const CHECKPOINTS: &str = "kube-event-bridge.checkpoints";
const OBJECTS: usize = 300;

/// Twelve namespaces: with sharding (by namespace), every shard has objects.
fn name_of(i: usize) -> (String, String) {
    (format!("ns-{}", i % 12), format!("cm-{i:03}"))
}

/// Changes objects at about `per_second` until `stop` ([`support::churn`]).
async fn write(api: Arc<ApiServer>, per_second: u64, stop: Arc<AtomicBool>) -> u64 {
    support::churn(api, OBJECTS, name_of, per_second, stop).await
}

/// The events a `read_committed` consumer reads, in topic order per partition.
fn committed(kafka: &Kafka) -> Vec<Value> {
    read_topic(&kafka.brokers(), TOPIC, true)
        .iter()
        .map(|r| r.json())
        .collect()
}

/// Waits until the committed events stop growing (nothing for 5 s), and returns them.
async fn quiet(kafka: &Kafka) -> Vec<Value> {
    let (mut last, mut since) = (usize::MAX, tokio::time::Instant::now());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let brokers = kafka.brokers();
        let events = tokio::task::spawn_blocking(move || {
            read_topic(&brokers, TOPIC, true)
                .iter()
                .map(|r| r.json())
                .collect::<Vec<Value>>()
        })
        .await
        .unwrap();
        if events.len() != last {
            (last, since) = (events.len(), tokio::time::Instant::now());
        } else if since.elapsed() >= Duration::from_secs(5) {
            return events;
        }
        assert!(tokio::time::Instant::now() < deadline, "never quiet");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The ids read more than once.
fn repeated_ids(events: &[Value]) -> Vec<String> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for e in events {
        *seen.entry(e["id"].as_str().unwrap()).or_default() += 1;
    }
    let mut repeated: Vec<String> = seen
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .map(|(id, _)| id.to_owned())
        .collect();
    repeated.sort();
    repeated
}

/// The `(key, resourceVersion, deleted)` of each state read more than once, whatever the
/// message's type (a restart that sends an object again sends it as `updated`).
fn repeated_states(events: &[Value]) -> Vec<(String, String, bool)> {
    let mut seen: HashMap<(String, String, bool), usize> = HashMap::new();
    for e in events {
        let meta = &e["data"]["object"]["metadata"];
        let key = format!(
            "{}/{}",
            meta["namespace"].as_str().unwrap_or(""),
            meta["name"].as_str().unwrap_or("")
        );
        let rv = meta["resourceVersion"].as_str().unwrap_or("").to_owned();
        let deleted = e["type"].as_str().unwrap_or("").ends_with(".deleted");
        *seen.entry((key, rv, deleted)).or_default() += 1;
    }
    let mut repeated: Vec<_> = seen
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .map(|(k, _)| k)
        .collect();
    repeated.sort();
    repeated
}

/// Checks what a `read_committed` consumer ends with: each id once, and the fold equals the
/// API server's objects. Returns the events read.
async fn assert_exactly_once(kafka: &Kafka, api: &ApiServer, what: &str) -> Vec<Value> {
    let events = quiet(kafka).await;
    let repeats = repeated_ids(&events);
    let copies = repeated_states(&events);
    let found = support::compare(&events, &api.objects("v1", "ConfigMap"));
    println!(
        "{what}: {} committed messages, {} ids read twice, {} states read twice; last message wins: {}",
        events.len(),
        repeats.len(),
        copies.len(),
        found.counts(),
    );
    assert!(found.is_empty(), "{what}: {found}");
    assert!(
        repeats.is_empty(),
        "{what}: {} ids read twice, for example {:?}",
        repeats.len(),
        &repeats[..repeats.len().min(5)]
    );
    assert!(
        copies.is_empty(),
        "{what}: {} states read twice, for example {:?}",
        copies.len(),
        &copies[..copies.len().min(5)]
    );
    events
}

/// The sink: exactly once (at least once with `EOS_OFF` set, to see what this test catches
/// without it), and checkpoint writes of its own far apart: at least once, a crash re-sends
/// up to 10 s of acknowledgements; exactly once, the checkpoint records travel with the
/// messages and this interval does not matter.
fn eos_sink(kafka: &Kafka, interval: &str) -> Value {
    let mut sink = kafka_sink(
        "kafka",
        &kafka.brokers(),
        json!({"exactly_once": std::env::var("EOS_OFF").is_err(),
               "transaction_interval": interval, "transaction_timeout": "30s"}),
    );
    sink["checkpoint_interval"] = json!("10s");
    sink
}

/// A replica's config with leader election as `identity` (the tests' fast timings) and
/// `shards` shards: ConfigMaps to `sink`.
fn elected(sink: &Value, identity: &str, shards: u32) -> Value {
    ConfigBuilder::new()
        .configmaps()
        .sink(sink.clone())
        .route("configmap", &["kafka"])
        .fast_leader_election(identity, "200ms")
        .set("sharding", json!({ "shards": shards }))
        .value()
}

async fn seeded() -> Arc<ApiServer> {
    let api = Arc::new(ApiServer::start().await);
    for i in 0..OBJECTS {
        let (ns, name) = name_of(i);
        api.create(typed(&configmap(&ns, &name, "0")));
    }
    api
}

/// Waits until a `read_committed` consumer has every object's first state.
async fn first_states(kafka: &Kafka, replicas: &[&Replica]) {
    let patience = Patience::of(Duration::from_secs(90)).polling(Duration::from_millis(500));
    let brokers = kafka.brokers();
    wait::until("every first state committed", patience, async || {
        let brokers = brokers.clone();
        let n = tokio::task::spawn_blocking(move || read_topic(&brokers, TOPIC, true).len())
            .await
            .unwrap();
        if n < OBJECTS {
            for r in replicas {
                if let Some(line) = r
                    .log()
                    .lines()
                    .rev()
                    .find(|l| l.contains("WARN") || l.contains("ERROR"))
                {
                    println!("{}: {line}", r.identity);
                }
            }
        }
        n >= OBJECTS
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_transaction_resumes_exactly_after_the_last_commit() {
    let kafka = Kafka::start();
    kafka.create_topic(TOPIC, 3);
    let api = seeded().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.write_kubeconfig(dir.path());
    // Long transactions: the kill lands in an open one.
    let sink = eos_sink(&kafka, "3s");
    let config = ConfigBuilder::new()
        .configmaps()
        .sink(sink)
        .route("configmap", &["kafka"])
        .value();
    let first = Replica::start(dir.path(), "first", &config, &kubeconfig);
    first_states(&kafka, &[&first]).await;
    assert!(
        std::env::var("EOS_OFF").is_ok() || first.log().contains("Transactions on"),
        "the producer is transactional"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write(api.clone(), 30, stop.clone()));
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    drop(first); // SIGKILL, a transaction open
    // Read after the kill: a commit landing between a read and the kill would make the
    // figures lie about the open transaction.
    let at_kill = (
        read_topic(&kafka.brokers(), TOPIC, true).len(),
        read_topic(&kafka.brokers(), TOPIC, false).len(),
    );
    println!("at the kill: {at_kill:?} (committed, all)");
    // Changes and deletes while nothing runs.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (brokers, before) = (kafka.brokers(), committed(&kafka).len());
    let second = Replica::start(dir.path(), "second", &config, &kubeconfig);
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let changes = writer.await.unwrap();
    let events = assert_exactly_once(&kafka, &api, "killed and restarted").await;
    // The kill hit an open transaction: its records are in the log, aborted (the restarted
    // replica's producer fenced them), and no committed reader saw them.
    let all = tokio::task::spawn_blocking(move || read_topic(&brokers, TOPIC, false).len())
        .await
        .unwrap();
    println!(
        "{changes} changes; {before} committed before the restart; {all} records in the topic, {} committed",
        events.len()
    );
    assert!(
        all > events.len(),
        "the killed replica's open transaction left aborted records ({all} records, {} committed)",
        events.len()
    );
    // The checkpoint topic is read the same way: its records came with the messages.
    let checkpoints = read_topic(&kafka.brokers(), CHECKPOINTS, true);
    assert!(checkpoints.len() >= OBJECTS, "{}", checkpoints.len());
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_is_fenced_by_the_next_ones_producer() {
    let kafka = Kafka::start();
    kafka.create_topic(TOPIC, 3);
    let api = seeded().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.write_kubeconfig(dir.path());
    let sink = eos_sink(&kafka, "1s");
    let config = |identity: &str| elected(&sink, identity, 1);
    let a = Replica::start(dir.path(), "a", &config("a"), &kubeconfig);
    let leads = |who: &str| api.lease_holder_of("kube-event-bridge").as_deref() == Some(who);
    wait::until(
        "a leads",
        Patience::of(Duration::from_secs(30)),
        async || leads("a"),
    )
    .await;
    let b = Replica::start(dir.path(), "b", &config("b"), &kubeconfig);
    first_states(&kafka, &[&a, &b]).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write(api.clone(), 30, stop.clone()));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    a.signal("STOP");
    wait::until(
        "b leads",
        Patience::of(Duration::from_secs(30)),
        async || leads("b"),
    )
    .await;
    // b publishes for a while; then a thaws with its transaction open.
    tokio::time::sleep(Duration::from_secs(4)).await;
    a.signal("CONT");
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let changes = writer.await.unwrap();
    println!("{changes} changes");
    assert!(
        std::env::var("EOS_OFF").is_ok() || b.log().contains("Transactions on"),
        "b's producer started transactions"
    );
    assert_exactly_once(&kafka, &api, "a frozen leader thawed after b took over").await;
    drop((a, b));
}

/// A record the broker refuses (too large for the topic's `max.message.bytes`, which the
/// producer cannot know) aborts its transaction: the other messages of that transaction go
/// again in the next one, the refused one goes again trimmed, and a `read_committed` reader
/// reads each object once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_broker_refuses_aborts_its_transaction_and_the_rest_goes_again_once() {
    let kafka = Kafka::start();
    kafka.create_topic_with(TOPIC, 3, &[("max.message.bytes", "6000")]);
    let api = Arc::new(ApiServer::start().await);
    for i in 0..OBJECTS {
        let (ns, name) = name_of(i);
        if i % 60 == 7 {
            // Incompressible (the producer compresses with lz4).
            let mut x = i as u64 + 1;
            let big: String = (0..20_000)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    char::from(b'a' + (x >> 59) as u8 % 26)
                })
                .collect();
            api.create(typed(&configmap_with_data(
                &ns,
                &name,
                [("v", big.as_str())],
            )));
        } else {
            api.create(typed(&configmap(&ns, &name, "0")));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.write_kubeconfig(dir.path());
    // Batches below the topic's limit: only the big objects' records are refused (Kafka
    // refuses a whole batch over `max.message.bytes`, and librdkafka does not split it).
    let mut sink = eos_sink(&kafka, "500ms");
    sink["kafka"]["properties"] = json!({"batch.size": "4000"});
    let config = ConfigBuilder::new()
        .configmaps()
        .sink(sink)
        .route("configmap", &["kafka"])
        .value();
    let replica = Replica::start(dir.path(), "one", &config, &kubeconfig);
    first_states(&kafka, &[&replica]).await;
    let events = assert_exactly_once(&kafka, &api, "records refused by the broker").await;
    let truncated = events.iter().filter(|e| e["k8struncated"] == true).count();
    assert_eq!(truncated, OBJECTS.div_ceil(60), "the big objects, trimmed");
    let (_, metrics) = support::http_get(replica.admin().unwrap(), "/metrics").await;
    let count = |outcome: &str| -> f64 {
        let series =
            format!("keb_kafka_transactions_total{{outcome=\"{outcome}\",sink=\"kafka\"}}");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} not in the metrics"))
    };
    let (committed, aborted) = (count("committed"), count("aborted"));
    println!("transactions: {committed} committed, {aborted} aborted");
    assert!(
        aborted >= 1.0,
        "the refused records aborted their transactions"
    );
    let all = read_topic(&kafka.brokers(), TOPIC, false).len();
    assert!(all > events.len(), "aborted copies are in the log: {all}");
    drop(replica);
}

/// Sharded (four shards, each with a transactional producer of its own, `transactional.id`
/// ending in the shard): a replica alone owns every shard; two more join and it hands shards
/// on drained; then one of them is SIGKILLed and the others take its shards over, fencing its
/// producers. Objects change all along; a `read_committed` reader reads each change once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_handed_on_and_taken_over_deliver_each_change_once() {
    const SHARDS: u32 = 4;
    let kafka = Kafka::start();
    kafka.create_topic(TOPIC, 3);
    let api = seeded().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.write_kubeconfig(dir.path());
    let sink = eos_sink(&kafka, "500ms");
    let config = |identity: &str| elected(&sink, identity, SHARDS);
    let holders = || {
        (0..SHARDS)
            .map(|s| api.lease_holder_of(&format!("kube-event-bridge-shard-{s}-of-{SHARDS}")))
            .collect::<Vec<_>>()
    };
    let patience = Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(200));
    let a = Replica::start(dir.path(), "a", &config("a"), &kubeconfig);
    wait::until("a owns every shard", patience, async || {
        holders().iter().all(|h| h.as_deref() == Some("a"))
    })
    .await;
    first_states(&kafka, &[&a]).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write(api.clone(), 30, stop.clone()));
    let b = Replica::start(dir.path(), "b", &config("b"), &kubeconfig);
    let c = Replica::start(dir.path(), "c", &config("c"), &kubeconfig);
    wait::until("the shards spread over three", patience, async || {
        let h = holders();
        ["a", "b", "c"]
            .iter()
            .all(|id| h.iter().any(|x| x.as_deref() == Some(*id)))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(b); // SIGKILL, its shards' transactions open
    wait::until("a and c own every shard", patience, async || {
        holders()
            .iter()
            .all(|h| matches!(h.as_deref(), Some("a" | "c")))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let changes = writer.await.unwrap();
    println!("{changes} changes");
    for r in [&a, &c] {
        assert!(
            std::env::var("EOS_OFF").is_ok() || r.log().contains("Transactions on"),
            "{} made transactional producers",
            r.identity
        );
    }
    assert_exactly_once(&kafka, &api, "sharded: hand-overs and a takeover").await;
    drop((a, c));
}
