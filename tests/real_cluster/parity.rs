//! Parity with client-go: the bridge and client-go's own informer watch one namespace of a
//! real cluster through a seeded workload and a compacted gap, and must see the same.

use std::{collections::BTreeSet, time::Duration};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use serde_json::Value;

use crate::support::{
    cluster::{Cluster, ClusterOptions, ReferenceInformer},
    json_lines,
    parity::{
        Comparison, Rng, bridge, bridge_seen, client_go_seen, fsu, ready, seed, settle, workload,
    },
    wait::{self, Patience},
};

/// The parity scenario: client-go's informer and the bridge watch one namespace of a real
/// cluster while a seeded workload creates, updates and deletes; then a gap (the API server
/// SIGKILLed, objects deleted straight in etcd, history compacted, so both watches get 410
/// and relist), then more changes. Per key they must see the same versions (ratio ≥ 0.99),
/// end with the same final state (the API server's), and both mark every gap delete final
/// state unknown.
async fn parity(options: ClusterOptions, streaming_list: bool) {
    let seed = seed();
    eprintln!(
        "seed {seed} (KEB_SEED replays it), options {options:?}, streaming list {streaming_list}"
    );
    let mut rng = Rng(seed);
    let mut cluster = Cluster::start_with(options.clone()).await;
    let version: Value = serde_json::from_str(
        &cluster
            .client()
            .await
            .request_text(http::Request::get("/version").body(Vec::new()).unwrap())
            .await
            .unwrap(),
    )
    .unwrap();
    eprintln!(
        "kube-apiserver {} (emulating {}.{}) ready in {:?}",
        version["gitVersion"],
        version["emulationMajor"].as_str().unwrap_or("-"),
        version["emulationMinor"].as_str().unwrap_or("-"),
        cluster.last_start
    );
    if let Some(emulated) = &options.emulated_version {
        let (major, minor) = emulated.split_once('.').unwrap();
        assert_eq!(
            (
                version["emulationMajor"].as_str(),
                version["emulationMinor"].as_str()
            ),
            (Some(major), Some(minor)),
            "the server emulates {emulated}"
        );
    }
    let ns = "parity";
    cluster.create_namespace(ns).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let reference =
        ReferenceInformer::start(&kubeconfig, dir.path(), ("", "v1", "configmaps"), Some(ns));
    let replica = bridge(dir.path(), ns, &kubeconfig, streaming_list, 1_000_000);
    reference.synced().await;
    ready(&replica).await;

    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    workload(&api, ns, &mut rng, 80, 400).await;

    // The gap: a quarter of the live objects deleted straight in etcd while the API server
    // is down, history compacted past everything both watches saw.
    let live = settle(
        &cluster,
        ns,
        &reference,
        dir.path(),
        Duration::from_secs(90),
    )
    .await;
    cluster.kill_apiserver();
    let gap_deletes: BTreeSet<String> =
        live.keys().filter(|_| rng.below(4) == 0).cloned().collect();
    for key in &gap_deletes {
        cluster.etcd_delete(&format!("/registry/configmaps/{key}"));
    }
    cluster.etcd_compact();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.start_apiserver().await;
    eprintln!(
        "gap: {} objects deleted in etcd; kube-apiserver ready again in {:?}",
        gap_deletes.len(),
        cluster.last_start
    );
    // Both relist (their watches get 410) before the next changes, so that what each lists
    // is the same state: a delete and re-create racing a relist is where the two differ on
    // purpose (client-go gives one `updated` across incarnations, the bridge `deleted` then
    // `added`; docs/src/concepts.md).
    wait::until(
        "both informers relisted and inferred the gap deletes",
        Patience::of(Duration::from_secs(90)).polling(Duration::from_millis(200)),
        async || {
            let bridge = bridge_seen(&json_lines(&dir.path().join("bridge.jsonl")));
            fsu(&client_go_seen(&reference.lines())).is_superset(&gap_deletes)
                && fsu(&bridge).is_superset(&gap_deletes)
        },
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    workload(&api, ns, &mut rng, 80, 400).await;

    let want = settle(
        &cluster,
        ns,
        &reference,
        dir.path(),
        Duration::from_secs(90),
    )
    .await;
    // Anything late would show in the next second.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let events = json_lines(&dir.path().join("bridge.jsonl"));
    let c = Comparison::of(&events, &reference.lines(), &want);
    eprintln!("parity: {c} (gap deletes {})", gap_deletes.len());
    c.print_differing_keys(5);
    assert!(
        c.differences.is_empty(),
        "the bridge's stream folds to the server's objects"
    );
    assert_eq!(c.duplicates, 0, "no message id twice");
    assert!(c.same_finals, "identical finals per key");
    assert!(
        c.ratio >= 0.99,
        "versions seen bridge/client-go {}",
        c.ratio
    );
    assert_eq!(
        c.keys_differing, 0,
        "per key, the same notifications in the same order"
    );
    assert_eq!(
        c.fsu_client_go, gap_deletes,
        "client-go marks the gap deletes"
    );
    assert_eq!(
        c.fsu_bridge, gap_deletes,
        "the bridge marks the gap deletes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_sees_what_client_go_sees_across_a_compacted_gap() {
    parity(ClusterOptions::default(), false).await;
}

/// The same with the bridge's initial state from a streaming watch-list
/// (`sendInitialEvents`), as client-go 0.36 lists by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_sees_what_client_go_sees_with_a_streaming_list() {
    parity(ClusterOptions::default(), true).await;
}

/// The same against the oldest Kubernetes release the docs support (1.33: the API the
/// service is built against), emulated by the same v1.36 binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_sees_what_client_go_sees_on_the_oldest_supported_release() {
    parity(
        ClusterOptions {
            emulated_version: Some("1.33".into()),
            ..Default::default()
        },
        false,
    )
    .await;
}
