//! A list streamed into the pipeline page by page, on the real server into Kafka: each page's
//! objects are published while the next pages are read, and only the whole list decides what
//! vanished (`informer::delta_fifo`: `begin_list`, `listed`, `end_list`).

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    time::Duration,
};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::support::{
    self,
    broker::Broker,
    cluster::Cluster,
    config::ConfigBuilder,
    objects::{configmap, configmaps},
    parity::ready,
    replica::Replica,
};

/// Objects listed, in pages of [`PAGE`].
const OBJECTS: usize = 3000;
const PAGE: usize = 100;

fn name(i: usize) -> String {
    format!("cm-{i:05}")
}

/// Checks what a consumer of the topic read: no message id twice, no object's initial add
/// twice, and per object rising versions (a final-state-unknown delete carries the version
/// of the list that found its object gone, never older than what came before). Returns the
/// keys of the final-state-unknown deletes.
fn check_stream(events: &[Value]) -> BTreeSet<String> {
    let mut ids = HashSet::new();
    let mut initial = HashSet::new();
    let mut last: HashMap<&str, (u64, bool)> = HashMap::new();
    let mut fsu = BTreeSet::new();
    for e in events {
        let id = e["id"].as_str().unwrap();
        assert!(ids.insert(id), "id {id} twice");
        let key = e["subject"].as_str().unwrap();
        if e["k8sinitial"] == true {
            assert!(initial.insert(key), "{key} added twice by the list");
        }
        let rv: u64 = e["k8sresourceversion"].as_str().unwrap().parse().unwrap();
        let tombstone = e["k8sfinalstateunknown"] == true;
        if tombstone {
            fsu.insert(key.to_owned());
        }
        if let Some((prev, after_tombstone)) = last.insert(key, (rv, tombstone)) {
            assert!(
                prev < rv || ((tombstone || after_tombstone) && prev == rv),
                "{key}: version {prev} then {rv}"
            );
        }
    }
    fsu
}

/// 3,000 ConfigMaps listed in pages of 100 while a writer updates a tenth of them, deletes a
/// thirtieth and creates 100 more; then a gap (the API server SIGKILLed, every tenth object
/// deleted straight in etcd, history compacted) makes the watch relist. Kafka ends with the
/// API server's objects; no message id arrives twice, no object is added twice by one list,
/// versions rise per object, and the relist's final-state-unknown deletes are exactly the
/// gap's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paged_list_streams_into_kafka_while_objects_change_and_a_relist_deletes_the_gap() {
    let mut cluster = Cluster::start().await;
    let ns = "paged";
    cluster.create_namespace(ns).await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    let create = |i: usize, v: &'static str| {
        let api = api.clone();
        async move {
            api.create(&PostParams::default(), &configmap(ns, &name(i), v))
                .await
                .unwrap();
        }
    };
    stream::iter(0..OBJECTS)
        .for_each_concurrent(16, |i| create(i, "1"))
        .await;

    let destination = Broker::shared_kafka("paged-list");
    let sink = destination.sink("out");
    let config = ConfigBuilder::new()
        .cluster("paged-list")
        .grace_period("5s")
        .kubernetes(json!({"page_size": PAGE}))
        .resource(json!({"api_version": "v1", "kind": "ConfigMap", "namespaces": [ns]}))
        .sink(sink.clone())
        .route("configmap", &["out"]);
    let dir = tempfile::tempdir().unwrap();
    let replica = Replica::start(dir.path(), "paged", &config.value(), &cluster.kubeconfig());
    // Racing the list: updates, deletes and creates.
    let writes = stream::iter(0..OBJECTS + 100).for_each_concurrent(16, |i| {
        let api = api.clone();
        async move {
            if i >= OBJECTS {
                create(i, "1").await;
            } else if i % 30 == 5 {
                api.delete(&name(i), &DeleteParams::default())
                    .await
                    .unwrap();
            } else if i % 10 == 0 {
                api.replace(
                    &name(i),
                    &PostParams::default(),
                    &configmap(ns, &name(i), "2"),
                )
                .await
                .unwrap();
            }
        }
    });
    writes.await;
    ready(&replica).await;
    let live = cluster.objects(&configmaps(), Some(ns)).await;
    let read = async || destination.read().await;
    support::until_matches("Kafka folds to the server's objects", read, &live).await;
    let events = destination.read().await;
    let fsu = check_stream(&events);
    assert!(fsu.is_empty(), "nothing vanished unseen: {fsu:?}");
    // Listed after a write reached it: an initial add of version "2", or no initial add of
    // an object deleted (or created) while the list ran.
    let initial = events.iter().filter(|e| e["k8sinitial"] == true);
    let listed_after_a_write = initial
        .filter(|e| e["data"]["object"]["data"]["v"] == "2")
        .count();
    println!(
        "paged list: {} messages for {OBJECTS} objects in pages of {PAGE} and 500 writes; \
         {listed_after_a_write} updated objects listed after their update",
        events.len()
    );

    // The gap.
    cluster.kill_apiserver();
    let gap: BTreeSet<String> = live.keys().step_by(10).cloned().collect();
    for key in &gap {
        cluster.etcd_delete(&format!("/registry/configmaps/{key}"));
    }
    cluster.etcd_compact();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.start_apiserver().await;
    let live = cluster.objects(&configmaps(), Some(ns)).await;
    assert_eq!(live.len(), OBJECTS + 100 - 100 - gap.len());
    support::until_matches(
        "Kafka folds to the server's objects after the gap",
        read,
        &live,
    )
    .await;
    let events = destination.read().await;
    let fsu = check_stream(&events);
    assert_eq!(
        fsu, gap,
        "the relist deletes exactly what vanished in the gap"
    );
    drop(replica);
}
