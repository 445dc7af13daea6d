//! Change-aware messages end to end with the stdout sink: CEL filters and what consumers get
//! when objects leave and re-enter them, excluded namespaces, no-op suppression by
//! `ignore_fields`, and JSON Patch diffs on ConfigMaps, Deployments and a custom resource.

mod support;

use std::{collections::HashMap, path::Path};

use kube_event_bridge::config::Config;
use serde_json::{Value, json};
use support::{ApiServer, RunningApp, cloudevent_lines, eventually, sorted_ids};

fn config(dir: &Path, resources: Value, message: Value) -> Config {
    let routes: Vec<Value> = resources
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let name = r["name"].as_str().unwrap();
            json!({"resource": name, "sinks": [name]})
        })
        .collect();
    let sinks: Vec<Value> = resources
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let name = r["name"].as_str().unwrap();
            json!({"name": name, "type": "stdout",
                   "stdout": {"path": dir.join(format!("{name}.jsonl"))}})
        })
        .collect();
    Config::from_value(json!({
        "cluster": "test",
        "admin": {"address": "127.0.0.1:0"},
        "shutdown": {"grace_period": "10s"},
        "message": message,
        "resources": resources,
        "sinks": sinks,
        "routes": routes,
    }))
    .unwrap()
}

fn cm(ns: &str, name: &str, team: &str, v: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"namespace": ns, "name": name, "labels": {"team": team}},
           "data": {"v": v}})
}

fn short_type(e: &Value) -> &str {
    e["type"].as_str().unwrap().rsplit('.').next().unwrap()
}

/// Waits until `path` holds `n` events (and no more arrive for a moment); returns them.
async fn settle(path: &Path, n: usize) -> Vec<Value> {
    eventually(&format!("{n} events in {}", path.display()), || {
        support::json_lines(path).len() >= n
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    cloudevent_lines(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_filter_passes_exactly_the_matching_objects_and_objects_leaving_it_are_deleted() {
    const N: usize = 3000;
    let api = ApiServer::start().await;
    // Every third object is the shop team's; kube-system's are excluded whatever their label.
    for i in 0..N {
        let team = if i % 3 == 0 { "shop" } else { "web" };
        api.create(cm("apps", &format!("cm-{i:04}"), team, "1"));
    }
    for i in 0..30 {
        api.create(cm("kube-system", &format!("sys-{i}"), "shop", "1"));
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        json!([{"name": "shop", "api_version": "v1", "kind": "ConfigMap",
                "exclude_namespaces": ["kube-system"],
                "filter": "object.metadata.labels[\"team\"] == \"shop\" && type != \"synced\""}]),
        json!({}),
    );
    let app = RunningApp::start(cfg, &api).await;
    let path = dir.path().join("shop.jsonl");
    let initial = settle(&path, N / 3).await;
    assert_eq!(initial.len(), N / 3, "exactly the matching objects");
    assert!(initial.iter().all(|e| {
        e["data"]["object"]["metadata"]["labels"]["team"] == "shop" && e["k8snamespace"] == "apps"
    }));
    // 100 shop objects are relabelled (they leave), 50 of those come back, 10 of the returned
    // ones and 10 never-matching ones are deleted; 100 web objects change without matching.
    let shop = |k: usize| format!("cm-{:04}", k * 3);
    for k in 0..100 {
        api.update(cm("apps", &shop(k), "web", "2"));
    }
    for k in 0..50 {
        api.update(cm("apps", &shop(k), "shop", "3"));
    }
    for k in 0..10 {
        api.delete("v1", "ConfigMap", "apps", &shop(k));
        api.delete("v1", "ConfigMap", "apps", &format!("cm-{:04}", k * 3 + 1));
    }
    for k in 0..100 {
        api.update(cm("apps", &format!("cm-{:04}", k * 3 + 2), "web", "2"));
    }
    let all = settle(&path, N / 3 + 100 + 50 + 10).await;
    assert_eq!(all.len(), N / 3 + 160, "nothing else is published");
    let ids = sorted_ids(&all);
    let mut unique = ids.clone();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "no duplicate ids");
    let rest = &all[N / 3..];
    let out: Vec<_> = rest
        .iter()
        .filter(|e| e["k8sfilteredout"] == true)
        .collect();
    assert_eq!(out.len(), 100);
    assert!(out.iter().all(|e| short_type(e) == "deleted"
        && e["data"]["object"]["metadata"]["labels"]["team"] == "web"));
    let back: Vec<_> = rest.iter().filter(|e| short_type(e) == "added").collect();
    assert_eq!(
        back.len(),
        50,
        "objects that match again come back as added"
    );
    let deleted: Vec<_> = rest
        .iter()
        .filter(|e| short_type(e) == "deleted" && e["k8sfilteredout"].is_null())
        .collect();
    assert_eq!(deleted.len(), 10, "only deletes of published objects");
    // Per object the consumer's view ends as the cluster's: fold and compare.
    let mut view: HashMap<String, Value> = HashMap::new();
    for e in &all {
        let key = e["subject"].as_str().unwrap().to_owned();
        match short_type(e) {
            "deleted" => assert!(view.remove(&key).is_some(), "a delete of a published {key}"),
            "added" => assert!(view.insert(key.clone(), e.clone()).is_none(), "{key} twice"),
            other => panic!("unexpected {other}"),
        }
    }
    let expected = (0..N)
        .filter(|i| i % 3 == 0 && (i / 3 >= 100 || (10..50).contains(&(i / 3))))
        .count();
    assert_eq!(view.len(), expected);
    let filtered = |reason: &str| {
        app.metrics
            .filtered
            .with_label_values(&["shop", "shop", reason])
            .get()
    };
    // kube-system is left out by the API server: never sent, never cached.
    let cached: f64 = app
        .metrics
        .registry
        .gather()
        .iter()
        .filter(|f| f.name() == "keb_informer_cached_objects")
        .flat_map(|f| f.get_metric().iter().map(|m| m.get_gauge().get_value()))
        .sum();
    assert_eq!(cached as usize, N - 10 - 10, "{cached}");
    // 2000 initial web objects, 100 web updates, 10 deletes of web objects.
    assert_eq!(filtered("filter"), 2000 + 100 + 10);
    app.stop().await;
}

fn deployment(name: &str, replicas: i64, ready: i64, image: &str) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"namespace": "apps", "name": name, "labels": {"app": name},
                        "annotations": {"owner": "shop"}},
           "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                    "template": {"metadata": {"labels": {"app": name}},
                                 "spec": {"containers": [{"name": "main", "image": image,
                                                          "ports": [{"containerPort": 8080}]}]}}},
           "status": {"replicas": replicas, "readyReplicas": ready,
                      "conditions": [{"type": "Available", "status": if ready > 0 { "True" } else { "False" }}]}})
}

fn widget(name: &str, size: i64, tags: &[&str]) -> Value {
    json!({"apiVersion": "example.com/v1", "kind": "Widget",
           "metadata": {"namespace": "apps", "name": name},
           "spec": {"size": size, "tags": tags, "nested": {"a": {"b": [1, 2, {"c": size}]}}}})
}

/// Folds update messages the way a consumer does with `include_old_object: false`: each
/// patch applies to the last state it has of the object, and must give the message's object.
fn check_patches_fold(events: &[Value]) -> usize {
    let mut last: HashMap<String, Value> = HashMap::new();
    let mut applied = 0;
    for e in events {
        let key = e["subject"].as_str().unwrap().to_owned();
        let object = e["data"]["object"].clone();
        if short_type(e) == "updated" {
            assert!(
                e["data"].get("oldObject").is_none(),
                "include_old_object is off"
            );
            let patch: json_patch::Patch =
                serde_json::from_value(e["data"]["patch"].clone()).expect("a JSON Patch");
            let mut doc = last.get(&key).cloned().expect("an earlier state");
            json_patch::patch(&mut doc, &patch).expect("the patch applies");
            assert_eq!(doc, object, "patch of {key} at {}", e["k8sresourceversion"]);
            applied += 1;
        } else {
            assert!(e["data"].get("patch").is_none());
        }
        last.insert(key, object);
    }
    applied
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patches_apply_and_status_only_updates_are_suppressed_only_when_status_is_ignored() {
    let api = ApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ignore = json!([
        "/status",
        "/metadata/resourceVersion",
        "/metadata/generation",
        "/metadata/managedFields"
    ]);
    let cfg = config(
        dir.path(),
        json!([
            {"name": "deploy-quiet", "api_version": "apps/v1", "kind": "Deployment",
             "ignore_fields": ignore},
            {"name": "deploy-all", "api_version": "apps/v1", "kind": "Deployment"},
            {"name": "cm", "api_version": "v1", "kind": "ConfigMap", "ignore_fields": ignore},
            {"name": "widget", "api_version": "example.com/v1", "kind": "Widget"},
        ]),
        json!({"diff": "patch", "include_old_object": false}),
    );
    api.create(deployment("web", 5, 0, "web:1"));
    api.create(cm("apps", "settings", "shop", "1"));
    api.create(widget("w", 1, &["a"]));
    let app = RunningApp::start(cfg, &api).await;
    app.synced().await;
    let d = dir.path();
    settle(&d.join("deploy-all.jsonl"), 1).await;
    settle(&d.join("widget.jsonl"), 1).await;
    // Status churn: 5 updates of the status only, then a spec change, twice over.
    for round in 0..2 {
        for ready in 1..=5 {
            api.update(deployment("web", 5, ready, &format!("web:{}", round + 1)));
        }
        api.update(deployment("web", 5, 5, &format!("web:{}", round + 2)));
    }
    // ConfigMaps: data changes, a label removed, a key added; widgets: nested edits, arrays.
    api.update(cm("apps", "settings", "shop", "2"));
    api.update(json!({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"namespace": "apps", "name": "settings"},
                      "data": {"v": "2", "w": "new"}}));
    for (size, tags) in [
        (2, vec!["a", "b"]),
        (3, vec!["b"]),
        (3, vec![]),
        (4, vec!["x", "y", "z"]),
    ] {
        api.update(widget("w", size, &tags));
    }
    let quiet = settle(&d.join("deploy-quiet.jsonl"), 1 + 2).await;
    let all = settle(&d.join("deploy-all.jsonl"), 1 + 12).await;
    let cms = settle(&d.join("cm.jsonl"), 3).await;
    let widgets = settle(&d.join("widget.jsonl"), 5).await;
    assert_eq!(quiet.len(), 3, "status-only updates are not published");
    assert_eq!(
        all.len(),
        13,
        "without ignore_fields every update is published"
    );
    // The quiet route's patches start from its last published state, not the suppressed
    // ones: the fold checks it.
    assert_eq!(check_patches_fold(&quiet), 2);
    assert_eq!(
        quiet[2]["data"]["object"]["spec"]["template"]["spec"]["containers"][0]["image"],
        "web:3"
    );
    assert_eq!(
        quiet[2]["data"]["object"]["status"]["readyReplicas"], 5,
        "newest state"
    );
    assert_eq!(check_patches_fold(&all), 12);
    assert_eq!(check_patches_fold(&cms), 2);
    assert_eq!(check_patches_fold(&widgets), 4);
    let suppressed = app
        .metrics
        .filtered
        .with_label_values(&["deploy-quiet", "deploy-quiet", "suppressed"])
        .get();
    assert_eq!(suppressed, 10);
    app.stop().await;
}

/// `type subject [filteredout] [resumed]`.
fn brief(e: &Value) -> String {
    let mut d = format!("{} {}", short_type(e), e["subject"].as_str().unwrap());
    for flag in ["k8sfilteredout", "k8sresumed"] {
        if e[flag] == true {
            d.push(' ');
            d.push_str(flag.trim_start_matches("k8s"));
        }
    }
    d
}

/// Runs the bridge with `filter` until `path` holds `total` events and nothing more comes.
async fn run_filtered(api: &ApiServer, dir: &Path, filter: &str, total: usize) -> Vec<Value> {
    let cfg = config(
        dir,
        json!([{"name": "shop", "api_version": "v1", "kind": "ConfigMap", "filter": filter}]),
        json!({}),
    );
    let app = RunningApp::start(cfg, api).await;
    app.synced().await;
    let events = settle(&dir.join("shop.jsonl"), total).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(app.stop().await.undelivered.is_empty());
    assert_eq!(
        cloudevent_lines(&dir.join("shop.jsonl")).len(),
        total,
        "nothing more"
    );
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_filtered_objects_that_left_or_vanished_are_deleted_exactly_once() {
    let api = ApiServer::start().await;
    for i in 0..300 {
        let team = if i % 2 == 0 { "shop" } else { "web" };
        api.create(cm("ns", &format!("cm-{i:03}"), team, "1"));
    }
    let dir = tempfile::tempdir().unwrap();
    let shop = r#"object.metadata.labels["team"] == "shop""#;
    let first = run_filtered(&api, dir.path(), shop, 150).await;
    assert!(first.iter().all(|e| e["k8sinitial"] == true));
    // While down: a published object relabelled out, one deleted, one changed; an
    // unpublished one relabelled in, one deleted; a new matching one.
    api.update(cm("ns", "cm-000", "web", "1"));
    api.delete("v1", "ConfigMap", "ns", "cm-002");
    api.update(cm("ns", "cm-004", "shop", "2"));
    api.update(cm("ns", "cm-001", "shop", "1"));
    api.delete("v1", "ConfigMap", "ns", "cm-003");
    api.create(cm("ns", "cm-new", "shop", "1"));
    let second = run_filtered(&api, dir.path(), shop, 155).await;
    let mut got: Vec<String> = second[150..].iter().map(brief).collect();
    got.sort();
    assert_eq!(
        got,
        [
            "added ns/cm-001 resumed",
            "added ns/cm-new resumed",
            "deleted ns/cm-000 filteredout",
            "deleted ns/cm-002 resumed",
            "updated ns/cm-004 resumed",
        ]
    );
    // The filter changes between runs: unchanged objects it no longer takes are deleted.
    let narrower = format!(r#"{shop} && !(object.metadata.name in ["cm-006", "cm-008"])"#);
    let third = run_filtered(&api, dir.path(), &narrower, 157).await;
    let mut got: Vec<String> = third[155..].iter().map(brief).collect();
    got.sort();
    assert_eq!(
        got,
        [
            "deleted ns/cm-006 filteredout",
            "deleted ns/cm-008 filteredout"
        ]
    );
    // And they are not deleted again.
    run_filtered(&api, dir.path(), &narrower, 157).await;
}
