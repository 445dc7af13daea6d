//! Which wait a new leader owes the last one's messages, against a real kube-apiserver and
//! Apache Kafka (and nats-server): with `exactly_once`, the taker's transactional producers
//! fence the last holder's when its term begins, so it waits only for what the holder sent
//! otherwise (see `kube-event-bridge.io/fenced-by` in docs/src/leader-election.md).
//!
//! - A leader frozen (SIGSTOP) while it publishes with `exactly_once`: the standby takes the
//!   Lease over and publishes well before the delivery timeout's wait would have ended; the
//!   frozen one, thawed, commits nothing (a `read_committed` reader sees each message id
//!   once, and folds to the API server's objects).
//! - Beside a NATS sink, the taker waits for the NATS part only; a taker whose holder
//!   announced ids it does not fence (exactly-once switched off in a rollout) waits in full.
//! - Sharded: a replica SIGKILLed with transactions open on its shards stalls no shard's
//!   `read_committed` stream (nor the takers' checkpoint loads) until `transaction_timeout`:
//!   each taker's producer ends its shard's open transaction.

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use support::{
    cluster::Cluster,
    config::{ConfigBuilder, kafka_sink, nats_sink},
    kafka::{Kafka, read_topic},
    nats::NatsServer,
    objects::{configmap, configmaps},
    parity::ready,
    replica::{Replica, dump},
    wait::{self, Patience},
};

/// Objects the writer changes, spread over [`NAMESPACES`] namespaces.
const OBJECTS: usize = 120;
const NAMESPACES: usize = 12;
/// The sinks' delivery timeout: with the tests' leases (3 s, renew deadline 2 s), a taker
/// that cannot fence the holder waits 19 s.
const DELIVERY: &str = "20s";
const FULL_WAIT: Duration = Duration::from_secs(19);

fn name_of(i: usize) -> (String, String) {
    (format!("takeover-{}", i % NAMESPACES), format!("cm-{i:03}"))
}

/// Creates every object, then changes them (updates mostly, deletes and re-creates), each
/// change's value the count of changes so far, until `stop`; `made` counts them.
async fn writer(
    client: kube::Client,
    made: Arc<AtomicU64>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let api = |ns: &str| Api::<ConfigMap>::namespaced(client.clone(), ns);
    let pp = PostParams::default();
    for i in 0..OBJECTS {
        let (ns, name) = name_of(i);
        api(&ns)
            .create(&pp, &configmap(&ns, &name, "0"))
            .await
            .unwrap();
    }
    let mut k = 0u64;
    while !*stop.borrow() {
        k += 1;
        let (ns, name) = name_of((k * 7919 % OBJECTS as u64) as usize);
        let value = k.to_string();
        let done = match api(&ns).get_opt(&name).await.unwrap() {
            None => api(&ns)
                .create(&pp, &configmap(&ns, &name, &value))
                .await
                .map(drop),
            Some(_) if k.is_multiple_of(7) => api(&ns)
                .delete(&name, &DeleteParams::default())
                .await
                .map(drop),
            Some(_) => api(&ns)
                .replace(&name, &pp, &configmap(&ns, &name, &value))
                .await
                .map(drop),
        };
        if let Err(e) = done {
            println!("writer: {e}");
        }
        made.store(k, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The writer, running.
struct Writing {
    made: Arc<AtomicU64>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writing {
    async fn start(cluster: &Cluster) -> Self {
        let made = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(writer(cluster.client().await, made.clone(), stopped));
        Self { made, stop, task }
    }

    /// How many changes it made so far.
    fn made(&self) -> u64 {
        self.made.load(Ordering::SeqCst)
    }

    /// Waits until a `read_committed` reader of `topic` reads a change past the `n`th.
    async fn published(&self, kafka: &Kafka, topic: &str, n: u64) {
        wait::until(
            "changes published",
            Patience::of(Duration::from_secs(90)),
            async || {
                committed(kafka, topic)
                    .await
                    .iter()
                    .any(|e| change_of(e) > n)
            },
        )
        .await;
    }

    async fn stop(self) {
        self.stop.send_replace(true);
        self.task.await.unwrap();
    }
}

/// The writer's change count an event carries (0 for deletes and the first states).
fn change_of(e: &Value) -> u64 {
    if e["type"].as_str().is_some_and(|t| t.ends_with(".deleted")) {
        return 0;
    }
    e["data"]["object"]["data"]["v"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// What a `read_committed` consumer of `topic` reads, as JSON.
async fn committed(kafka: &Kafka, topic: &str) -> Vec<Value> {
    let (brokers, topic) = (kafka.brokers(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        read_topic(&brokers, &topic, true)
            .iter()
            .map(|r| r.json())
            .collect()
    })
    .await
    .unwrap()
}

/// Message ids read more than once.
fn repeated(events: &[Value]) -> usize {
    let ids: BTreeSet<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
    events.len() - ids.len()
}

/// A Kafka sink `name` into `topic` with `exactly_once` as given.
fn kafka_out(kafka: &Kafka, name: &str, topic: &str, exactly_once: bool) -> Value {
    kafka_sink(
        name,
        &kafka.brokers(),
        json!({
            "topic": topic, "checkpoint_topic": format!("{topic}.checkpoints"),
            "delivery_timeout": DELIVERY, "exactly_once": exactly_once,
            "transaction_interval": "1s", "transaction_timeout": "60s",
        }),
    )
}

/// A replica of cluster `cluster` with the tests' fast leader election (and `shards`),
/// ConfigMaps of every namespace routed to every one of `sinks`.
fn replica(
    dir: &Path,
    identity: &str,
    cluster: &str,
    sinks: &[&Value],
    shards: u32,
    kubeconfig: &Path,
) -> Replica {
    let names: Vec<&str> = sinks.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let mut config = ConfigBuilder::new()
        .cluster(cluster)
        .grace_period("5s")
        .resource(json!({
            "name": "configmap", "api_version": "v1", "kind": "ConfigMap",
            "namespaces": (0..NAMESPACES).map(|n| format!("takeover-{n}")).collect::<Vec<_>>(),
        }))
        .fast_leader_election(identity, "200ms")
        .set("sharding", json!({ "shards": shards }));
    for s in sinks {
        config = config.sink((*s).clone());
    }
    let config = config.route("configmap", &names).value();
    Replica::start(dir, identity, &config, kubeconfig)
}

async fn holder(leases: &Api<Lease>, name: &str) -> Option<String> {
    leases
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty())
}

/// Waits until `identity` holds Lease `name`.
async fn until_held(leases: &Api<Lease>, name: &str, identity: &str) {
    wait::until(
        &format!("{identity} holds {name}"),
        Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(100)),
        async || holder(leases, name).await.as_deref() == Some(identity),
    )
    .await;
}

/// Waits until what `read` returns folds to the API server's ConfigMaps, and returns it.
async fn folds_to_the_server<F: AsyncFn() -> Vec<Value>>(
    cluster: &Cluster,
    what: &str,
    read: F,
) -> Vec<Value> {
    let mut events = Vec::new();
    let mut left = String::new();
    let folded = wait::within(Patience::of(Duration::from_secs(60)), async || {
        events = read().await;
        let d = support::compare(&events, &live(cluster).await);
        left = d.to_string();
        d.is_empty()
    })
    .await;
    assert!(
        folded,
        "{what}: the stream does not fold to the server's objects: {left}"
    );
    events
}

/// The API server's ConfigMaps of every namespace the writer uses.
async fn live(cluster: &Cluster) -> BTreeMap<String, (String, String)> {
    let mut all = BTreeMap::new();
    for n in 0..NAMESPACES {
        all.extend(
            cluster
                .objects(&configmaps(), Some(&format!("takeover-{n}")))
                .await,
        );
    }
    all
}

async fn cluster_with_namespaces() -> Cluster {
    let cluster = Cluster::start().await;
    for n in 0..NAMESPACES {
        cluster.create_namespace(&format!("takeover-{n}")).await;
    }
    cluster
}

/// A leader frozen with `exactly_once`: the taker's producer fences it at once, and the
/// taker publishes without the 19 s its delivery timeout would make it wait; thawed, the
/// frozen leader commits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_taker_fences_the_frozen_leader_instead_of_waiting() {
    let cluster = cluster_with_namespaces().await;
    let kafka = Kafka::shared();
    let topic = "k8s.fences.core.configmaps";
    kafka.create_topic(topic, 3);
    let sink = kafka_out(kafka, "out", topic, true);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| {
            (
                id.to_owned(),
                replica(dir.path(), id, "fences", &[&sink], 1, &kubeconfig),
            )
        })
        .collect();
    let leases: Api<Lease> = Api::namespaced(cluster.client().await, "kube-system");
    let mut frozen = None;
    wait::until(
        "a leader",
        Patience::of(Duration::from_secs(60)),
        async || {
            frozen = holder(&leases, "kube-event-bridge").await;
            frozen.is_some()
        },
    )
    .await;
    let frozen = frozen.unwrap();
    let taker = replicas.keys().find(|k| **k != frozen).unwrap().clone();
    ready(&replicas[&frozen]).await;
    let writing = Writing::start(&cluster).await;
    writing.published(kafka, topic, 50).await;
    replicas[&frozen].signal("STOP");
    until_held(&leases, "kube-event-bridge", &taker).await;
    let (taken, made_then) = (Instant::now(), writing.made());
    // The first change made after the takeover, committed by the taker.
    let mut first = None;
    wait::until(
        "the taker publishes a change made after it took the Lease",
        Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(200)),
        async || {
            let found = committed(kafka, topic)
                .await
                .iter()
                .any(|e| change_of(e) > made_then);
            if found {
                first = Some(taken.elapsed());
            }
            found
        },
    )
    .await;
    let first = first.unwrap();
    let log = replicas[&taker].log();
    for line in log.lines().filter(|l| {
        ["lease", "Transactions", "Leading", "esum", "takeover"]
            .iter()
            .any(|w| l.contains(w))
    }) {
        println!("taker: {line}");
    }
    println!(
        "the taker's first change committed {first:?} after it took the Lease (a full wait: {FULL_WAIT:?})"
    );
    assert!(
        log.contains("fenced the last leader's transactions"),
        "the taker knew its producer fences the holder's: {}",
        log.lines()
            .filter(|l| l.contains("lease"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        first < FULL_WAIT,
        "published {first:?} after the takeover: not before the full wait ({FULL_WAIT:?}) would have ended"
    );
    replicas[&frozen].signal("CONT");
    tokio::time::sleep(Duration::from_secs(4)).await;
    writing.stop().await;
    let events = folds_to_the_server(&cluster, "exactly once across the freeze", async || {
        committed(kafka, topic).await
    })
    .await;
    for r in replicas.values_mut() {
        r.terminate();
    }
    let events_after = committed(kafka, topic).await;
    let n = repeated(&events_after);
    println!(
        "{} committed messages, {n} repeated ids ({} when it folded)",
        events_after.len(),
        events.len()
    );
    assert_eq!(
        n, 0,
        "the thawed leader committed nothing: no message id twice"
    );
}

/// The wait a taker owes: beside a NATS sink, only the NATS part (its `ack_timeout`, 6 s,
/// beyond the lease's margin: 5 s), not the Kafka sink's 19 s; and in full (19 s) when the
/// holder's transactional ids are not fenced by the taker's (exactly-once switched off in a
/// rollout). Both streams fold to the API server's objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taker_waits_only_for_what_its_producers_do_not_fence() {
    let cluster = cluster_with_namespaces().await;
    let kafka = Kafka::shared();
    let nats = NatsServer::start();
    let topic = "k8s.waits.core.configmaps";
    kafka.create_topic(topic, 3);
    let side = nats_sink("side", &nats.url(), json!({"ack_timeout": "6s"}));
    let eos = kafka_out(kafka, "out", topic, true);
    let plain = kafka_out(kafka, "out", topic, false);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let leases: Api<Lease> = Api::namespaced(cluster.client().await, "kube-system");
    let lease = "kube-event-bridge";
    let mut a = replica(
        dir.path(),
        "replica-a",
        "waits",
        &[&eos, &side],
        1,
        &kubeconfig,
    );
    until_held(&leases, lease, "replica-a").await;
    ready(&a).await;
    let mut b = replica(
        dir.path(),
        "replica-b",
        "waits",
        &[&eos, &side],
        1,
        &kubeconfig,
    );
    let writing = Writing::start(&cluster).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    a.signal("KILL");
    until_held(&leases, lease, "replica-b").await;
    let waited = |r: &Replica| {
        r.log()
            .lines()
            .find(|l| l.contains("Took the lease over; publishing after the takeover wait"))
            .map(str::to_owned)
    };
    wait::until(
        "b's wait logged",
        Patience::of(Duration::from_secs(10)),
        async || waited(&b).is_some(),
    )
    .await;
    let b_wait = waited(&b).unwrap();
    println!("b: {b_wait}");
    assert!(
        b_wait.contains("wait=19s") && b_wait.contains("fenced_wait=5s"),
        "b waits for the NATS sink only: {b_wait}"
    );
    ready(&b).await;
    // A rollout switches exactly-once off: c cannot fence b's transactions.
    let mut c = replica(
        dir.path(),
        "replica-c",
        "waits",
        &[&plain, &side],
        1,
        &kubeconfig,
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    b.signal("KILL");
    until_held(&leases, lease, "replica-c").await;
    wait::until(
        "c's wait logged",
        Patience::of(Duration::from_secs(10)),
        async || waited(&c).is_some(),
    )
    .await;
    let c_wait = waited(&c).unwrap();
    println!("c: {c_wait}");
    assert!(
        c_wait.contains("wait=19s") && !c_wait.contains("fenced_wait"),
        "c waits in full: {c_wait}"
    );
    assert!(!c.log().contains("fenced the last leader's transactions"));
    ready(&c).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    writing.stop().await;
    folds_to_the_server(&cluster, "Kafka", async || committed(kafka, topic).await).await;
    let url = nats.url();
    folds_to_the_server(&cluster, "JetStream", async || {
        support::nats::read_stream(&url, support::config::NATS_STREAM)
            .await
            .iter()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
            .collect()
    })
    .await;
    for r in [&mut a, &mut b, &mut c] {
        r.terminate();
    }
}

/// Sharded with `exactly_once`: three replicas share six shards; one is SIGKILLed with
/// transactions open on its shards. Each taker's producer ends its shard's open transaction,
/// so a `read_committed` reader reads every namespace's changes made after the kill before
/// a taker that cannot fence would even have begun (19 s), let alone `transaction_timeout`
/// (60 s), and reads each id once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_takeover_after_a_sigkill_stalls_no_shard_until_the_transaction_timeout() {
    const SHARDS: u32 = 6;
    let cluster = cluster_with_namespaces().await;
    let kafka = Kafka::shared();
    let topic = "k8s.shards.core.configmaps";
    kafka.create_topic(topic, 3);
    let mut sink = kafka_out(kafka, "out", topic, true);
    // Transactions open long: the kill lands in one on each shard.
    sink["kafka"]["transaction_interval"] = json!("3s");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let leases: Api<Lease> = Api::namespaced(cluster.client().await, "kube-system");
    let mut replicas: Vec<Replica> = ["replica-a", "replica-b", "replica-c"]
        .into_iter()
        .map(|id| replica(dir.path(), id, "shards", &[&sink], SHARDS, &kubeconfig))
        .collect();
    let holders = async || {
        let mut out = Vec::new();
        for s in 0..SHARDS {
            out.push(holder(&leases, &format!("kube-event-bridge-shard-{s}-of-{SHARDS}")).await);
        }
        out
    };
    let spread = wait::within(Patience::of(Duration::from_secs(180)), async || {
        support::replica::shards_spread(&holders().await, &[], 3)
    })
    .await;
    if !spread {
        dump(&replicas);
        panic!(
            "the shards did not spread over three replicas: {:?}",
            holders().await
        );
    }
    let writing = Writing::start(&cluster).await;
    writing.published(kafka, topic, 100).await;
    let owned = holders().await;
    let victim = replicas
        .iter()
        .position(|r| owned.iter().flatten().any(|h| *h == r.identity))
        .expect("a replica owns a shard");
    let gone = replicas[victim].identity.clone();
    println!(
        "SIGKILL {gone}, holding shards {:?}",
        owned
            .iter()
            .enumerate()
            .filter(|(_, h)| h.as_deref() == Some(gone.as_str()))
            .map(|(s, _)| s)
            .collect::<Vec<_>>()
    );
    replicas[victim].signal("KILL");
    let (killed, made_then) = (Instant::now(), writing.made());
    // Every namespace (every shard) shows a change made after the kill.
    let mut seen = BTreeMap::new();
    let all = wait::within(
        Patience::of(FULL_WAIT).polling(Duration::from_millis(500)),
        async || {
            for e in committed(kafka, topic).await {
                if change_of(&e) > made_then {
                    let ns = e["k8snamespace"].as_str().unwrap_or_default().to_owned();
                    seen.entry(ns).or_insert_with(|| killed.elapsed());
                }
            }
            seen.len() == NAMESPACES
        },
    )
    .await;
    println!(
        "after the kill, each namespace's first change committed after: {seen:?}; holders {:?}",
        holders().await
    );
    if !all {
        dump(&replicas);
        panic!(
            "not every namespace's changes were readable within {FULL_WAIT:?} of the kill (the wait a taker that cannot fence owes; transaction_timeout 60 s): {seen:?}"
        );
    }
    writing.stop().await;
    folds_to_the_server(&cluster, "sharded exactly once", async || {
        committed(kafka, topic).await
    })
    .await;
    for r in &mut replicas {
        r.terminate();
    }
    let events = committed(kafka, topic).await;
    assert_eq!(repeated(&events), 0, "each id once");
}
