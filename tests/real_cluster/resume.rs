//! Resume on the real server: a restart (SIGTERM or SIGKILL) publishes exactly what
//! changed while the bridge was down, from the JetStream or the Kafka checkpoint.

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::Value;

use crate::{
    replica_to,
    support::{
        self,
        broker::Broker,
        cluster::Cluster,
        event_type,
        objects::{configmap, configmaps},
        parity::ready,
        wait::{self, Patience},
    },
};

/// Restart with resume against the real API server: the bridge publishes 40 ConfigMaps, is
/// stopped (SIGTERM, or SIGKILL), and while it is down 10 are deleted, 10 updated, 10
/// created and 5 deleted and re-created; after the restart exactly those changes arrive
/// (marked resumed, the deletes final state unknown), the 15 unchanged objects are not
/// replayed, and the destination folds to the API server's objects.
async fn resume(destination: Broker, kill: bool, cluster_name: &str) {
    let cluster = Cluster::start().await;
    let ns = "resume";
    cluster.create_namespace(ns).await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    let name = |i: usize| format!("cm-{i:02}");
    for i in 0..40 {
        api.create(&PostParams::default(), &configmap(ns, &name(i), "1"))
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let sink = destination.sink("out");
    let mut first = replica_to(
        dir.path(),
        "first",
        cluster_name,
        ns,
        &sink,
        false,
        &kubeconfig,
    );
    ready(&first).await; // its sink opened: the stream or topic exists
    wait::until(
        "the 40 objects published",
        Patience::of(Duration::from_secs(60)),
        async || destination.read().await.len() >= 40,
    )
    .await;
    // Every acknowledged message in the checkpoint (`keb_checkpoint_lag` 0 after 40
    // acknowledgements), so that a SIGKILL finds the acknowledged state written.
    wait::until(
        "the 40 acknowledged objects checkpointed",
        Patience::of(Duration::from_secs(60)),
        async || {
            let Some(admin) = first.admin() else {
                return false;
            };
            let lag = support::metric_sum(admin, "keb_checkpoint_lag").await;
            first.published().await >= 40 && lag == 0.0
        },
    )
    .await;
    if kill {
        first.signal("KILL");
        let _ = first.child.wait();
    } else {
        first.terminate();
    }
    let before = destination.read().await;

    let mut want: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for i in 0..10 {
        api.delete(&name(i), &DeleteParams::default())
            .await
            .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["deleted"]);
    }
    for i in 10..20 {
        api.replace(
            &name(i),
            &PostParams::default(),
            &configmap(ns, &name(i), "2"),
        )
        .await
        .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["updated"]);
    }
    for i in 40..50 {
        api.create(&PostParams::default(), &configmap(ns, &name(i), "1"))
            .await
            .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["added"]);
    }
    for i in 20..25 {
        api.delete(&name(i), &DeleteParams::default())
            .await
            .unwrap();
        api.create(&PostParams::default(), &configmap(ns, &name(i), "3"))
            .await
            .unwrap();
        want.insert(format!("{ns}/{}", name(i)), vec!["deleted", "added"]);
    }
    let live = cluster.objects(&configmaps(), Some(ns)).await;

    let mut second = replica_to(
        dir.path(),
        "second",
        cluster_name,
        ns,
        &sink,
        false,
        &kubeconfig,
    );
    let read = async || destination.read().await;
    support::until_matches("the stream folds to the server's objects", read, &live).await;
    // Stopped before the last read, so that nothing late escapes it.
    second.terminate();
    let events = destination.read().await;
    // What arrived after the restart: the multiset difference by id (Kafka is read partition
    // by partition, so not a suffix), so that a replay of an unchanged object (same id as
    // its first message) still shows.
    let mut seen_before: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &before {
        *seen_before.entry(e["id"].as_str().unwrap()).or_default() += 1;
    }
    let after: Vec<Value> = events
        .iter()
        .filter(|e| match seen_before.get_mut(e["id"].as_str().unwrap()) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .cloned()
        .collect();
    let after = &after[..];
    let got = support::resumed_types(after);
    let unmarked: Vec<String> = after
        .iter()
        .filter(|e| e["k8sresumed"] != true)
        .map(|e| format!("{} {}", event_type(e), e["subject"]))
        .collect();
    let replayed = after
        .iter()
        .filter(|e| (25..40).any(|i| e["subject"] == format!("{ns}/{}", name(i))))
        .count();
    let fsu_deletes = after
        .iter()
        .filter(|e| event_type(e) == "deleted" && e["k8sfinalstateunknown"] == true)
        .count();
    let d = support::compare(&events, &live);
    println!(
        "resume ({}, {}): {} messages after the restart (40 expected), {} not marked resumed, \
         unchanged replayed {replayed}, final-state-unknown deletes {fsu_deletes} (15 expected), \
         {}",
        destination.name(),
        if kill { "SIGKILL" } else { "SIGTERM" },
        after.len(),
        unmarked.len(),
        d.counts(),
    );
    assert!(d.is_empty(), "{d}");
    assert_eq!(replayed, 0, "unchanged objects are not replayed");
    // The checkpoint held every acknowledged message when the first replica stopped, so
    // after a SIGKILL as after a SIGTERM the changes are exactly those, each once, resumed.
    let got: BTreeMap<String, Vec<&str>> = got.into_iter().collect();
    assert_eq!(got, want);
    assert!(unmarked.is_empty(), "{unmarked:?}");
    assert_eq!(after.len(), 40, "each change once");
    assert_eq!(fsu_deletes, 15);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_jetstream_checkpoint() {
    resume(Broker::jetstream(), false, "resume-js").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_bridge_resumes_from_the_jetstream_checkpoint() {
    resume(Broker::jetstream(), true, "resume-js-kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_kafka_checkpoint() {
    resume(Broker::shared_kafka("resume-kafka"), false, "resume-kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_bridge_resumes_from_the_kafka_checkpoint() {
    resume(
        Broker::shared_kafka("resume-kafka-kill"),
        true,
        "resume-kafka-kill",
    )
    .await;
}
