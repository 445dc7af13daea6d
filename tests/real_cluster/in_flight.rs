//! A small bound on a sink's objects in flight (`sinks[].max_objects_in_flight`) at scale on
//! the real server into Kafka, combined with a filter, resume and a restart in the middle of
//! the first sync.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
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
    event_type,
    objects::{Meta as _, configmap},
    parity::ready,
    replica::Replica,
    wait::{self, Patience},
};

/// ConfigMaps at the start; the writer changes about a fifth of them.
const OBJECTS: usize = 20_000;
/// The sink's `max_objects_in_flight`: small beside the objects, so that it is what paces
/// the sync.
const BOUND: usize = 64;

fn name(i: usize) -> String {
    format!("cm-{i:05}")
}

/// The filter's label: a fifth of the objects start outside it.
fn team(i: usize) -> &'static str {
    if i.is_multiple_of(5) { "other" } else { "shop" }
}

/// The highest `keb_sink_in_flight` and `keb_listener_buffered_notifications` seen while
/// sampling a replica's metrics every 20 ms (a sample may miss a peak between two reads: the
/// figures are at most the true peaks).
#[derive(Default, Debug, Clone, Copy)]
struct Peaks {
    in_flight: f64,
    buffered: f64,
    samples: usize,
}

/// Samples the metrics of whichever replica `admin` names until `stop` is set.
fn sample(
    admin: Arc<Mutex<Option<SocketAddr>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Peaks> {
    tokio::spawn(async move {
        let mut peaks = Peaks::default();
        while !stop.load(Ordering::SeqCst) {
            let addr = *admin.lock().unwrap();
            if let Some(addr) = addr {
                let in_flight = support::metric_sum(addr, "keb_sink_in_flight").await;
                let buffered =
                    support::metric_sum(addr, "keb_listener_buffered_notifications").await;
                peaks.in_flight = peaks.in_flight.max(in_flight);
                peaks.buffered = peaks.buffered.max(buffered);
                peaks.samples += 1;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        peaks
    })
}

/// 20,000 ConfigMaps synced into Kafka with at most 64 objects in flight, a label filter
/// (`team == "shop"`) and resume (the checkpoint topic), while a writer relabels objects in
/// and out of the filter, updates, deletes and creates; the bridge is stopped (SIGTERM) a
/// quarter of the way into its first sync and started again. A consumer ends with exactly
/// the server's matching objects in both consumer models, no change is published twice (the
/// checkpoint written at shutdown holds everything acknowledged), and the in-flight gauge
/// never exceeds the bound in any sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_in_flight_bound_with_a_filter_and_a_restart_mid_sync_loses_and_repeats_nothing() {
    let cluster = Cluster::start().await;
    let ns = "bound";
    cluster.create_namespace(ns).await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    let object = |i: usize, v: &str, team: &str| configmap(ns, &name(i), v).label("team", team);
    stream::iter(0..OBJECTS)
        .for_each_concurrent(32, |i| {
            let (api, obj) = (api.clone(), object(i, "1", team(i)));
            async move {
                api.create(&PostParams::default(), &obj).await.unwrap();
            }
        })
        .await;

    let destination = Broker::shared_kafka("in-flight");
    let mut sink = destination.sink("out");
    sink["max_objects_in_flight"] = json!(BOUND);
    let config = ConfigBuilder::new()
        .cluster("in-flight")
        .grace_period("10s")
        .resource(json!({
            "api_version": "v1", "kind": "ConfigMap", "namespaces": [ns],
            "filter": "has(object.metadata.labels.team) && object.metadata.labels.team == 'shop'",
        }))
        .sink(sink)
        .route("configmap", &["out"])
        .value();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let admin = Arc::new(Mutex::new(None));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample(admin.clone(), stop.clone());

    // Racing the first sync and the restart: about a fifth of the objects change.
    let writer = tokio::spawn({
        let api = api.clone();
        async move {
            stream::iter(0..OBJECTS + 1000)
                .for_each_concurrent(16, |i| {
                    let api = api.clone();
                    async move {
                        let change = if i >= OBJECTS {
                            Some(object(i, "1", "shop"))
                        } else if i % 20 == 7 {
                            api.delete(&name(i), &DeleteParams::default())
                                .await
                                .unwrap();
                            None
                        } else if i % 20 == 1 {
                            Some(object(i, "2", "other"))
                        } else if i % 20 == 10 {
                            Some(object(i, "2", "shop"))
                        } else if i % 10 == 3 {
                            Some(object(i, "2", team(i)))
                        } else {
                            None
                        };
                        match change {
                            Some(obj) if i >= OBJECTS => {
                                api.create(&PostParams::default(), &obj).await.unwrap();
                            }
                            Some(obj) => {
                                api.replace(&name(i), &PostParams::default(), &obj)
                                    .await
                                    .unwrap();
                            }
                            None => {}
                        }
                    }
                })
                .await;
        }
    });

    let mut first = Replica::start(dir.path(), "first", &config, &kubeconfig);
    ready(&first).await;
    *admin.lock().unwrap() = first.admin();
    let quarter = (OBJECTS / 4) as u64;
    wait::until(
        "a quarter of the first sync published",
        Patience::of(Duration::from_secs(120)),
        async || first.published().await >= quarter,
    )
    .await;
    *admin.lock().unwrap() = None;
    first.terminate();
    let mut second = Replica::start(dir.path(), "second", &config, &kubeconfig);
    ready(&second).await;
    *admin.lock().unwrap() = second.admin();
    writer.await.unwrap();

    let matching = crate::shop_configmaps(&api, ns).await;
    // Everything the second replica holds delivered (generous: four of these scenarios share
    // two cores in CI), before the reads of the whole topic.
    let second_admin = second.admin().expect("ready: its admin address is logged");
    wait::until(
        "the second replica holds nothing undelivered",
        Patience::of(Duration::from_secs(240)),
        async || {
            support::metric_sum(second_admin, "keb_listener_buffered_notifications").await == 0.0
                && support::metric_sum(second_admin, "keb_sink_in_flight").await == 0.0
        },
    )
    .await;
    let read = async || destination.read().await;
    support::until_both_match("Kafka folds to the matching objects", &read, &matching).await;
    stop.store(true, Ordering::SeqCst);
    let peaks = sampler.await.unwrap();
    second.terminate();

    let events: Vec<Value> = destination.read().await;
    support::assert_both_match_cluster("a small in-flight bound", &events, &matching);
    // Each change once: an object's state (its version) under one event type.
    let mut copies: HashMap<(String, String, String), usize> = HashMap::new();
    for e in &events {
        let rv = e["k8sresourceversion"].as_str().unwrap().to_owned();
        let key = e["subject"].as_str().unwrap().to_owned();
        *copies
            .entry((key, rv, event_type(e).to_owned()))
            .or_default() += 1;
    }
    let repeated: Vec<_> = copies.iter().filter(|(_, n)| **n > 1).collect();
    let filtered_out = support::fold::flagged(&events, "k8sfilteredout");
    let resumed = support::fold::flagged(&events, "k8sresumed");
    println!(
        "in-flight bound {BOUND}: {} messages ({filtered_out} filtered out, {resumed} resumed) \
         for {} matching objects; {} changes published twice; peaks over {} samples: {} in \
         flight, {} notifications buffered",
        events.len(),
        matching.len(),
        repeated.len(),
        peaks.samples,
        peaks.in_flight,
        peaks.buffered,
    );
    assert!(
        repeated.is_empty(),
        "published more than once (after a SIGTERM the checkpoint holds everything \
         acknowledged): {:?}",
        &repeated[..repeated.len().min(5)]
    );
    assert!(
        peaks.samples > 0 && peaks.in_flight <= BOUND as f64,
        "at most {BOUND} objects in flight: {peaks:?}"
    );
    assert!(
        filtered_out > 0 && resumed > 0,
        "the run exercised the filter and resume"
    );
}
