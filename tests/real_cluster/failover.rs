//! Leader failover on the real server: a SIGKILLed leader replaced with nothing lost, and a
//! fenced Kafka producer's health; the Lease helpers the other modules share.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use serde_json::{Value, json};

use crate::{
    replica_to,
    support::{
        self,
        broker::Broker,
        cluster::Cluster,
        event_type,
        objects::configmaps,
        parity::{Rng, ready, seed, workload},
        replica::Replica,
        wait::{self, Patience},
    },
};

/// The holder of Lease `kube-system/{name}`, if any.
pub(crate) async fn lease_holder(cluster: &Cluster, name: &str) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(cluster.client().await, "kube-system");
    leases
        .get_opt(name)
        .await
        .unwrap()
        .and_then(|l| l.spec?.holder_identity)
}

/// Waits until `identity` holds the Lease `kube-system/kube-event-bridge`.
pub(crate) async fn leads(cluster: &Cluster, identity: &str, patience: Duration) {
    wait::until(
        &format!("{identity} leads"),
        Patience::of(patience),
        async || lease_holder(cluster, "kube-event-bridge").await.as_deref() == Some(identity),
    )
    .await;
}

/// Waits until some replica holds the Lease `kube-system/kube-event-bridge`; returns it.
pub(crate) async fn first_leader(cluster: &Cluster) -> String {
    let mut leader = None;
    wait::until(
        "a leader",
        Patience::of(Duration::from_secs(60)),
        async || {
            leader = lease_holder(cluster, "kube-event-bridge").await;
            leader.is_some()
        },
    )
    .await;
    leader.unwrap()
}

/// Changes the ConfigMaps of `ns` (the seeded workload over 100 objects), `batch` at a time
/// every `pause`, until `stop`; the task returns how many changes it made.
async fn spawn_writer(
    cluster: &Cluster,
    ns: &'static str,
    batch: usize,
    pause: Duration,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    let client = cluster.client().await;
    tokio::spawn(async move {
        let api: Api<ConfigMap> = Api::namespaced(client, ns);
        let mut rng = Rng(seed());
        let mut changes = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            workload(&api, ns, &mut rng, 100, batch).await;
            changes += batch;
            tokio::time::sleep(pause).await;
        }
        changes
    })
}

/// What a consumer that drops messages older than what it holds would lose, and whether
/// deletes are identified by what they delete: per key, in destination order, every message
/// whose `k8sresourceversion` is below one before it (the versions of a real kube-apiserver
/// are etcd revisions, so this consumer compares them as numbers); the deletes whose id is
/// not `uid:resourceVersion:deleted` of the state they delete (the stub's, for a resumed
/// one: the checkpoint's, not the version the taker's list found it gone at, so every
/// replica resuming from that checkpoint gives the same id); and how many objects' deletes
/// came twice, seen on a watch and resumed.
fn versions_and_delete_ids(events: &[Value]) -> (Vec<String>, Vec<String>, usize) {
    let mut newest: BTreeMap<&str, u64> = BTreeMap::new();
    let mut backwards = Vec::new();
    let mut wrong_ids = Vec::new();
    let mut delete_kinds: BTreeMap<&str, BTreeSet<bool>> = BTreeMap::new();
    for e in events {
        let key = e["subject"].as_str().unwrap();
        let rv: u64 = e["k8sresourceversion"].as_str().unwrap().parse().unwrap();
        let held = newest.entry(key).or_insert(rv);
        if rv < *held {
            backwards.push(format!(
                "{key}: {} at {rv} after {held}{}",
                event_type(e),
                if e["k8sresumed"] == true {
                    " (resumed)"
                } else {
                    ""
                }
            ));
        } else {
            *held = rv;
        }
        if event_type(e) == "deleted" {
            let uid = e["k8suid"].as_str().unwrap();
            let deleted = e["data"]["object"]["metadata"]["resourceVersion"]
                .as_str()
                .unwrap();
            let id = e["id"].as_str().unwrap();
            if id != format!("{uid}:{deleted}:deleted") {
                wrong_ids.push(format!("{key}: {id} deletes {deleted}"));
            }
            delete_kinds
                .entry(uid)
                .or_default()
                .insert(e["k8sresumed"] == true);
        }
    }
    let twice = delete_kinds.values().filter(|k| k.len() == 2).count();
    (backwards, wrong_ids, twice)
}

/// Leader failover between two replicas on the real API server: the leader (holding the
/// Lease in `kube-system`) is SIGKILLed while objects change at about 100 per second; the
/// standby takes the Lease over and publishes what changed since the last checkpoint.
/// Folded per key in the destination's order, in both consumer models, the stream ends with
/// the API server's objects. Checkpoints are written every 2 s, so that the taker resumes
/// from one older than what the killed leader published: no key's messages go back in
/// `k8sresourceversion` (a resumed delete reports the version its list found it gone at,
/// not the checkpoint's), and each delete's id names the state it deletes, not anything of
/// the replica that sent it.
async fn failover(destination: Broker, cluster_name: &str) {
    let cluster = Cluster::start().await;
    let ns = "failover";
    cluster.create_namespace(ns).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let mut sink = destination.sink("out");
    sink["checkpoint_interval"] = json!("2s");
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| {
            let r = replica_to(dir.path(), id, cluster_name, ns, &sink, true, &kubeconfig);
            (id.to_owned(), r)
        })
        .collect();
    let leader = first_leader(&cluster).await;
    ready(&replicas[&leader]).await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = spawn_writer(&cluster, ns, 10, Duration::from_millis(100), stop.clone()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let killed = replicas.remove(&leader).unwrap();
    killed.signal("KILL");
    drop(killed);
    let standby = replicas.keys().next().unwrap().clone();
    leads(&cluster, &standby, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = writer.await.unwrap();

    let live = cluster.objects(&configmaps(), Some(ns)).await;
    let read = async || destination.read().await;
    support::until_both_match("the stream folds to the server's objects", read, &live).await;
    // Every replica stopped before the last read, so that nothing late escapes it.
    for mut r in replicas.into_values() {
        r.terminate();
    }
    let events = destination.read().await;
    let [d, deduplicated] = support::compare_both(&events, &live);
    let ids: BTreeSet<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
    let (backwards, wrong_ids, twice) = versions_and_delete_ids(&events);
    let resumed = events.iter().filter(|e| e["k8sresumed"] == true).count();
    println!(
        "failover ({}): {changes} changes, {} messages, {} repeated ids, {} live objects, \
         {resumed} resumed; last message wins: {}; deduplicated by id: {}; {} messages back \
         in resourceVersion, {} deletes with another id, {twice} objects deleted both on a \
         watch and by the resume",
        destination.name(),
        events.len(),
        events.len() - ids.len(),
        live.len(),
        d.counts(),
        deduplicated.counts(),
        backwards.len(),
        wrong_ids.len(),
    );
    support::assert_both_match_cluster("failover", &events, &live);
    assert!(backwards.is_empty(), "{backwards:?}");
    assert!(wrong_ids.is_empty(), "{wrong_ids:?}");
}

/// A leader frozen (SIGSTOP) while it publishes into Kafka with `exactly_once`, and thawed
/// after the standby took the Lease over and started its producer (which fences the frozen
/// one's): the thawed replica's `/healthz` fails, naming the fence, and
/// `keb_kafka_producer_fenced` is 1, whichever it learnt first (the commit or abort refused,
/// or the lease it lost seen held by the other), and they stay so while it stands by; once it leads again (the other
/// SIGKILLed) its new producer clears both. A `read_committed` consumer's fold equals the
/// API server's objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_replica_fails_healthz_until_it_leads_again() {
    let cluster = Cluster::start().await;
    let ns = "fenced";
    cluster.create_namespace(ns).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let destination = Broker::shared_kafka("fenced");
    let mut sink = destination.sink("out");
    sink["kafka"]["exactly_once"] = json!(true);
    // Long transactions: the freeze lands in one that holds records (an empty one ends
    // without asking the broker, so its producer would never hear of the fence).
    sink["kafka"]["transaction_interval"] = json!("3s");
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| {
            let r = replica_to(dir.path(), id, "fenced", ns, &sink, true, &kubeconfig);
            (id.to_owned(), r)
        })
        .collect();
    let frozen = first_leader(&cluster).await;
    let other = replicas.keys().find(|k| **k != frozen).unwrap().clone();
    ready(&replicas[&frozen]).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = spawn_writer(&cluster, ns, 5, Duration::from_millis(50), stop.clone()).await;
    let health = async |r: &Replica| {
        let admin = r.admin().expect("its admin address");
        let (code, body) = support::http_get(admin, "/healthz").await;
        let fenced = support::metric_sum(admin, "keb_kafka_producer_fenced").await;
        (code, body, fenced)
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (code, _, fenced) = health(&replicas[&frozen]).await;
    assert_eq!((code, fenced), (200, 0.0), "the leader is healthy before");
    replicas[&frozen].signal("STOP");
    leads(&cluster, &other, Duration::from_secs(60)).await;
    wait::until(
        "the new leader's producer fenced the frozen one's",
        Patience::of(Duration::from_secs(90)),
        async || replicas[&other].log().contains("Transactions on"),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    replicas[&frozen].signal("CONT");
    // The thawed replica learns of the fence from the broker (a late commit or produce
    // refused, or its term's closing abort) or, when the broker tells it nothing (a Kafka 4
    // coordinator may accept the deposed producer's abort of a transaction the new producer
    // already aborted), from the Lease: it lost it while leading and another holds it. Its
    // /healthz may fail first for another reason of the thaw (a commit whose messages timed
    // out during the freeze, outcome unknown), until its term ends: wait for the fence itself.
    let mut seen = (0, String::new(), 0.0);
    let names_the_fence = |body: &str| body.contains("was fenced") || body.contains("is fenced");
    let reported = wait::within(Patience::of(Duration::from_secs(30)), async || {
        seen = health(&replicas[&frozen]).await;
        seen.0 == 503 && seen.2 == 1.0 && names_the_fence(&seen.1)
    })
    .await;
    if !reported {
        let log = replicas[&frozen].log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| {
                ["ransaction", "ead", "ease", "ence"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .collect();
        panic!(
            "the thawed replica does not report the fence ({seen:?}); its log:\n{}",
            lines[lines.len().saturating_sub(30)..].join("\n")
        );
    }
    let by_broker = replicas[&frozen].log().contains("fenced=true");
    println!(
        "thawed: /healthz {} {:?}, keb_kafka_producer_fenced {} (the broker refused its abort: {by_broker})",
        seen.0, seen.1, seen.2
    );
    assert!(names_the_fence(&seen.1), "{}", seen.1);
    assert_eq!(seen.2, 1.0);
    // It stays so while it stands by (the lease's end does not clear it).
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (code, _, fenced) = health(&replicas[&frozen]).await;
        assert_eq!((code, fenced), (503, 1.0), "while standing by");
        let (code, body, _) = health(&replicas[&other]).await;
        assert_eq!(code, 200, "the leader is healthy: {body}");
    }
    // It leads again: its new producer clears both.
    let killed = replicas.remove(&other).unwrap();
    killed.signal("KILL");
    drop(killed);
    leads(&cluster, &frozen, Duration::from_secs(60)).await;
    wait::until(
        "the replica leading again is healthy",
        Patience::of(Duration::from_secs(90)),
        async || {
            let (code, _, fenced) = health(&replicas[&frozen]).await;
            code == 200 && fenced == 0.0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = writer.await.unwrap();
    let live = cluster.objects(&configmaps(), Some(ns)).await;
    let read_committed = async || {
        let Broker::Kafka(kafka, topic, _) = &destination else {
            unreachable!()
        };
        let (brokers, topic) = (kafka.brokers(), topic.clone());
        tokio::task::spawn_blocking(move || {
            support::kafka::read_topic(&brokers, &topic, true)
                .iter()
                .map(|r| r.json())
                .collect::<Vec<Value>>()
        })
        .await
        .unwrap()
    };
    let what = "the committed stream folds to the server's objects";
    support::until_matches(what, &read_committed, &live).await;
    let events = read_committed().await;
    println!("{changes} changes, {} committed messages", events.len());
    for mut r in replicas.into_values() {
        r.terminate();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_leader_is_replaced_and_nothing_is_lost_on_jetstream() {
    failover(Broker::jetstream(), "failover-js").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_leader_is_replaced_and_nothing_is_lost_on_kafka() {
    failover(Broker::shared_kafka("failover-kafka"), "failover-kafka").await;
}
