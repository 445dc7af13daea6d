//! A filter combined with resume and a leader failover on the real server.

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::{
    failover::{first_leader, leads},
    support::{
        self,
        cluster::Cluster,
        config::ConfigBuilder,
        objects::configmap,
        parity::{Rng, ready, seed},
        replica::Replica,
    },
};

/// Features combined on the real server: two replicas with leader election, a label filter
/// (`team == "shop"`) and resume into JetStream; objects are created, relabelled in and out
/// of the filter, updated and deleted while the leader is SIGKILLed and the standby takes
/// over. A consumer's fold (an object that left the filter ends with its `deleted` marked
/// `k8sfilteredout`) equals the API server's objects that match the filter, in both consumer
/// models, and no object outside the filter is ever published as present at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_with_resume_across_a_leader_failover_ends_with_the_matching_objects() {
    use support::objects::Meta as _;
    let cluster = Cluster::start().await;
    let ns = "combined";
    cluster.create_namespace(ns).await;
    let nats = support::nats::NatsServer::start();
    let sink = support::config::nats_sink("out", &nats.url(), json!({}));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let config = |identity: &str| {
        ConfigBuilder::new()
            .cluster("combined")
            .grace_period("5s")
            .resource(json!({
                "api_version": "v1", "kind": "ConfigMap", "namespaces": [ns],
                "filter": "has(object.metadata.labels.team) && object.metadata.labels.team == 'shop'",
            }))
            .sink(sink.clone())
            .route("configmap", &["out"])
            .fast_leader_election(identity, "200ms")
            .value()
    };
    let mut replicas: BTreeMap<String, Replica> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|id| {
            (
                id.to_owned(),
                Replica::start(dir.path(), id, &config(id), &kubeconfig),
            )
        })
        .collect();
    let leader = first_leader(&cluster).await;
    ready(&replicas[&leader]).await;

    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    let mut rng = Rng(seed());
    let team = |rng: &mut Rng| if rng.below(2) == 0 { "shop" } else { "other" };
    let change = async |rng: &mut Rng, op: u64| {
        let name = format!("cm-{:02}", rng.below(60));
        let obj = configmap(ns, &name, &op.to_string()).label("team", team(rng));
        match api.get_opt(&name).await.unwrap() {
            None => drop(api.create(&PostParams::default(), &obj).await.unwrap()),
            Some(_) if rng.below(5) == 0 => {
                drop(api.delete(&name, &DeleteParams::default()).await.unwrap())
            }
            Some(_) => drop(
                api.replace(&name, &PostParams::default(), &obj)
                    .await
                    .unwrap(),
            ),
        }
    };
    for op in 0..200 {
        change(&mut rng, op).await;
    }
    let killed = replicas.remove(&leader).unwrap();
    killed.signal("KILL");
    drop(killed);
    // Changes while no replica leads, then under the new leader.
    for op in 200..500 {
        change(&mut rng, op).await;
        if op % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let standby = replicas.keys().next().unwrap().clone();
    leads(&cluster, &standby, Duration::from_secs(30)).await;

    let matching = crate::shop_configmaps(&api, ns).await;
    let read = async || -> Vec<Value> {
        support::nats::read_stream(&nats.url(), support::config::NATS_STREAM)
            .await
            .iter()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
            .collect()
    };
    support::until_both_match("the stream folds to the matching objects", &read, &matching).await;
    // Every replica stopped before the last read, so that nothing late escapes it.
    for mut r in replicas.into_values() {
        r.terminate();
    }
    let events = read().await;
    let [d, deduplicated] = support::compare_both(&events, &matching);
    let filtered_out = support::fold::flagged(&events, "k8sfilteredout");
    let resumed = support::fold::flagged(&events, "k8sresumed");
    println!(
        "filter + resume + failover: 500 changes, {} messages ({filtered_out} filtered out, \
         {resumed} resumed), {} matching objects; last message wins: {}; deduplicated by id: {}",
        events.len(),
        matching.len(),
        d.counts(),
        deduplicated.counts(),
    );
    support::assert_both_match_cluster("filter + resume + failover", &events, &matching);
    assert!(filtered_out > 0 && resumed > 0, "the run exercised both");
}
