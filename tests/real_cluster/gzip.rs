//! `kubernetes.gzip` on the real API server: lists come back compressed and decode to the
//! same objects.

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::support::{
    self,
    cluster::Cluster,
    config::ConfigBuilder,
    fold::until_matches,
    loopback::{CountingProxy, proxied_kubeconfig},
    objects::{configmap, configmaps},
    parity::ready,
    replica::Replica,
};

/// 2,000 ConfigMaps of about 1 KB, listed in pages of 500 through a proxy that counts the
/// bytes the API server sends: without `gzip`, then with it. Both end with the API server's
/// objects, and the compressed sync reads less than a third of the plain one's bytes (the
/// API server gzips responses over 128 KB when asked; a page here is about 600 KB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_lists_read_a_fraction_of_the_bytes_and_end_with_the_same_objects() {
    const N: usize = 2000;
    let cluster = Cluster::start().await;
    let ns = "gzipped";
    cluster.create_namespace(ns).await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, ns);
    let value = "x".repeat(1000);
    stream::iter(0..N)
        .for_each_concurrent(16, |i| {
            let (api, value) = (api.clone(), value.clone());
            async move {
                api.create(
                    &PostParams::default(),
                    &configmap(ns, &format!("cm-{i:04}"), &value),
                )
                .await
                .unwrap();
            }
        })
        .await;
    let live = cluster.objects(&configmaps(), Some(ns)).await;
    assert_eq!(live.len(), N);
    let upstream = cluster.port();
    let dir = tempfile::tempdir().unwrap();

    let mut read = Vec::new();
    for gzip in [false, true] {
        let proxy = CountingProxy::start(upstream).await;
        let sub = dir.path().join(format!("gzip-{gzip}"));
        std::fs::create_dir_all(&sub).unwrap();
        let kubeconfig = proxied_kubeconfig(&cluster.kubeconfig(), upstream, proxy.port, &sub);
        let out = sub.join("out.jsonl");
        let config = ConfigBuilder::new()
            .cluster("gzipped")
            .kubernetes(json!({"page_size": 500, "gzip": gzip}))
            .resource(json!({"api_version": "v1", "kind": "ConfigMap", "namespaces": [ns]}))
            .stdout("out", &out)
            .route("configmap", &["out"])
            .value();
        let replica = Replica::start(&sub, "replica", &config, &kubeconfig);
        ready(&replica).await;
        until_matches(
            &format!("the sync with gzip {gzip} ended with the API server's objects"),
            async || support::json_lines(&out),
            &live,
        )
        .await;
        read.push(proxy.bytes());
        drop(replica);
    }
    let [plain, gzipped] = read[..] else {
        unreachable!()
    };
    eprintln!("bytes read: {plain} plain, {gzipped} with gzip");
    assert!(
        gzipped * 3 < plain,
        "with gzip the sync read {gzipped} bytes, without it {plain}"
    );
}
