//! The whole service built from a config (discovery → informers → listeners → file sinks)
//! against the local Kubernetes API test server.

mod support;

use std::{sync::Arc, time::Duration};

use kube_event_bridge::app::{self, App};
use serde_json::{Value, json};
use support::{
    ApiServer, RunningApp,
    config::ConfigBuilder,
    event_type, http_get, json_lines,
    objects::{Meta, configmap, secret, typed, widget},
    wait::{self, PATIENCE},
    wait_for_lines,
};

#[tokio::test]
async fn two_routes_on_one_resource_share_one_informer() {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    let dir = tempfile::tempdir().unwrap();
    // Two resource entries for the same kind (different names and event filters) and three
    // sinks (two entries of one kind may not share a sink): one informer serves all three
    // routes.
    let cfg = ConfigBuilder::new()
        .grace_period("5s")
        .resource(json!({"name": "cms", "api_version": "v1", "kind": "ConfigMap"}))
        .resource(json!({
            "name": "cm-deletes", "api_version": "v1", "kind": "ConfigMap", "events": ["deleted"],
        }))
        .stdout("one", dir.path().join("one.jsonl"))
        .stdout("two", dir.path().join("two.jsonl"))
        .stdout("three", dir.path().join("three.jsonl"))
        .route("cms", &["one", "two"])
        .route("cm-deletes", &["three"])
        .build();
    let app = RunningApp::start(cfg, &server).await;
    assert_eq!(app.factory.informers().len(), 1);
    wait_for_lines(&dir.path().join("one.jsonl"), 1).await;
    server.delete("v1", "ConfigMap", "ns", "a");
    let one = wait_for_lines(&dir.path().join("one.jsonl"), 2).await;
    let two = wait_for_lines(&dir.path().join("two.jsonl"), 2).await;
    let three = wait_for_lines(&dir.path().join("three.jsonl"), 1).await;
    let types = |ls: &[Value]| {
        ls.iter()
            .map(|l| event_type(l).to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(types(&one), ["added", "deleted"]);
    assert_eq!(types(&two), ["added", "deleted"]);
    assert_eq!(types(&three), ["deleted"], "the deletes-only route");
    let counts = server.counts("/api/v1/configmaps");
    assert_eq!(
        (counts.lists, counts.watches),
        (1, 1),
        "one list and one watch on the server"
    );
    let report = app.stop().await;
    assert!(report.undelivered.is_empty());
}

#[tokio::test]
async fn a_custom_resource_works_like_a_built_in() {
    let server = ApiServer::start().await;
    server.create(widget("ns", "w1", json!({"size": 3})));
    let dir = tempfile::tempdir().unwrap();
    let cfg = ConfigBuilder::new()
        .grace_period("5s")
        .resource(json!({"api_version": "example.com/v1", "kind": "Widget", "namespaces": ["ns"]}))
        .stdout("out", dir.path().join("out.jsonl"))
        .route("widget.example.com", &["out"])
        .build();
    let app = RunningApp::start(cfg, &server).await;
    let path = dir.path().join("out.jsonl");
    let first = &wait_for_lines(&path, 1).await[0];
    assert_eq!(first["type"], "io.github.kube-event-bridge.object.added");
    assert_eq!(first["k8sgroup"], "example.com");
    assert_eq!(first["k8skind"], "Widget");
    assert_eq!(first["k8sresource"], "widgets");
    assert_eq!(first["k8sinitial"], true);
    assert_eq!(
        first["source"],
        "/clusters/test/apis/example.com/v1/namespaces/ns/widgets"
    );
    assert_eq!(first["data"]["object"]["spec"]["size"], 3);
    server.update(widget("ns", "w1", json!({"size": 5})));
    let second = &wait_for_lines(&path, 2).await[1];
    assert_eq!(second["data"]["oldObject"]["spec"]["size"], 3);
    assert_eq!(second["data"]["object"]["spec"]["size"], 5);
    let id = second["id"].as_str().unwrap();
    assert_eq!(
        id,
        format!(
            "{}:{}:updated",
            second["k8suid"].as_str().unwrap(),
            second["k8sresourceversion"].as_str().unwrap()
        )
    );
    assert_eq!(
        server
            .counts("/apis/example.com/v1/namespaces/ns/widgets")
            .lists,
        1
    );
    app.stop().await;
}

#[tokio::test]
async fn secrets_are_redacted_and_managed_fields_stripped() {
    let server = ApiServer::start().await;
    server.create(typed(
        &secret("ns", "s", &[("password", b"hunter2")]).managed_by("kubectl"),
    ));
    let dir = tempfile::tempdir().unwrap();
    let cfg = ConfigBuilder::new()
        .grace_period("5s")
        .resource(json!({"api_version": "v1", "kind": "Secret"}))
        .stdout("out", dir.path().join("out.jsonl"))
        .route("secret", &["out"])
        .build();
    let app = RunningApp::start(cfg, &server).await;
    let line = &wait_for_lines(&dir.path().join("out.jsonl"), 1).await[0];
    assert_eq!(line["data"]["object"]["data"]["password"], "<redacted>");
    assert_eq!(
        line["data"]["object"]["kind"], "Secret",
        "list items get their kind back"
    );
    assert!(
        line["data"]["object"]["metadata"]
            .get("managedFields")
            .is_none()
    );
    app.stop().await;
}

#[tokio::test]
async fn unknown_kinds_and_unwatchable_resources_fail_at_build_naming_them() {
    let server = ApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    // Kinds not served fail the start only with `require_all_resources` (else they wait as
    // pending: tests/discovery.rs); kinds that can never be watched always do.
    let build = |resources: Value, name: &str| {
        let mut cfg = ConfigBuilder::new()
            .grace_period("5s")
            .resources(resources)
            .stdout("out", dir.path().join("out.jsonl"))
            .route(name, &["out"])
            .build();
        cfg.kubernetes.require_all_resources = true;
        App::build(cfg, server.client())
    };
    let err = |r: Result<App, app::Error>| r.err().expect("build must fail").to_string();
    let e = err(build(json!([{"api_version": "v1", "kind": "Gadget"}]), "gadget").await);
    assert_eq!(e, "resources[0] (v1 Gadget): v1 has no kind \"Gadget\"");
    let e = err(build(
        json!([{"api_version": "nothere.io/v1", "kind": "Thing"}]),
        "thing.nothere.io",
    )
    .await);
    assert_eq!(
        e,
        "resources[0] (nothere.io/v1 Thing): the API server does not serve nothere.io/v1"
    );
    let e = err(build(json!([{"api_version": "v1", "kind": "Binding"}]), "binding").await);
    assert_eq!(
        e,
        "resources[0] (v1 Binding): resource \"bindings\" does not support list"
    );
    let e = err(build(
        json!([{"api_version": "v1", "kind": "Namespace", "namespaces": ["a"]}]),
        "namespace",
    )
    .await);
    assert_eq!(
        e,
        "resources[0] (v1 Namespace): is cluster-scoped; remove `namespaces`"
    );
}

#[tokio::test]
async fn readyz_follows_sync_and_api_reachability_and_the_cache_survives_an_outage() {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    let dir = tempfile::tempdir().unwrap();
    let cfg = ConfigBuilder::new()
        .grace_period("5s")
        .configmaps()
        .stdout("out", dir.path().join("out.jsonl"))
        .route("configmap", &["out"])
        .build();
    let app = RunningApp::start(cfg, &server).await;
    let admin = app.admin;
    let factory = app.factory.clone();
    wait_for_lines(&dir.path().join("out.jsonl"), 1).await;
    let mut ready = (0, String::new());
    for _ in 0..100 {
        ready = http_get(admin, "/readyz").await;
        if ready.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ready.0, 200, "{}", ready.1);
    assert_eq!(http_get(admin, "/healthz").await.0, 200);
    let (code, metrics) = http_get(admin, "/metrics").await;
    assert_eq!(code, 200);
    assert!(
        metrics.contains("keb_informer_synced{resource=\"v1/configmaps\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "keb_sink_published_total{resource=\"configmap\",sink=\"out\",type=\"added\"} 1"
        ),
        "{metrics}"
    );

    drop(server); // the API server goes away
    let mut not_ready = (0, String::new());
    for _ in 0..300 {
        not_ready = http_get(admin, "/readyz").await;
        if not_ready.0 == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(not_ready.0, 503);
    assert!(not_ready.1.contains("unreachable"), "{}", not_ready.1);
    assert_eq!(
        factory.informers()[0].indexer().len(),
        1,
        "the cache is kept"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_load_delivers_everything_the_informers_distributed() {
    let server = Arc::new(ApiServer::start().await);
    let dir = tempfile::tempdir().unwrap();
    let cfg = ConfigBuilder::new()
        .grace_period("5s")
        .configmaps()
        .stdout("out", dir.path().join("out.jsonl"))
        .route("configmap", &["out"])
        .build();
    let app = RunningApp::start(cfg, &server).await;
    let metrics = app.metrics.clone();
    let factory = app.factory.clone();
    wait::until("sync", PATIENCE, async || factory.has_synced()).await;
    let writer = tokio::spawn({
        let server = server.clone();
        async move {
            for i in 0..400 {
                server.create(typed(&configmap("ns", &format!("cm-{i}"), "1")));
                server.update(typed(&configmap("ns", &format!("cm-{i}"), "2")));
                tokio::task::yield_now().await;
            }
        }
    });
    let path = dir.path().join("out.jsonl");
    wait_for_lines(&path, 100).await;
    let report = app.stop().await; // SIGTERM, mid-load
    writer.await.unwrap();
    assert!(report.undelivered.is_empty(), "{:?}", report.undelivered);
    let distributed: u64 = ["added", "updated", "deleted", "synced"]
        .iter()
        .map(|t| {
            metrics
                .informer_notifications
                .with_label_values(&["v1/configmaps", t])
                .get()
        })
        .sum();
    let delivered = json_lines(&path);
    assert!(distributed >= 100);
    assert_eq!(
        delivered.len() as u64,
        distributed,
        "every distributed notification was delivered"
    );
    let ids: std::collections::HashSet<&str> = delivered
        .iter()
        .map(|l| l["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), delivered.len(), "no duplicates");
}
