//! Change-aware messages end to end with the stdout sink: CEL filters and what consumers get
//! when objects leave and re-enter them, excluded namespaces, no-op suppression by
//! `ignore_fields`, and JSON Patch diffs on ConfigMaps, Deployments and a custom resource.

mod support;

use std::{collections::HashMap, path::Path};

use serde_json::{Value, json};
use support::{
    ApiServer, RunningApp, cloudevent_lines,
    config::ConfigBuilder,
    event_type,
    objects::{Meta, configmap, configmap_with_data, deployment, typed, widget},
    sorted_ids, wait_for_lines,
};

/// Waits until `path` holds `n` events (and no more arrive for a moment); returns them.
async fn settle(path: &Path, n: usize) -> Vec<Value> {
    wait_for_lines(path, n).await;
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
        api.create(typed(
            &configmap("apps", &format!("cm-{i:04}"), "1").label("team", team),
        ));
    }
    for i in 0..30 {
        api.create(typed(
            &configmap("kube-system", &format!("sys-{i}"), "1").label("team", "shop"),
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = ConfigBuilder::new()
        .grace_period("10s")
        .message(json!({}))
        .resource(
            json!({"name": "shop", "api_version": "v1", "kind": "ConfigMap",
                         "exclude_namespaces": ["kube-system"],
                         "filter": "object.metadata.labels[\"team\"] == \"shop\"",
                         "events": ["added", "updated", "deleted"]}),
        )
        .stdout_per_resource(dir.path())
        .build();
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
        api.update(typed(
            &configmap("apps", &shop(k), "2").label("team", "web"),
        ));
    }
    for k in 0..50 {
        api.update(typed(
            &configmap("apps", &shop(k), "3").label("team", "shop"),
        ));
    }
    for k in 0..10 {
        api.delete("v1", "ConfigMap", "apps", &shop(k));
        api.delete("v1", "ConfigMap", "apps", &format!("cm-{:04}", k * 3 + 1));
    }
    for k in 0..100 {
        api.update(typed(
            &configmap("apps", &format!("cm-{:04}", k * 3 + 2), "2").label("team", "web"),
        ));
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
    assert!(out.iter().all(|e| event_type(e) == "deleted"
        && e["data"]["object"]["metadata"]["labels"]["team"] == "web"));
    let back: Vec<_> = rest.iter().filter(|e| event_type(e) == "added").collect();
    assert_eq!(
        back.len(),
        50,
        "objects that match again come back as added"
    );
    let deleted: Vec<_> = rest
        .iter()
        .filter(|e| event_type(e) == "deleted" && e["k8sfilteredout"].is_null())
        .collect();
    assert_eq!(deleted.len(), 10, "only deletes of published objects");
    // Per object the consumer's view ends as the cluster's: fold and compare.
    let mut view: HashMap<String, Value> = HashMap::new();
    for e in &all {
        let key = e["subject"].as_str().unwrap().to_owned();
        match event_type(e) {
            "deleted" => assert!(view.remove(&key).is_some(), "a delete of a published {key}"),
            "added" => assert!(view.insert(key.clone(), e.clone()).is_none(), "{key} twice"),
            other => panic!("unexpected {other}"),
        }
    }
    let expected = (0..N)
        .filter(|i| i % 3 == 0 && (i / 3 >= 100 || (10..50).contains(&(i / 3))))
        .count();
    assert_eq!(view.len(), expected);
    let filtered = app
        .metrics
        .filtered
        .with_label_values(&["shop", "shop", "filter"]);
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
    // Stopped first: a filter evaluates on lanes of its own, which run out at shutdown.
    app.stop().await;
    // 2000 initial web objects, 100 web updates, 10 deletes of web objects.
    assert_eq!(filtered.get(), 2000 + 100 + 10);
}

/// Folds update messages the way a consumer does with `include_old_object: false`: each
/// patch applies to the last state it has of the object, and must give the message's object.
fn check_patches_fold(events: &[Value]) -> usize {
    let mut last: HashMap<String, Value> = HashMap::new();
    let mut applied = 0;
    for e in events {
        let key = e["subject"].as_str().unwrap().to_owned();
        let object = e["data"]["object"].clone();
        if event_type(e) == "updated" {
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
    let cfg = ConfigBuilder::new()
        .grace_period("10s")
        .message(json!({"diff": "patch", "include_old_object": false}))
        .resources(json!([
            {"name": "deploy-quiet", "api_version": "apps/v1", "kind": "Deployment",
             "ignore_fields": ignore},
            {"name": "deploy-all", "api_version": "apps/v1", "kind": "Deployment"},
            {"name": "cm", "api_version": "v1", "kind": "ConfigMap", "ignore_fields": ignore},
            {"name": "widget", "api_version": "example.com/v1", "kind": "Widget"},
        ]))
        .stdout_per_resource(dir.path())
        .build();
    // Widget `apps/w`, its spec with a list and a nested array to patch.
    let widget_w = |size: i64, tags: &[&str]| {
        widget(
            "apps",
            "w",
            json!({"size": size, "tags": tags, "nested": {"a": {"b": [1, 2, {"c": size}]}}}),
        )
    };
    api.create(typed(&deployment("apps", "web", 5, 0, "web:1")));
    api.create(typed(
        &configmap("apps", "settings", "1").label("team", "shop"),
    ));
    api.create(widget_w(1, &["a"]));
    let app = RunningApp::start(cfg, &api).await;
    app.synced().await;
    let d = dir.path();
    settle(&d.join("deploy-all.jsonl"), 1).await;
    settle(&d.join("widget.jsonl"), 1).await;
    // Status churn: 5 updates of the status only, then a spec change, twice over.
    for round in 0..2 {
        for ready in 1..=5 {
            api.update(typed(&deployment(
                "apps",
                "web",
                5,
                ready,
                &format!("web:{}", round + 1),
            )));
        }
        api.update(typed(&deployment(
            "apps",
            "web",
            5,
            5,
            &format!("web:{}", round + 2),
        )));
    }
    // ConfigMaps: data changes, a label removed, a key added; widgets: nested edits, arrays.
    api.update(typed(
        &configmap("apps", "settings", "2").label("team", "shop"),
    ));
    api.update(typed(&configmap_with_data(
        "apps",
        "settings",
        [("v", "2"), ("w", "new")],
    )));
    for (size, tags) in [
        (2, vec!["a", "b"]),
        (3, vec!["b"]),
        (3, vec![]),
        (4, vec!["x", "y", "z"]),
    ] {
        api.update(widget_w(size, &tags));
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
    let mut d = format!("{} {}", event_type(e), e["subject"].as_str().unwrap());
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
    run_shop(
        api,
        dir,
        json!({"name": "shop", "api_version": "v1", "kind": "ConfigMap", "filter": filter}),
        total,
    )
    .await
}

/// Starts the bridge with ConfigMap resource `shop` (`resource`), writing `dir/shop.jsonl`.
async fn start_shop(api: &ApiServer, dir: &Path, resource: Value) -> RunningApp {
    let cfg = ConfigBuilder::new()
        .grace_period("10s")
        .message(json!({}))
        .resource(resource)
        .stdout_per_resource(dir)
        .build();
    let app = RunningApp::start(cfg, api).await;
    app.synced().await;
    app
}

/// Runs the bridge with resource `shop` until `dir/shop.jsonl` holds `total` events and
/// nothing more comes; stops it.
async fn run_shop(api: &ApiServer, dir: &Path, resource: Value, total: usize) -> Vec<Value> {
    let app = start_shop(api, dir, resource).await;
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
        api.create(typed(
            &configmap("ns", &format!("cm-{i:03}"), "1").label("team", team),
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let shop = r#"object.metadata.labels["team"] == "shop""#;
    let first = run_filtered(&api, dir.path(), shop, 150).await;
    assert!(first.iter().all(|e| e["k8sinitial"] == true));
    // While down: a published object relabelled out, one deleted, one changed; an
    // unpublished one relabelled in, one deleted; a new matching one.
    api.update(typed(&configmap("ns", "cm-000", "1").label("team", "web")));
    api.delete("v1", "ConfigMap", "ns", "cm-002");
    api.update(typed(&configmap("ns", "cm-004", "2").label("team", "shop")));
    api.update(typed(&configmap("ns", "cm-001", "1").label("team", "shop")));
    api.delete("v1", "ConfigMap", "ns", "cm-003");
    api.create(typed(&configmap("ns", "cm-new", "1").label("team", "shop")));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_updated_while_down_and_then_relabelled_out_gets_its_filtered_out_delete() {
    let api = ApiServer::start().await;
    for name in ["a", "b", "c"] {
        api.create(typed(&configmap("ns", name, "1").label("team", "shop")));
    }
    let dir = tempfile::tempdir().unwrap();
    let shop = r#"object.metadata.labels["team"] == "shop""#;
    run_filtered(&api, dir.path(), shop, 3).await;
    // While down: a and b change (a resume publishes them as updated).
    api.update(typed(&configmap("ns", "a", "2").label("team", "shop")));
    api.update(typed(&configmap("ns", "b", "2").label("team", "shop")));
    let resource =
        json!({"name": "shop", "api_version": "v1", "kind": "ConfigMap", "filter": shop});
    let app = start_shop(&api, dir.path(), resource).await;
    let path = dir.path().join("shop.jsonl");
    settle(&path, 5).await;
    // Then a leaves the filter and b is deleted: consumers must drop both.
    api.update(typed(&configmap("ns", "a", "3").label("team", "web")));
    api.delete("v1", "ConfigMap", "ns", "b");
    let events = settle(&path, 7).await;
    let got: Vec<String> = events[3..].iter().map(brief).collect();
    assert_eq!(
        got[..2].iter().filter(|e| e.ends_with("resumed")).count(),
        2
    );
    let mut after: Vec<String> = got[2..].to_vec();
    after.sort();
    assert_eq!(after, ["deleted ns/a filteredout", "deleted ns/b"]);
    assert!(app.stop().await.undelivered.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_if_skips_changes_without_ever_deleting_a_member() {
    // The book's change filter, on ConfigMaps: only changes of data.v are published.
    let api = ApiServer::start().await;
    for name in ["a", "b"] {
        api.create(typed(&configmap("ns", name, "1").label("team", "shop")));
    }
    let resource = json!({"name": "shop", "api_version": "v1", "kind": "ConfigMap",
        "filter": r#"object.metadata.labels["team"] == "shop""#,
        "publish_if": r#"type != "updated" || object.data.v != oldObject.data.v"#});
    let dir = tempfile::tempdir().unwrap();
    let app = start_shop(&api, dir.path(), resource.clone()).await;
    let path = dir.path().join("shop.jsonl");
    settle(&path, 2).await;
    // Label-only changes: skipped (before the fix, each was a k8sfilteredout delete).
    for round in 0..3 {
        api.update(typed(
            &configmap("ns", "a", "1")
                .label("team", "shop")
                .label("round", &round.to_string()),
        ));
    }
    api.update(typed(&configmap("ns", "a", "2").label("team", "shop")));
    let events = settle(&path, 3).await;
    assert_eq!(events.len(), 3, "{events:#?}");
    assert_eq!(brief(&events[2]), "updated ns/a");
    assert_eq!(
        events[2]["data"]["oldObject"]["data"]["v"], "1",
        "the old state is the last published one"
    );
    let skipped = app
        .metrics
        .filtered
        .with_label_values(&["shop", "shop", "publish_if"])
        .get();
    assert_eq!(skipped, 3);
    assert!(app.stop().await.undelivered.is_empty());
    // A restart with nothing changed publishes nothing (no delete of unchanged members).
    let again = run_shop(&api, dir.path(), resource, 3).await;
    assert_eq!(again.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_filter_sees_every_change_and_unpublished_deletes_still_settle_the_checkpoint() {
    let api = ApiServer::start().await;
    for name in ["a", "b", "c"] {
        api.create(typed(&configmap("ns", name, "1").label("team", "shop")));
    }
    let dir = tempfile::tempdir().unwrap();
    let shop = r#"object.metadata.labels["team"] == "shop""#;
    // No `updated` published: relabelling is still seen by the filter.
    let resource = json!({"name": "shop", "api_version": "v1", "kind": "ConfigMap",
        "filter": shop, "events": ["added", "deleted"]});
    let app = start_shop(&api, dir.path(), resource).await;
    let path = dir.path().join("shop.jsonl");
    settle(&path, 3).await;
    api.update(typed(&configmap("ns", "a", "2").label("team", "web")));
    settle(&path, 4).await;
    api.update(typed(&configmap("ns", "a", "3").label("team", "shop")));
    let events = settle(&path, 5).await;
    assert_eq!(
        events[3..].iter().map(brief).collect::<Vec<_>>(),
        ["deleted ns/a filteredout", "added ns/a"]
    );
    assert!(app.stop().await.undelivered.is_empty());
    // No `deleted` published: a delete still removes the key from the checkpoint.
    let resource = json!({"name": "shop", "api_version": "v1", "kind": "ConfigMap",
        "filter": shop, "events": ["added", "updated"]});
    let app = start_shop(&api, dir.path(), resource.clone()).await;
    api.delete("v1", "ConfigMap", "ns", "b");
    api.update(typed(&configmap("ns", "c", "2").label("team", "web")));
    let route = vec!["shop/shop".to_owned()];
    support::wait::until(
        "the checkpoint forgets b and c",
        support::wait::PATIENCE,
        async || {
            use kube_event_bridge::sinks::CheckpointStore;
            let fresh = kube_event_bridge::sinks::stdout::FileCheckpointStore::beside(&path);
            let loaded = fresh.load_routes(&route).await.unwrap();
            loaded.get("shop/shop").is_some_and(|c| {
                c.contains_key("ns/a") && !c.contains_key("ns/b") && !c.contains_key("ns/c")
            })
        },
    )
    .await;
    assert!(app.stop().await.undelivered.is_empty());
    assert_eq!(
        cloudevent_lines(&path).len(),
        5,
        "nothing published for them"
    );
}
