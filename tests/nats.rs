//! The NATS sink against a real nats-server (JetStream, file storage), fed by the whole
//! service: API test server → informer → pipeline → NATS.

mod support;

use std::{collections::HashMap, sync::Arc, time::Duration};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_event_bridge::{
    config::Config,
    sinks::{
        Sink,
        nats::NatsSink,
        template::{Field, unescape_nats_token},
    },
};
use serde_json::{Value, json};
use support::{
    ApiServer, RunningApp,
    broker::Broker,
    config::{ConfigBuilder, NATS_STREAM as STREAM, nats_settings, nats_sink},
    event_type,
    nats::{NatsServer, read_stream, stream_len},
    objects::{Meta, configmap, named, typed},
    sink_scenarios,
    wait::{self, PATIENCE, Patience},
};

/// A JetStream sink `nats` on `nats` (the tests' settings) and its checkpoint store.
async fn sink_and_store(
    nats: &NatsServer,
) -> (
    Arc<NatsSink>,
    kube_event_bridge::sinks::nats::NatsCheckpointStore,
) {
    let cfg = nats_settings(nats_sink("nats", &nats.url(), json!({})));
    let sink = Arc::new(NatsSink::connect("nats", &cfg).await.unwrap());
    let store = kube_event_bridge::sinks::nats::NatsCheckpointStore::open("nats", &cfg, &sink)
        .await
        .unwrap();
    (sink, store)
}

/// Waits (up to 60 s, looking every 50 ms) until the stream holds at least `n` messages.
async fn wait_for_stream(url: &str, n: u64) {
    let patience = Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(50));
    if !wait::within(patience, async || stream_len(url, STREAM).await >= n).await {
        panic!(
            "stream has {} of {n} messages",
            stream_len(url, STREAM).await
        );
    }
}

/// Per object key: the resourceVersions of its messages in stream order; and all ids.
fn by_object(messages: &[Value]) -> (HashMap<String, Vec<u64>>, Vec<String>) {
    let mut per_key: HashMap<String, Vec<u64>> = HashMap::new();
    let mut ids = Vec::new();
    for m in messages {
        per_key
            .entry(m["subject"].as_str().unwrap().to_owned())
            .or_default()
            .push(m["k8sresourceversion"].as_str().unwrap().parse().unwrap());
        ids.push(m["id"].as_str().unwrap().to_owned());
    }
    (per_key, ids)
}

/// [`sink_scenarios::every_change_once_in_order`] on JetStream: each message's id is its
/// `Nats-Msg-Id`, its subject `k8s.{cluster}.{group}.{kind}.{namespace}.{name}` with the
/// name (which has dots) escaped into one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_gets_every_notification_once_in_order_with_escaped_subjects() {
    let broker = Broker::jetstream();
    let delivered = sink_scenarios::every_change_once_in_order(&broker).await;
    for m in &delivered {
        let e = &m.body;
        assert_eq!(m.header("Nats-Msg-Id"), e["id"].as_str());
        let tokens: Vec<&str> = m.key.split('.').collect();
        assert_eq!(tokens.len(), 6, "{}", m.key);
        let namespace = e["subject"].as_str().unwrap().split('/').next().unwrap();
        assert_eq!(
            &tokens[..5],
            ["k8s", "test", "core", "ConfigMap", namespace]
        );
        assert_eq!(
            unescape_nats_token(Field::Group, tokens[2]).as_deref(),
            Some("")
        );
        assert_eq!(
            unescape_nats_token(Field::Name, tokens[5]).unwrap(),
            e["k8sname"].as_str().unwrap()
        );
        assert!(
            tokens[5].contains("%2E"),
            "dots in names are escaped: {}",
            m.key
        );
    }
}

/// [`sink_scenarios::binary_mode`] on JetStream, with a subject template naming the type;
/// the message id is the event's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_mode_puts_attributes_in_ce_headers_and_data_in_the_body() {
    let broker = Broker::jetstream();
    let extra = json!({"subject": "k8s.{namespace}.{name}.{type}"});
    let m = sink_scenarios::binary_mode(&broker, extra).await;
    assert_eq!(m.key, "k8s.ns.a.added");
    assert_eq!(m.header("ce-id"), m.header("Nats-Msg-Id"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_during_load_loses_nothing() {
    let mut nats = NatsServer::start();
    let api = Arc::new(ApiServer::start().await);
    api.create(typed(&configmap("ns", "marker", "1")));
    let cfg = ConfigBuilder::new()
        .grace_period("10s")
        .configmaps()
        .sink(nats_sink("nats", &nats.url(), json!({})))
        .route("configmap", &["nats"])
        .build();
    let running = RunningApp::start(cfg, &api).await;
    // Once the marker is in, the informer watches: every write below is one notification.
    wait_for_stream(&nats.url(), 1).await;
    let writer = support::spawn_creates_and_updates(&api, 200, 20);
    wait_for_stream(&nats.url(), 51).await;
    // Mid-load, down for longer than the ack timeout: publishes fail or time out and are retried.
    tokio::task::block_in_place(|| nats.restart_after(Duration::from_millis(1500)));
    writer.await.unwrap();
    wait_for_stream(&nats.url(), 401).await;
    let failed = running.outage_failures("nats");
    // New objects first wait for their checkpoint intent (a KV write on the same server), so
    // the outage shows as failed publishes or as failed checkpoint writes (retried).
    let checkpoint_failed = running
        .metrics
        .checkpoint_write_failures
        .with_label_values(&["configmap/nats"])
        .get();
    assert!(
        failed + checkpoint_failed > 0,
        "the outage made publishes or checkpoint writes fail (and be retried)"
    );
    let report = running.stop().await;
    assert!(report.undelivered.is_empty(), "{:?}", report.undelivered);
    let events: Vec<Value> = read_stream(&nats.url(), STREAM)
        .await
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect();
    events.iter().for_each(support::schema::check_cloudevent);
    let (per_key, ids) = by_object(&events);
    let unique: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), 401, "every notification arrived");
    assert_eq!(ids.len(), 401, "duplicates were dropped by Nats-Msg-Id");
    for (key, rvs) in per_key.iter().filter(|(k, _)| *k != "ns/marker") {
        assert_eq!(rvs.len(), 2, "{key}");
        assert!(rvs[0] < rvs[1], "{key}: {rvs:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_suppression_patches_and_oversized_objects_on_a_small_max_payload_server() {
    let nats = NatsServer::with_config("max_payload: 65536");
    // ConfigMap `ns/name` of team `team` (a label) with `data.v = v` and a status (which
    // a ConfigMap has no type for) in `phase`.
    let team_cm = |name: &str, team: &str, v: &str, phase: &str| {
        let mut cm = typed(&configmap("ns", name, v).label("team", team));
        cm["status"] = json!({"phase": phase});
        cm
    };
    let api = ApiServer::start().await;
    api.create(team_cm("small", "shop", "1", "a"));
    api.create(team_cm("other", "web", "1", "a"));
    // 200 KB: only a reference fits under 64 KB.
    api.create(team_cm("huge", "shop", &"x".repeat(200_000), "a"));
    // Its reference keeps the labels, 70 KB of them: dead-lettered.
    let labels = (0..1000).map(|i| (format!("label-{i:04}"), "y".repeat(60)));
    api.create(typed(
        &named::<ConfigMap>(Some("ns"), "labels")
            .labels(labels)
            .label("team", "shop"),
    ));
    let mut main = nats_sink("nats", &nats.url(), json!({}));
    main["dead_letter"] = json!("dlq");
    let dlq = nats_sink(
        "dlq",
        &nats.url(),
        json!({"subject": "k8s.deadletter.{kind}"}),
    );
    let mut cfg = ConfigBuilder::new()
        .grace_period("10s")
        .configmaps()
        .sink(main)
        .sink(dlq)
        .route("configmap", &["nats"])
        .build();
    cfg.resources[0].filter = Some(r#"object.metadata.labels["team"] == "shop""#.into());
    cfg.resources[0].ignore_fields = vec!["/status".into(), "/metadata/resourceVersion".into()];
    cfg.message.diff = kube_event_bridge::config::DiffMode::Patch;
    let running = RunningApp::start(cfg, &api).await;
    // small, huge (a reference), the dead letter.
    wait_for_stream(&nats.url(), 3).await;
    api.update(team_cm("small", "shop", "1", "b")); // status only: suppressed
    api.update(team_cm("small", "shop", "2", "c")); // published, its patch from phase a
    api.update(team_cm("other", "web", "2", "a")); // never matches
    api.update(team_cm("small", "web", "2", "c")); // leaves: k8sfilteredout
    api.update(team_cm("other", "shop", "2", "a")); // enters: added
    wait_for_stream(&nats.url(), 6).await;
    let metrics = running.metrics.clone();
    let report = running.stop().await;
    assert!(report.undelivered.is_empty());
    let messages = read_stream(&nats.url(), STREAM).await;
    let dead: Vec<_> = messages
        .iter()
        .filter(|m| m.subject.as_str() == "k8s.deadletter.ConfigMap")
        .collect();
    assert_eq!(dead.len(), 1);
    let record: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(record["key"], "ns/labels");
    assert_eq!(record["reason"], "too_large");
    let events: Vec<Value> = messages
        .iter()
        .filter(|m| !m.subject.as_str().starts_with("k8s.deadletter"))
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect();
    events.iter().for_each(support::schema::check_cloudevent);
    let seen: Vec<String> = events
        .iter()
        .map(|e| {
            format!(
                "{} {}{}{}",
                e["k8sname"].as_str().unwrap(),
                event_type(e),
                if e["k8sfilteredout"] == true {
                    " filteredout"
                } else {
                    ""
                },
                if e["k8struncated"] == true {
                    " truncated"
                } else {
                    ""
                },
            )
        })
        .collect();
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "huge added truncated",
            "other added",
            "small added",
            "small deleted filteredout",
            "small updated",
        ],
        "in stream order: {seen:?}"
    );
    let update = events
        .iter()
        .find(|e| e["type"].as_str().unwrap().ends_with("updated"))
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_value(update["data"]["patch"].clone()).unwrap();
    let mut old = update["data"]["oldObject"].clone();
    assert_eq!(
        old["status"]["phase"], "a",
        "the last published state, not the suppressed one"
    );
    json_patch::patch(&mut old, &patch).unwrap();
    assert_eq!(old, update["data"]["object"]);
    // [old_object, patch, reference, dead_letter]
    assert_eq!(support::degraded(&metrics, "nats"), [0, 0, 1, 1]);
    let filtered = |reason: &str| {
        metrics
            .filtered
            .with_label_values(&["configmap", "nats", reason])
            .get()
    };
    assert_eq!(["filter", "suppressed"].map(filtered), [2, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_a_clear_start_error_and_right_ones_work() {
    let nats = NatsServer::with_config("authorization { user: bridge, password: s3cret-pw }");
    let cfg = |var: &str| {
        let sink = nats_sink(
            "nats",
            &nats.url(),
            json!({"auth": {"user": "bridge", "password": {"env": var}}, "mode": "core", "stream": null}),
        );
        nats_settings(sink)
    };
    // SAFETY: tests in this binary do not read these variables concurrently.
    unsafe {
        std::env::set_var("KEB_TEST_NATS_WRONG", "not-the-password");
        std::env::set_var("KEB_TEST_NATS_RIGHT", "s3cret-pw");
    }
    let err = NatsSink::connect("nats", &cfg("KEB_TEST_NATS_WRONG"))
        .await
        .err()
        .expect("wrong password fails");
    let text = err.to_string();
    assert!(text.contains(&nats.url()), "{text}");
    assert!(text.to_lowercase().contains("authorization"), "{text}");
    assert!(
        !text.contains("not-the-password"),
        "secrets never appear in errors"
    );
    let sink = NatsSink::connect("nats", &cfg("KEB_TEST_NATS_RIGHT"))
        .await
        .unwrap();
    assert!(sink.health().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_does_not_cover_the_subjects_is_a_start_error() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    async_nats::jetstream::new(client)
        .create_stream(async_nats::jetstream::stream::Config {
            name: "OTHER".into(),
            subjects: vec!["other.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let refused = async |stream: &str| {
        let sink = nats_sink("nats", &nats.url(), json!({"stream": {"name": stream}}));
        let connected = NatsSink::connect("nats", &nats_settings(sink)).await;
        connected.err().expect("a start error").to_string()
    };
    let err = refused("OTHER").await;
    assert!(
        err.contains("stream OTHER") && err.contains("do not cover \"k8s.*.*.*.*.*\""),
        "{err}"
    );
    let err = refused("NOPE").await;
    assert!(
        err.contains("stream NOPE") && err.contains("stream.create"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_mode_publishes_to_subscribers_and_health_follows_the_connection() {
    let mut nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut sub = client.subscribe("k8s.>").await.unwrap();
    client.flush().await.unwrap();
    let api = ApiServer::start().await;
    api.create(typed(&configmap("ns", "a", "1")));
    let cfg = ConfigBuilder::new()
        .grace_period("10s")
        .configmaps()
        .sink(nats_sink(
            "nats",
            &nats.url(),
            json!({"mode": "core", "stream": null}),
        ))
        .route("configmap", &["nats"])
        .build();
    let running = RunningApp::start(cfg, &api).await;
    let m = tokio::time::timeout(Duration::from_secs(20), futures::StreamExt::next(&mut sub))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.subject.as_str(), "k8s.test.core.ConfigMap.ns.a");
    assert!(
        m.headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .is_none(),
        "no JetStream headers in core mode"
    );
    running.stop().await;

    let sink_cfg = nats_sink("nats", &nats.url(), json!({"mode": "core", "stream": null}));
    let cfg = nats_settings(sink_cfg);
    let sink = NatsSink::connect("nats", &cfg).await.unwrap();
    assert!(sink.health().is_ok());
    nats.stop();
    wait::until("health reports the lost connection", PATIENCE, async || {
        sink.health().is_err()
    })
    .await;
    nats.restart();
    wait::until("health recovers", PATIENCE, async || sink.health().is_ok()).await;
}

/// Resume with the default settings on JetStream: the checkpoint bucket is created, and a
/// restart publishes exactly what changed while the bridge was down, deletes included; the
/// unchanged objects publish nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_checkpoint_bucket() {
    let nats = NatsServer::start();
    let api = ApiServer::start().await;
    for i in 0..40 {
        api.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    let cfg = || {
        ConfigBuilder::new()
            .grace_period("10s")
            .configmaps()
            .sink(nats_sink("nats", &nats.url(), json!({})))
            .route("configmap", &["nats"])
            .build()
    };
    let first = RunningApp::start(cfg(), &api).await;
    wait_for_stream(&nats.url(), 40).await;
    assert!(first.stop().await.undelivered.is_empty());

    let want = support::change_while_down(&api, 0..4, 4..8, 40..41, 8..9);
    let expected: usize = want.values().map(Vec::len).sum();

    let second = RunningApp::start(cfg(), &api).await;
    wait_for_stream(&nats.url(), (40 + expected) as u64).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let unchanged = second.unchanged_on_resume("configmap/nats");
    assert!(second.stop().await.undelivered.is_empty());
    assert_eq!(unchanged, 40 - 9, "objects unchanged while down");
    let raw = read_stream(&nats.url(), STREAM).await;
    assert_eq!(raw.len(), 40 + expected, "nothing but the changes");
    let events: Vec<Value> = raw[40..]
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect();
    assert!(events.iter().all(|e| e["k8sresumed"] == true));
    events.iter().for_each(support::schema::check_cloudevent);
    let got = support::resumed_types(&events);
    assert_eq!(got, want);
}

/// A checkpoint bucket the user may not create fails the start, naming the bucket and the
/// permissions it needs; publishing to the sink's own stream is allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_bucket_that_cannot_be_created_is_a_start_error_naming_it() {
    let nats = NatsServer::with_config(
        r#"authorization { users = [ { user: bridge, password: pw, permissions: {
             publish: { allow: [">"], deny: ["$JS.API.STREAM.CREATE.KV_kube-event-bridge-checkpoints"] },
             subscribe: ">" } } ] }"#,
    );
    let api = ApiServer::start().await;
    // SAFETY: no other test of this binary reads this variable.
    unsafe { std::env::set_var("KEB_TEST_NATS_CP", "pw") };
    let sink = nats_sink(
        "nats",
        &nats.url(),
        json!({"auth": {"user": "bridge", "password": {"env": "KEB_TEST_NATS_CP"}}}),
    );
    let err = kube_event_bridge::app::App::build(
        ConfigBuilder::new()
            .grace_period("10s")
            .configmaps()
            .sink(sink)
            .route("configmap", &["nats"])
            .build(),
        api.client(),
    )
    .await
    .err()
    .expect("the start fails");
    let text = err.to_string();
    assert!(
        text.contains(
            "sink nats: checkpoint bucket kube-event-bridge-checkpoints: cannot create it"
        ) && text.contains("KV_kube-event-bridge-checkpoints"),
        "{text}"
    );
}

/// `tail` and `state` on a JetStream sink (binary encoding), as the book shows them: the
/// tail prints exactly the stream's messages (from the beginning) or what came after it
/// started (from now); `state` equals the informer's cache, and `--check` names an object
/// deleted and one changed behind the bridge's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_and_state_read_the_jetstream_stream() {
    let nats = NatsServer::start();
    let api = ApiServer::start().await;
    for i in 0..30 {
        api.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    let cfg_value = ConfigBuilder::new()
        .configmaps()
        .sink(nats_sink(
            "nats",
            &nats.url(),
            json!({"encoding": "binary"}),
        ))
        .route("configmap", &["nats"])
        .value();
    let running = RunningApp::start(Config::from_value(cfg_value.clone()).unwrap(), &api).await;
    running.synced().await;
    wait_for_stream(&nats.url(), 30).await;
    let tools = support::tools::Tools::new(&cfg_value, Some(&api));
    let mut from_now = tools.tail("nats", &["--output", "json"]);
    let mut all = tools.tail("nats", &["--output", "json", "--from-beginning"]);
    from_now.ready().await;
    all.ready().await;
    for i in 0..5 {
        api.update(typed(&configmap("ns", &format!("cm-{i:02}"), "2")));
    }
    for i in 10..13 {
        api.delete("v1", "ConfigMap", "ns", &format!("cm-{i:02}"));
    }
    for i in 30..32 {
        api.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    wait_for_stream(&nats.url(), 40).await;
    from_now.printed(10).await;
    all.printed(40).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let on_stream: Vec<Value> = read_stream(&nats.url(), STREAM)
        .await
        .iter()
        .map(|m| {
            let headers: Vec<(String, String)> = m
                .headers
                .iter()
                .flat_map(|(k, vs)| vs.iter().map(move |v| (k.to_string(), v.to_string())))
                .collect();
            support::schema::structured_from_binary(
                headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                "ce-",
                serde_json::from_slice(&m.payload).unwrap(),
            )
        })
        .collect();
    assert_eq!(on_stream.len(), 40);
    let (code, _, stderr) = all.interrupt();
    assert_eq!(code, Some(0), "Ctrl-C stops cleanly: {stderr}");
    let (code, lines, stderr) = from_now.interrupt();
    assert_eq!(code, Some(0), "{stderr}");
    let printed = support::tools::events(&lines);
    assert_eq!(
        support::sorted_ids(&printed),
        support::sorted_ids(&on_stream[30..]),
        "from now: exactly what came after the start"
    );
    let (code, out, err) = tools.run("tail", "nats", &["--from-beginning", "--count", "40"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 40);
    assert_eq!(
        out.lines().filter(|l| l.contains(" deleted ")).count(),
        3,
        "{out}"
    );

    // The state is the informer's cache.
    let (code, out, err) = tools.run("state", "nats", &["--output", "json"]);
    assert_eq!(code, Some(0), "{err}");
    let state: Vec<Value> = serde_json::from_str(&out).unwrap();
    let mut from_state: Vec<(String, String)> = state
        .iter()
        .map(|o| {
            (
                format!(
                    "{}/{}",
                    o["metadata"]["namespace"].as_str().unwrap(),
                    o["metadata"]["name"].as_str().unwrap()
                ),
                o["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            )
        })
        .collect();
    from_state.sort();
    let mut cache: Vec<(String, String)> = running.factory.informers()[0]
        .indexer()
        .entries()
        .into_iter()
        .map(|(k, o)| (k, o.resource_version().unwrap().to_owned()))
        .collect();
    cache.sort();
    assert_eq!(from_state.len(), 29);
    assert_eq!(from_state, cache);
    // On a terminal, the read shows its progress on stderr.
    let shown = tools.run_in_terminal("state", "nats", &[]);
    assert!(shown.contains("40 messages read ("), "{shown}");
    assert!(shown.contains("RESOURCEVERSION"), "{shown}");
    assert!(running.stop().await.undelivered.is_empty());

    // Behind the bridge's back (it is stopped).
    api.delete("v1", "ConfigMap", "ns", "cm-20");
    api.update(typed(&configmap("ns", "cm-21", "2")));
    api.create(typed(&configmap("ns", "late", "1")));
    let (code, out, err) = tools.run("state", "nats", &["--check"]);
    assert_eq!(code, Some(3), "differences exit 3: {out}{err}");
    assert!(out.contains("RESOURCE") && out.contains("cm-01"), "{out}");
    assert!(out.contains("3 difference(s) with the cluster"), "{out}");
    assert!(out.contains("GONE    ns/cm-20: on configmaps"), "{out}");
    assert!(out.contains("STALE   ns/cm-21: on configmaps"), "{out}");
    assert!(out.contains("MISSING ns/late: in the cluster"), "{out}");
}

/// `tail` on a core NATS sink: from now only (core NATS keeps nothing), every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_reads_core_nats_subjects_from_now() {
    let nats = NatsServer::start();
    let api = ApiServer::start().await;
    let cfg_value = ConfigBuilder::new()
        .configmaps()
        .sink(nats_sink(
            "nats",
            &nats.url(),
            json!({"mode": "core", "stream": null}),
        ))
        .route("configmap", &["nats"])
        .value();
    let tools = support::tools::Tools::new(&cfg_value, None);
    let (code, _, err) = tools.run("tail", "nats", &["--from-beginning"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("keeps no messages"), "{err}");
    let (code, _, err) = tools.run("state", "nats", &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("core NATS"), "{err}");

    let mut tail = tools.tail("nats", &["--output", "json", "--kind", "configmaps"]);
    tail.ready().await;
    let running = RunningApp::start(Config::from_value(cfg_value.clone()).unwrap(), &api).await;
    for i in 0..20 {
        api.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    tail.printed(20).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, lines, stderr) = tail.interrupt();
    assert_eq!(code, Some(0), "{stderr}");
    let names: std::collections::BTreeSet<String> = lines
        .iter()
        .map(|l| {
            let e: Value = serde_json::from_str(l).unwrap();
            support::schema::check_cloudevent(&e);
            e["k8sname"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(lines.len(), 20);
    assert_eq!(names.len(), 20);
    running.stop().await;
}

/// Fencing on NATS: each leadership term publishes on a connection of its own. A publish
/// handed over while the connection was down stays buffered in async-nats; once the term
/// ends ([`Sink::abandon_queued`]) that connection never reconnects, so the buffered
/// publish never lands behind what a newer leader published. The next term's connection
/// publishes (and checkpoints) as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_terms_publishes_buffered_while_disconnected_are_never_sent() {
    use kube::api::{ApiResource, GroupVersionKind};
    use kube_event_bridge::message::{Encoder, Encoding, MessageConfig};
    let mut nats = NatsServer::start();
    let sink_cfg = nats_sink("nats", &nats.url(), json!({}));
    let cfg = nats_settings(sink_cfg);
    let sink = NatsSink::connect("nats", &cfg).await.unwrap();
    let configmaps = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("", "v1", "ConfigMap"),
        "configmaps",
    );
    let encoder = Encoder::new(
        "test",
        &configmaps,
        &MessageConfig::default(),
        Encoding::Structured,
    );
    let message = |id: &str| {
        let mut m = encoder.sample_message();
        m.id = id.into();
        m.key = format!("ns/{id}");
        m.namespace = Some("ns".into());
        m.name = id.into();
        m.payload = format!("{{\"id\":\"{id}\"}}").into_bytes().into();
        m
    };
    sink.publish(&message("before")).await.unwrap();
    nats.stop();
    wait::until("the sink sees the connection lost", PATIENCE, async || {
        sink.health().is_err()
    })
    .await;
    // Handed over while disconnected: buffered by async-nats.
    let buffered = sink.submit(&message("buffered")).await.unwrap();
    // The term ends (the lease is lost); the server comes back.
    sink.abandon_queued();
    nats.restart();
    wait::until("the next term's connection is up", PATIENCE, async || {
        sink.health().is_ok()
    })
    .await;
    sink.publish(&message("after")).await.unwrap();
    assert!(
        buffered.await.is_err(),
        "the ended term's publish is never acknowledged"
    );
    // Time for a late flush to show, were there one.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: Vec<String> = read_stream(&nats.url(), STREAM)
        .await
        .iter()
        .map(|m| {
            m.headers
                .get("Nats-Msg-Id")
                .map(|v| v.to_string())
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(ids, ["before", "after"]);
}

/// Item 5 of the sharding issue: each shard's term publishes on a connection of its own, so a
/// hand-over of one shard (its connection retired) fails no other shard's publishes, and the
/// checkpoint store, which an acquired shard reads at once, is not touched either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_of_one_shard_retires_no_other_shards_connection() {
    use kube_event_bridge::{
        shard::Shard,
        sinks::{CheckpointStore, checkpoint::Entry},
    };
    let nats = NatsServer::start();
    let (sink, store) = sink_and_store(&nats).await;
    let shards = [0, 1].map(|index| Shard { index, count: 2 });
    let [a, b] = shards.map(|shard| sink.clone().shard_view(shard).expect("a view per shard"));
    let m = |name: &str| support::message("test", name, "{}");
    let err = a
        .submit(&m("early"))
        .await
        .err()
        .expect("no term, no connection");
    assert!(err.is_retriable(), "{err}");
    a.begin_term(shards[0], None).await.unwrap();
    b.begin_term(shards[1], None).await.unwrap();
    let entry = |rv: &str| Entry {
        uid: "u".into(),
        resource_version: rv.into(),
        pending: false,
        kind: None,
    };
    let routes = ["configmap#0-of-2/nats", "configmap#1-of-2/nats"];
    for route in routes {
        store
            .write(route, vec![("ns/x".into(), Some(entry("1")))])
            .await
            .unwrap();
    }
    for i in 0..20 {
        a.publish(&m(&format!("a-{i}"))).await.unwrap();
        b.publish(&m(&format!("b-{i}"))).await.unwrap();
    }
    // Shard 1 is handed on undrained: its connection is retired, and only its.
    b.abandon_queued();
    b.end_term(shards[1]);
    assert_eq!((a.abandoned(), b.abandoned()), (0, 1));
    for i in 20..40 {
        a.publish(&m(&format!("a-{i}")))
            .await
            .expect("shard 0 publishes on as if nothing happened");
    }
    // The checkpoints read at once (an acquisition's), and shard 0's routes write on.
    let loaded = store.load_routes(&routes.map(String::from)).await.unwrap();
    assert_eq!(loaded.len(), 2, "{loaded:?}");
    store
        .write(routes[0], vec![("ns/x".into(), Some(entry("2")))])
        .await
        .unwrap();
    // Shard 1's routes write nothing without a term (an old term's write never lands late).
    assert!(
        store
            .write(routes[1], vec![("ns/x".into(), Some(entry("2")))])
            .await
            .is_err()
    );
    assert!(b.publish(&m("b-late")).await.is_err());
    b.begin_term(shards[1], None).await.unwrap();
    b.publish(&m("b-again")).await.unwrap();
    store
        .write(routes[1], vec![("ns/x".into(), Some(entry("3")))])
        .await
        .unwrap();
    let loaded = store.load_routes(&routes.map(String::from)).await.unwrap();
    let rvs: Vec<_> = routes
        .iter()
        .map(|r| loaded[*r]["ns/x"].resource_version.as_str())
        .collect();
    assert_eq!(rvs, ["2", "3"]);
    wait_for_stream(&nats.url(), 61).await;
    assert_eq!(stream_len(&nats.url(), STREAM).await, 61);
}

/// Core NATS counts a publish done once the connection buffered it: a shard's drained
/// hand-over sends what its term's connection buffers (`commit_term`) before the term's
/// connection is closed, so the last messages of a clean hand-over reach subscribers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_hand_over_in_core_mode_sends_what_the_connection_buffered() {
    use kube_event_bridge::shard::Shard;
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut sub = client.subscribe("k8s.>").await.unwrap();
    client.flush().await.unwrap();
    let sink_cfg = nats_sink("nats", &nats.url(), json!({"mode": "core", "stream": null}));
    let cfg = nats_settings(sink_cfg);
    let sink = Arc::new(NatsSink::connect("nats", &cfg).await.unwrap());
    let shard = Shard { index: 1, count: 3 };
    let view = sink.clone().shard_view(shard).unwrap();
    view.begin_term(shard, None).await.unwrap();
    assert!(sink.health().is_ok());
    let payload = "x".repeat(2_000);
    for i in 0..2_000 {
        view.publish(&support::message("test", &format!("c-{i}"), &payload))
            .await
            .unwrap();
    }
    view.commit_term(shard).await.unwrap();
    view.end_term(shard);
    let mut got = 0;
    while got < 2_000 {
        match tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut sub)).await
        {
            Ok(Some(_)) => got += 1,
            _ => break,
        }
    }
    assert_eq!(got, 2_000, "every message published in the term arrives");
}

/// A checkpoint load whose server gives no answer (nats-server frozen with SIGSTOP: its
/// connections stay open, nothing comes back) fails within its deadline, naming the stall,
/// instead of waiting for the pull consumer's missed heartbeats; read again once the server
/// answers, it loads every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_read_that_gets_no_answer_fails_within_its_deadline_and_reads_again() {
    use kube_event_bridge::sinks::{CheckpointStore, checkpoint::Entry, nats::READ_STALL};
    let nats = NatsServer::start();
    let (_sink, store) = sink_and_store(&nats).await;
    let route = "configmap/nats".to_owned();
    let keys = 20_000;
    let changes = (0..keys)
        .map(|i| {
            let entry = Entry {
                uid: format!("u{i}"),
                resource_version: i.to_string(),
                pending: false,
                kind: None,
            };
            (format!("ns/cm-{i}"), Some(entry))
        })
        .collect();
    store.write(&route, changes).await.unwrap();
    let began = std::time::Instant::now();
    let whole = store.load_routes(std::slice::from_ref(&route)).await;
    assert_eq!(whole.unwrap()[&route].len(), keys);
    let whole = began.elapsed();
    println!("a whole read of {keys} keys: {whole:.1?}");
    // Frozen before the read (a JetStream API request times out on its own), and frozen in
    // the middle of the pull (only the read's own deadline ends it: before, it waited for
    // the pull consumer's missed heartbeats).
    let mut mid_pull = 0;
    for frozen_after in [Duration::ZERO, whole / 4, whole / 2, whole * 3 / 4] {
        let began = std::time::Instant::now();
        let read = store.load_routes(std::slice::from_ref(&route));
        futures::pin_mut!(read);
        let early = tokio::time::timeout(frozen_after, &mut read).await;
        if let Ok(done) = early {
            // The whole read fitted before the freeze: nothing to see here.
            assert_eq!(done.unwrap()[&route].len(), keys);
            continue;
        }
        nats.signal("STOP");
        let outcome = tokio::time::timeout(READ_STALL * 4, read).await;
        let took = began.elapsed();
        nats.signal("CONT");
        let err = match outcome {
            Ok(Err(err)) => err.to_string(),
            // Every record was on its way before the freeze took hold (the client had it
            // buffered): a whole read, as one that fitted before the freeze.
            Ok(Ok(loaded)) => {
                assert_eq!(loaded[&route].len(), keys, "a frozen server answered part");
                continue;
            }
            Err(_) => panic!("the read still waits {:?} after the freeze", READ_STALL * 4),
        };
        println!("frozen after {frozen_after:.1?}: failed after {took:.1?}: {err}");
        if err.contains("no answer from the server") && err.contains("record") {
            mid_pull += 1;
        }
        // Read again (as the waiting route's retry does) once the server answers.
        let loaded = store
            .load_routes(std::slice::from_ref(&route))
            .await
            .expect("the server answers again");
        assert_eq!(loaded[&route].len(), keys);
    }
    assert!(mid_pull > 0, "no freeze landed in the middle of the pull");
}
