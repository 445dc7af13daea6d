//! The Kafka sink against Apache Kafka (a single KRaft node, `support::kafka`) fed by the whole
//! service, and against librdkafka's mock cluster for the fault cases it is made for.

mod support;

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_event_bridge::{
    config::Config, pipeline::checkpoint::CLUSTER_KEY, sinks::kafka::KafkaSink,
};
use serde_json::{Value, json};
use support::{
    ApiServer, RunningApp,
    broker::Broker,
    config::{ConfigBuilder, kafka_settings, kafka_sink},
    event_type,
    kafka::{Kafka, Record, consume},
    objects::{Meta, configmap, configmap_with_data, named, typed},
    sink_scenarios,
    wait::{self, PATIENCE, Patience},
};

/// The events topic of the mock cluster tests (cluster `test`, the default template).
const TOPIC: &str = "k8s.test.core.configmaps";

/// One test's share of the binary's Apache Kafka node ([`Kafka::shared`]): the test runs as
/// cluster `name`, so that its events go to `k8s.<name>.core.configmaps`, its sinks keep
/// their checkpoints in `<name>.checkpoints`, and other topics of its own are `<name>.…`.
struct Topics {
    name: &'static str,
    brokers: String,
}

impl Topics {
    fn of(name: &'static str) -> Self {
        Self {
            name,
            brokers: Kafka::shared().brokers(),
        }
    }

    /// A config builder for this test's cluster.
    fn config(&self) -> ConfigBuilder {
        ConfigBuilder::new().cluster(self.name)
    }

    /// A Kafka sink on the shared node ([`kafka_sink`]) with this test's checkpoint topic.
    fn sink(&self, sink: &str, extra: Value) -> Value {
        let mut s = kafka_sink(sink, &self.brokers, extra);
        s["kafka"]["checkpoint_topic"] = json!(self.topic("checkpoints"));
        s
    }

    /// The topic ConfigMap events go to with the default template.
    fn events(&self) -> String {
        format!("k8s.{}.core.configmaps", self.name)
    }

    /// `<name>.<suffix>`.
    fn topic(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.name)
    }
}

async fn consume_async(brokers: String, topic: &str, n: usize) -> Vec<Record> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || consume(&brokers, &topic, n))
        .await
        .unwrap()
}

/// Fails when a tool logged a warning or an error: reading a healthy topic is quiet (on Apache
/// Kafka every partition read to its end reports `PartitionEOF`, which rdkafka logs as an
/// ERROR unless the reader says otherwise).
fn assert_quiet(stderr: &str) {
    let noisy: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    assert!(noisy.is_empty(), "{}", noisy.join("\n"));
}

/// Checks keys, partitions, order and ids of CloudEvents records; returns the events.
fn check_events(records: &[Record]) -> Vec<Value> {
    let mut partition_of: HashMap<&str, i32> = HashMap::new();
    let mut last: HashMap<(i32, &str), (i64, u64, bool)> = HashMap::new();
    let mut ids = HashSet::new();
    let mut events = Vec::new();
    for r in records {
        let e: Value = if r.header("ce_id").is_some() {
            // Binary mode: rebuild the structured event from the headers.
            support::schema::structured_from_binary(
                r.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                "ce_",
                r.json(),
            )
        } else {
            r.json()
        };
        support::schema::check_cloudevent(&e);
        let key = e["subject"].as_str().unwrap().to_owned();
        assert_eq!(r.key, key, "the key is namespace/name");
        assert_eq!(
            *partition_of.entry(r.key.as_str()).or_insert(r.partition),
            r.partition,
            "one partition per key"
        );
        let rv: u64 = e["k8sresourceversion"].as_str().unwrap().parse().unwrap();
        let tombstone = e["k8sfinalstateunknown"] == true;
        if let Some((offset, prev, after_tombstone)) =
            last.insert((r.partition, r.key.as_str()), (r.offset, rv, tombstone))
        {
            // A final-state-unknown delete carries the version it was found gone at: never
            // older than what came before (the version of the list, which may be the one just
            // published), and the new incarnation found with it follows at that version.
            assert!(
                offset < r.offset && (prev < rv || ((tombstone || after_tombstone) && prev == rv)),
                "{key}: rv {prev} then {rv}: out of order"
            );
        }
        let ty = event_type(&e);
        // An inferred delete is identified by the last state known (its object's version).
        let known = e["data"]["object"]["metadata"]["resourceVersion"].as_str();
        let id_rv = if tombstone {
            known.unwrap().to_owned()
        } else {
            rv.to_string()
        };
        assert_eq!(
            e["id"].as_str().unwrap(),
            format!("{}:{id_rv}:{ty}", e["k8suid"].as_str().unwrap()),
            "deterministic id"
        );
        for attr in [
            "specversion",
            "source",
            "time",
            "k8scluster",
            "k8skind",
            "k8sname",
        ] {
            assert!(
                e.get(attr).is_some(),
                "CloudEvents attribute {attr} missing"
            );
        }
        assert_eq!(e["specversion"], "1.0");
        assert!(
            ids.insert(e["id"].as_str().unwrap().to_owned()),
            "duplicate id {}",
            e["id"]
        );
        events.push(e);
    }
    events
}

/// [`sink_scenarios::every_change_once_in_order`] on Kafka: each record keyed by its
/// object's namespace/name, one partition per key, the keys spread over the partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_notification_arrives_keyed_and_in_order_as_structured_cloudevents() {
    let broker = Broker::shared_kafka("order");
    let delivered = sink_scenarios::every_change_once_in_order(&broker).await;
    let mut partition_of: HashMap<&str, i32> = HashMap::new();
    for m in &delivered {
        assert_eq!(
            Some(m.key.as_str()),
            m.body["subject"].as_str(),
            "the key is namespace/name"
        );
        assert_eq!(
            *partition_of.entry(&m.key).or_insert(m.partition),
            m.partition,
            "one partition per key"
        );
    }
    let partitions: HashSet<i32> = partition_of.into_values().collect();
    assert!(partitions.len() > 1, "keys spread over partitions");
}

/// [`sink_scenarios::binary_mode`] on Kafka, with a static header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_mode_carries_attributes_as_ce_headers() {
    let broker = Broker::shared_kafka("binary");
    let extra = json!({"headers": {"x-origin": "bridge-test"}});
    let m = sink_scenarios::binary_mode(&broker, extra).await;
    assert_eq!(m.key, "ns/a");
    assert_eq!(m.header("x-origin"), Some("bridge-test"), "static headers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_topic_replays_into_exactly_the_objects_the_informer_holds() {
    let topics = Topics::of("state-topic");
    let api = ApiServer::start().await;
    for i in 0..10 {
        api.create(typed(&configmap("ns", &format!("cm-{i}"), "1")));
    }
    let cfg = topics
        .config()
        .grace_period("10s")
        .configmaps()
        .sink(topics.sink(
            "kafka",
            json!({"mode": "state", "topic": topics.topic("state.{resource}")}),
        ))
        .route("configmap", &["kafka"])
        .build();
    let running = RunningApp::start(cfg, &api).await;
    running.synced().await;
    for i in 0..10 {
        api.update(typed(&configmap("ns", &format!("cm-{i}"), "2")));
    }
    for i in 0..4 {
        api.delete("v1", "ConfigMap", "ns", &format!("cm-{i}"));
    }
    api.create(typed(&configmap("ns", "late", "1")));
    let records = consume_async(
        topics.brokers.clone(),
        &topics.topic("state.configmaps"),
        25,
    )
    .await;
    let tombstones = records.iter().filter(|r| r.value.is_none()).count();
    assert_eq!(tombstones, 4, "deletes are tombstones");
    // Replay from offset 0: partitions are independent and a key lives in one partition.
    let mut state: HashMap<String, String> = HashMap::new();
    for r in &records {
        match &r.value {
            Some(_) => {
                let obj = r.json();
                assert_eq!(obj["kind"], "ConfigMap", "the value is the object itself");
                support::schema::check_state_value(&obj);
                // Its headers, mapped back with the value as data.object, are the event.
                support::schema::check_cloudevent(&support::schema::structured_from_binary(
                    r.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                    "ce_",
                    json!({ "object": obj }),
                ));
                state.insert(
                    r.key.clone(),
                    obj["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                );
            }
            None => {
                state.remove(&r.key);
            }
        }
    }
    let cache: HashMap<String, String> = running.factory.informers()[0]
        .indexer()
        .entries()
        .into_iter()
        .map(|(k, o)| (k, o.resource_version().unwrap().to_owned()))
        .collect();
    assert_eq!(state, cache, "the replayed state is the informer's cache");
    assert_eq!(state.len(), 7);
    running.stop().await;
}

/// How long a compacted topic of the tests keeps a tombstone after the cleaning that first
/// saw it (`delete.retention.ms`).
const DELETE_RETENTION: Duration = Duration::from_secs(2);

/// Topic configs that make the broker compact within seconds: a segment rolls at the first
/// record 100 ms after it began (the active segment is never cleaned), a log is cleaned once
/// 1% of it is dirty, and tombstones are kept for [`DELETE_RETENTION`].
const COMPACTED_FAST: [(&str, &str); 5] = [
    ("cleanup.policy", "compact"),
    ("segment.ms", "100"),
    ("min.cleanable.dirty.ratio", "0.01"),
    ("min.compaction.lag.ms", "0"),
    ("delete.retention.ms", "2000"),
];

/// Every record `topic` holds, from its first offset, as the checkpoint store reads it.
async fn read_topic(
    brokers: &str,
    topic: &str,
) -> Vec<kube_event_bridge::sinks::kafka::reader::Record> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let mut all = Vec::new();
        kube_event_bridge::sinks::kafka::reader::read_to_end(
            rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers),
            &[topic],
            |r| all.push(r),
        )
        .unwrap();
        all
    })
    .await
    .unwrap()
}

/// Per key, how many records `records` hold, and whether the last one is a tombstone.
fn records_per_key(
    records: &[kube_event_bridge::sinks::kafka::reader::Record],
) -> HashMap<String, (usize, bool)> {
    let mut per_key: HashMap<String, (usize, bool)> = HashMap::new();
    for r in records {
        let e = per_key
            .entry(String::from_utf8(r.key.clone()).unwrap())
            .or_default();
        *e = (e.0 + 1, r.value.is_none());
    }
    per_key
}

/// Log compaction for real: a state topic and a checkpoint topic, both compacted with fast
/// settings, written by the service while objects are added, updated three times and some
/// deleted. After compaction each key holds one record, the deleted objects' tombstones
/// included; after `delete.retention.ms` the tombstones are gone, and reading from the first
/// offset gives exactly the live objects. A restart then resumes from the compacted
/// checkpoint: every object unchanged, nothing published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_and_checkpoint_topics_compact_to_exactly_the_live_objects() {
    let topics = Topics::of("compaction");
    let brokers = topics.brokers.clone();
    let (state, checkpoints) = (topics.topic("state"), topics.topic("checkpoints"));
    Kafka::shared().create_topic_with(&state, 1, &COMPACTED_FAST);
    Kafka::shared().create_topic_with(&checkpoints, 1, &COMPACTED_FAST);
    let api = ApiServer::start().await;
    for i in 0..20 {
        api.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    let cfg = || {
        topics
            .config()
            .grace_period("10s")
            .configmaps()
            .sink(topics.sink(
                "state",
                json!({"mode": "state", "topic": state, "create_topics": null}),
            ))
            .route("configmap", &["state"])
            .build()
    };
    let live = || -> HashMap<String, String> {
        api.objects("v1", "ConfigMap")
            .into_iter()
            .map(|(k, (_, rv))| (k, rv))
            .collect()
    };
    // What the state topic and the checkpoint topic say, folded: key -> resourceVersion.
    let folded = async |topic: &str| -> HashMap<String, String> {
        let mut out = HashMap::new();
        for r in read_topic(&brokers, topic).await {
            let key = String::from_utf8(r.key).unwrap();
            let key = if topic == checkpoints {
                serde_json::from_str::<(String, String)>(&key).unwrap().1
            } else {
                key
            };
            if key == CLUSTER_KEY {
                continue; // the cluster the checkpoint belongs to, not an object
            }
            match r.value {
                None => out.remove(&key),
                Some(v) => {
                    let v: Value = serde_json::from_slice(&v).unwrap();
                    // An intent (handed over, not yet acknowledged) is not the live state.
                    let rv = if topic == checkpoints {
                        let pending = if v.get("pending").is_some() { "?" } else { "" };
                        format!("{}{pending}", v["resourceVersion"].as_str().unwrap())
                    } else {
                        v["metadata"]["resourceVersion"]
                            .as_str()
                            .unwrap()
                            .to_owned()
                    };
                    out.insert(key, rv)
                }
            };
        }
        out
    };
    let patience = Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(200));
    let first = RunningApp::start(cfg(), &api).await;
    first.synced().await;
    for v in 2..=4 {
        for i in 0..20 {
            api.update(typed(&configmap(
                "ns",
                &format!("cm-{i:02}"),
                &v.to_string(),
            )));
        }
    }
    for i in 0..5 {
        api.delete("v1", "ConfigMap", "ns", &format!("cm-{i:02}"));
    }
    let both_live = async || {
        let held = wait::within(patience, async || {
            folded(&state).await == live() && folded(&checkpoints).await == live()
        })
        .await;
        if !held {
            assert_eq!(folded(&state).await, live(), "the state topic");
            assert_eq!(folded(&checkpoints).await, live(), "the checkpoint topic");
        }
    };
    both_live().await;
    // One more object, later than `segment.ms`: its records roll both topics to a new
    // active segment, so that every earlier record can be cleaned (the cleaner never touches
    // the active segment).
    let roll = async |name: &str| {
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.create(typed(&configmap("ns", name, "1")));
        both_live().await;
    };
    roll("late").await;
    assert_eq!(live().len(), 16);

    // Compacted: one record per key, the 5 tombstones included.
    let mut compacted = HashMap::new();
    wait::until(
        "the state topic compacted to one record per key",
        patience,
        async || {
            compacted = records_per_key(&read_topic(&brokers, &state).await);
            compacted.values().all(|(n, _)| *n == 1)
        },
    )
    .await;
    let tombstones: HashSet<&str> = compacted
        .iter()
        .filter(|(_, (_, tombstone))| *tombstone)
        .map(|(k, _)| k.as_str())
        .collect();
    let deleted: Vec<String> = (0..5).map(|i| format!("ns/cm-{i:02}")).collect();
    assert_eq!(
        tombstones,
        deleted.iter().map(String::as_str).collect(),
        "the deletes' tombstones are still there"
    );
    assert_eq!(compacted.len(), 21);

    // Then the tombstones go, at the first cleaning after `delete.retention.ms`; a cleaning
    // needs dirty records (Apache Kafka 4.3 left an idle log's expired tombstones alone for a
    // minute), so one more object rolls the topics again. Then the topic holds exactly the
    // live objects, once each.
    tokio::time::sleep(DELETE_RETENTION + Duration::from_millis(500)).await;
    roll("later").await;
    wait::until("the state topic without tombstones", patience, async || {
        let records = read_topic(&brokers, &state).await;
        records.iter().all(|r| r.value.is_some()) && records.len() == 17
    })
    .await;
    assert_eq!(folded(&state).await, live());
    // The checkpoint topic too; only the last object, written after the roll, may still
    // have its intent beside its entry in the active segment.
    let checkpoint_compacted = async || {
        let per_key = records_per_key(&read_topic(&brokers, &checkpoints).await);
        // The live objects and the cluster's record.
        per_key.len() == 17 + 1
            && per_key.iter().all(|(k, (n, tombstone))| {
                !tombstone && (*n == 1 || (k.contains("ns/later") && *n == 2))
            })
    };
    wait::until(
        "the checkpoint topic compacted",
        patience,
        checkpoint_compacted,
    )
    .await;
    assert_eq!(folded(&checkpoints).await, live());
    assert!(first.stop().await.undelivered.is_empty());

    // A restart resumes from the compacted checkpoint: all 17 unchanged, nothing published.
    let second = RunningApp::start(cfg(), &api).await;
    second.synced().await;
    wait::until("17 objects compared", PATIENCE, async || {
        second.unchanged_on_resume("configmap/state") == 17
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let published: u64 = ["added", "updated", "deleted"]
        .iter()
        .map(|t| {
            second
                .metrics
                .sink_published
                .with_label_values(&["state", "configmap", t])
                .get()
        })
        .sum();
    assert_eq!(published, 0, "nothing changed while down");
    assert!(second.stop().await.undelivered.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_patches_and_oversized_objects_on_a_1_mb_topic() {
    let topics = Topics::of("filters");
    let dead_letters = topics.topic("deadletter");
    Kafka::shared().create_topic(&dead_letters, 1);
    let api = ApiServer::start().await;
    api.create(typed(&configmap("ns", "small", "1")));
    api.create(typed(&configmap("ns", "skipped", "1")));
    api.create(typed(&configmap("kube-system", "excluded", "1")));
    // 3 MB: only a reference fits the 1 MB limit.
    api.create(typed(&configmap_with_data(
        "ns",
        "huge",
        [("v", "h".repeat(3_000_000))],
    )));
    // 600 KB objects: their updates fit without oldObject, or without oldObject and patch.
    api.create(typed(&configmap_with_data(
        "ns",
        "big-edit",
        [("v", "e".repeat(600_000))],
    )));
    api.create(typed(&configmap_with_data(
        "ns",
        "big-replace",
        [("v", "r".repeat(600_000))],
    )));
    // Even its reference (labels stay) is over 1 MB: dead-lettered.
    let labels = (0..20_000).map(|i| (format!("label-{i:05}"), "x".repeat(60)));
    api.create(typed(
        &named::<ConfigMap>(Some("ns"), "labels").labels(labels),
    ));
    let mut main = topics.sink(
        "kafka",
        json!({"properties": {"message.max.bytes": "1000000"}}),
    );
    main["dead_letter"] = json!("dlq");
    let dlq = topics.sink("dlq", json!({"topic": dead_letters, "create_topics": null}));
    let mut cfg = topics
        .config()
        .grace_period("10s")
        .configmaps()
        .sink(main)
        .sink(dlq)
        .route("configmap", &["kafka"])
        .build();
    cfg.resources[0].filter = Some(
        "object.metadata.name != 'skipped' \
         && !(has(object.metadata.labels) && has(object.metadata.labels.hidden))"
            .into(),
    );
    cfg.resources[0].exclude_namespaces = vec!["kube-system".into()];
    cfg.resources[0].ignore_fields = vec![
        "/metadata/annotations".into(),
        "/metadata/resourceVersion".into(),
    ];
    cfg.message.diff = kube_event_bridge::config::DiffMode::Patch;
    let running = RunningApp::start(cfg, &api).await;
    running.synced().await;
    api.update(typed(&configmap("ns", "small", "2")));
    let touched = configmap("ns", "small", "2").annotation("touched", "1");
    api.update(typed(&touched)); // annotations only: suppressed
    let hidden = touched.label("hidden", "yes");
    api.update(typed(&hidden)); // leaves the filter
    api.update(typed(&configmap("ns", "skipped", "2")));
    api.update(typed(&configmap("kube-system", "excluded", "2")));
    api.update(typed(&configmap_with_data(
        "ns",
        "big-edit",
        [("v", "e".repeat(600_000)), ("w", "w".repeat(10))],
    )));
    api.update(typed(&configmap_with_data(
        "ns",
        "big-replace",
        [("v", "R".repeat(600_000))],
    )));
    let dead = consume_async(topics.brokers.clone(), &dead_letters, 1).await;
    let record = dead[0].json();
    assert_eq!(record["key"], "ns/labels");
    assert_eq!(record["reason"], "too_large");
    let records = consume_async(topics.brokers.clone(), &topics.events(), 8).await;
    let events = check_events(&records);
    let by =
        |name: &str| -> Vec<&Value> { events.iter().filter(|e| e["k8sname"] == name).collect() };
    assert!(by("skipped").is_empty() && by("labels").is_empty() && by("excluded").is_empty());
    let small = by("small");
    assert_eq!(small.len(), 3);
    assert_eq!(small[2]["k8sfilteredout"], true);
    assert_eq!(
        small[2]["data"]["object"]["metadata"]["labels"]["hidden"],
        "yes"
    );
    let patch: json_patch::Patch =
        serde_json::from_value(small[1]["data"]["patch"].clone()).unwrap();
    let mut old = small[1]["data"]["oldObject"].clone();
    json_patch::patch(&mut old, &patch).unwrap();
    assert_eq!(old, small[1]["data"]["object"]);
    let huge = by("huge");
    assert_eq!(huge.len(), 1);
    assert_eq!(huge[0]["k8struncated"], true);
    assert_eq!(huge[0]["data"]["object"]["metadata"]["name"], "huge");
    assert!(
        huge[0]["data"]["object"].get("data").is_none(),
        "a reference"
    );
    let edit = by("big-edit");
    assert!(edit[0].get("k8struncated").is_none(), "600 KB fits whole");
    assert!(edit[1]["data"].get("oldObject").is_none(), "dropped first");
    let ops = edit[1]["data"]["patch"].as_array().unwrap();
    assert!(ops.contains(&json!({"op": "add", "path": "/data/w", "value": "wwwwwwwwww"})));
    assert_eq!(ops.len(), 2, "and the resourceVersion: {ops:?}");
    let replace = by("big-replace");
    assert!(
        replace[1]["data"].get("oldObject").is_none() && replace[1]["data"].get("patch").is_none()
    );
    assert_eq!(
        replace[1]["data"]["object"]["data"]["v"]
            .as_str()
            .unwrap()
            .len(),
        600_000
    );
    let m = &running.metrics;
    assert_eq!(support::degraded(m, "kafka"), [1, 1, 1, 1]);
    let failed = m
        .sink_failed
        .with_label_values(&["kafka", "configmap", "too_large"])
        .get();
    assert_eq!(failed, 1);
    let filtered = ["filter", "suppressed"].map(|reason| {
        m.filtered
            .with_label_values(&["configmap", "kafka", reason])
    });
    // Stopped first: a filter evaluates objects on lanes of their own, so what was filtered
    // is counted for certain once the lanes ran out (at shutdown).
    running.stop().await;
    assert_eq!(
        filtered.map(|c| c.get()),
        [2, 1],
        "kube-system is left out by the API server (a field selector), not counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_during_load_loses_nothing() {
    // librdkafka's mock cluster: a broker that can be taken down and brought back.
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    mock.create_topic(TOPIC, 3, 1).unwrap();
    // The mock cluster answers no admin requests: the checkpoint topic exists beforehand.
    mock.create_topic("kube-event-bridge.checkpoints", 1, 1)
        .unwrap();
    let brokers = mock.bootstrap_servers();
    let api = Arc::new(ApiServer::start().await);
    api.create(typed(&configmap("ns", "marker", "1")));
    let sink = kafka_sink(
        "kafka",
        &brokers,
        json!({"create_topics": null, "delivery_timeout": "1s"}),
    );
    let cfg = ConfigBuilder::new()
        .grace_period("10s")
        .configmaps()
        .sink(sink)
        .route("configmap", &["kafka"])
        .build();
    let running = RunningApp::start(cfg, &api).await;
    running.synced().await;
    let writer = support::spawn_creates_and_updates(&api, 150, 10);
    let failed = || running.outage_failures("kafka");
    tokio::time::sleep(Duration::from_millis(100)).await;
    mock.broker_down(1).unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await; // longer than the delivery timeout
    // Down until a delivery failed (on a loaded machine the first ones may come late).
    wait::until(
        "a delivery to fail during the outage",
        Patience::of(Duration::from_secs(30)).polling(Duration::from_millis(100)),
        async || failed() > 0,
    )
    .await;
    mock.broker_up(1).unwrap();
    writer.await.unwrap();
    // Retries may store some twice: read until 301 distinct ids are in.
    let records = tokio::task::spawn_blocking(move || {
        support::kafka::consume_until(&brokers, TOPIC, "301 distinct ids", |records| {
            records
                .iter()
                .map(|r| r.json()["id"].as_str().unwrap_or_default().to_owned())
                .collect::<HashSet<_>>()
                .len()
                >= 301
        })
    })
    .await
    .unwrap();
    let failed = failed();
    let report = running.stop().await;
    assert!(report.undelivered.is_empty(), "{:?}", report.undelivered);
    assert!(
        failed > 0,
        "the outage made deliveries fail, and they were retried"
    );
    let ids: HashSet<String> = records
        .iter()
        .map(|r| r.json()["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        ids.len(),
        301,
        "every notification arrived (duplicates allowed: {})",
        records.len() - ids.len()
    );
    let mut per_key: HashMap<&str, Vec<u64>> = HashMap::new();
    for r in &records {
        per_key.entry(r.key.as_str()).or_default().push(
            r.json()["k8sresourceversion"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap(),
        );
    }
    for (key, rvs) in per_key {
        let mut dedup = rvs.clone();
        dedup.dedup();
        assert!(dedup.windows(2).all(|w| w[0] < w[1]), "{key}: {rvs:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_or_sasl_settings_are_clear_start_errors() {
    let brokers = Kafka::shared().brokers();
    // The start error of a sink with `extra` settings (`why` it must fail).
    let refused = async |extra: Value, why: &str| {
        let sink = kafka_settings(kafka_sink("kafka", &brokers, extra));
        KafkaSink::connect("kafka", &sink)
            .await
            .err()
            .expect(why)
            .to_string()
    };
    let err = refused(
        json!({"tls": {"ca_file": "/nonexistent/ca.pem"}}),
        "a missing CA file fails",
    )
    .await;
    assert!(
        err.contains("/nonexistent/ca.pem") || err.contains("ssl.ca.location"),
        "{err}"
    );
    // SAFETY: no other test in this binary reads this variable.
    unsafe { std::env::set_var("KEB_TEST_KAFKA_PASSWORD", "hunter2") };
    let err = refused(
        json!({"sasl": {"mechanism": "SCRAM-SHA-512", "username": "bridge", "password": {"env": "KEB_TEST_KAFKA_PASSWORD"}}}),
        "SASL against a broker without SASL fails",
    )
    .await;
    assert!(err.contains(&brokers), "{err}");
    assert!(!err.contains("hunter2"), "secrets never appear in errors");
    let err = refused(
        json!({"sasl": {"mechanism": "PLAIN", "username": "bridge", "password": {"env": "KEB_TEST_UNSET_VAR"}}}),
        "a password from an unset variable fails",
    )
    .await;
    assert!(
        err.contains("sasl.password") && err.contains("KEB_TEST_UNSET_VAR"),
        "{err}"
    );
}

/// Resume with the default settings: a restart publishes on the events topic exactly what
/// changed while the bridge was down (every delete included), the state topic ends equal to
/// the API server's objects, and unchanged objects publish nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_checkpoint_topic() {
    let topics = Topics::of("resume");
    let brokers = topics.brokers.clone();
    let api = ApiServer::start().await;
    for i in 0..60 {
        api.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    let cfg = || {
        topics
            .config()
            .grace_period("10s")
            .configmaps()
            .sink(topics.sink("kafka", json!({})))
            .sink(topics.sink(
                "state",
                json!({"mode": "state", "topic": topics.topic("state")}),
            ))
            .route("configmap", &["kafka", "state"])
            .build()
    };
    let published = |app: &RunningApp, sink: &str| -> u64 {
        ["added", "updated", "deleted", "synced"]
            .iter()
            .map(|t| {
                app.metrics
                    .sink_published
                    .with_label_values(&[sink, "configmap", t])
                    .get()
            })
            .sum()
    };
    let first = RunningApp::start(cfg(), &api).await;
    first.synced().await;
    wait::until("60 published to both", PATIENCE, async || {
        published(&first, "kafka") == 60 && published(&first, "state") == 60
    })
    .await;
    assert!(first.stop().await.undelivered.is_empty());

    // While down: 5 deletes, 5 updates, 5 creates, 2 deleted and recreated.
    let mut want = support::change_while_down(&api, 0..5, 5..10, 60..65, 10..12);
    // A corrupt checkpoint record: the checkpoint is incomplete, so its route waits (naming
    // the record) and publishes nothing until a tombstone for that key mends it; then that
    // object is unknown to the checkpoint (published as added).
    let write_checkpoint_record = |payload: Option<&str>| {
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
        let producer: BaseProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .unwrap();
        let checkpoints = topics.topic("checkpoints");
        let mut record: BaseRecord<str, str> =
            BaseRecord::to(&checkpoints).key(r#"["configmap/kafka","ns/cm-30"]"#);
        if let Some(p) = payload {
            record = record.payload(p);
        }
        producer.send(record).unwrap();
        producer.flush(Duration::from_secs(10)).unwrap();
    };
    write_checkpoint_record(Some("not json"));
    want.insert("ns/cm-30".into(), vec!["added"]);
    let expected: usize = want.values().map(Vec::len).sum();

    let second = RunningApp::start(cfg(), &api).await;
    second.synced().await;
    let admin = second.admin;
    wait::until("readyz names the corrupt record", PATIENCE, async || {
        let (_, body) = support::http_get(admin, "/readyz").await;
        body.contains("configmap/kafka") && body.contains("ns/cm-30") && body.contains("corrupt")
    })
    .await;
    assert_eq!(
        published(&second, "kafka"),
        0,
        "the waiting route publishes nothing"
    );
    write_checkpoint_record(None);
    wait::until("the changes published to both", PATIENCE, async || {
        published(&second, "kafka") as usize >= expected
            && published(&second, "state") as usize >= expected - 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let unchanged = second.unchanged_on_resume("configmap/kafka");
    assert_eq!(
        (published(&second, "kafka") as usize, unchanged),
        (expected, 60 - 13),
        "exactly the changes (and the object whose record was corrupt); the 47 unchanged \
         objects publish nothing"
    );
    assert!(second.stop().await.undelivered.is_empty());

    let records = consume_async(brokers.clone(), &topics.events(), 60 + expected).await;
    let events: Vec<Value> = records.iter().map(Record::json).collect();
    events.iter().for_each(support::schema::check_cloudevent);
    // The only id published twice: the object whose checkpoint record was corrupt, re-sent
    // as it was (same id, so consumers drop it).
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for e in &events {
        *seen.entry(e["id"].as_str().unwrap()).or_default() += 1;
    }
    let repeated: Vec<&str> = events
        .iter()
        .filter(|e| seen[e["id"].as_str().unwrap()] > 1)
        .map(|e| e["subject"].as_str().unwrap())
        .collect();
    assert_eq!(repeated, ["ns/cm-30", "ns/cm-30"]);
    let got = support::resumed_types(&events);
    assert_eq!(
        got, want,
        "every change made while down, in order per object"
    );

    // The state topic, replayed from offset 0, equals the API server's objects.
    // The corrupt record was the events route's: the state route had nothing to redo.
    let state = consume_async(brokers.clone(), &topics.topic("state"), 60 + expected - 1).await;
    let mut folded: HashMap<String, String> = HashMap::new();
    for r in &state {
        match &r.value {
            Some(_) => {
                let rv = r.json()["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                folded.insert(r.key.clone(), rv)
            }
            None => folded.remove(&r.key),
        };
    }
    let mut live: HashMap<String, String> = HashMap::new();
    for i in 0..65 {
        if let Some(o) = api.get("v1", "ConfigMap", "ns", &format!("cm-{i:02}")) {
            live.insert(
                format!("ns/cm-{i:02}"),
                o["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    assert_eq!(
        folded, live,
        "the state topic matches the cluster after the restart"
    );
}

/// `kube-event-bridge state` (the real binary) rebuilds a state topic into exactly the
/// objects the API server holds, and `--check` reports what changed behind the bridge's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_command_rebuilds_the_topic_and_checks_it_against_the_cluster() {
    let topics = Topics::of("state-command");
    let api = ApiServer::start().await;
    for i in 0..12 {
        api.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    let state_sink = topics.sink(
        "state",
        json!({"mode": "state", "topic": "state.{cluster}.{resource}"}),
    );
    let cfg_value = topics
        .config()
        .configmaps()
        .sink(state_sink)
        .route("configmap", &["state"])
        .value();
    let running = RunningApp::start(Config::from_value(cfg_value.clone()).unwrap(), &api).await;
    running.synced().await;
    api.delete("v1", "ConfigMap", "ns", "cm-00");
    wait::until("12 records and a tombstone", PATIENCE, async || {
        ["added", "deleted"]
            .iter()
            .map(|t| {
                running
                    .metrics
                    .sink_published
                    .with_label_values(&["state", "configmap", t])
                    .get()
            })
            .sum::<u64>()
            == 13
    })
    .await;
    assert!(running.stop().await.undelivered.is_empty());

    let tools = support::tools::Tools::new(&cfg_value, Some(&api));
    let state = |args: &[&str]| tools.run("state", "state", args);
    // Blocking calls: the API server keeps the runtime's other thread for --check.
    let (code, stdout, stderr) = state(&["--output", "json"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_quiet(&stderr);
    let objects: Vec<Value> = serde_json::from_str(&stdout).unwrap();
    let mut names: Vec<&str> = objects
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap())
        .collect();
    names.sort();
    let want: Vec<String> = (1..12).map(|i| format!("cm-{i:02}")).collect();
    assert_eq!(names, want, "the tombstone dropped cm-00");

    // Behind the bridge's back (it is stopped): one delete, one update.
    api.delete("v1", "ConfigMap", "ns", "cm-05");
    api.update(typed(&configmap("ns", "cm-07", "2")));
    let (code, stdout, stderr) = state(&["--check"]);
    assert_eq!(code, Some(3), "differences exit 3: {stdout}{stderr}");
    assert!(
        stdout.contains("NAMESPACE") && stdout.contains("cm-01"),
        "{stdout}"
    );
    assert!(
        stdout.contains("2 difference(s) with the cluster"),
        "{stdout}"
    );
    assert!(
        stdout.contains("GONE    ns/cm-05: on state.state-command.configmaps"),
        "{stdout}"
    );
    assert!(
        stdout.contains("STALE   ns/cm-07: on state.state-command.configmaps"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_prints_exactly_what_the_topic_receives_from_the_beginning_or_from_now() {
    let topics = Topics::of("tail");
    let brokers = topics.brokers.clone();
    let api = ApiServer::start().await;
    for i in 0..40 {
        let cm = configmap(
            if i % 2 == 0 { "ns" } else { "other" },
            &format!("cm-{i:02}"),
            "1",
        )
        .label("team", &format!("t{}", i % 4));
        api.create(typed(&cm));
    }
    let cfg_value = topics
        .config()
        .configmaps()
        .sink(topics.sink("kafka", json!({"encoding": "binary"})))
        .route("configmap", &["kafka"])
        .value();
    let running = RunningApp::start(Config::from_value(cfg_value.clone()).unwrap(), &api).await;
    running.synced().await;
    let published = |n: u64| {
        let metrics = running.metrics.clone();
        async move {
            wait::until(format!("{n} published"), PATIENCE, async || {
                ["added", "updated", "deleted"]
                    .iter()
                    .map(|t| {
                        metrics
                            .sink_published
                            .with_label_values(&["kafka", "configmap", t])
                            .get()
                    })
                    .sum::<u64>()
                    == n
            })
            .await
        }
    };
    published(40).await;
    let tools = support::tools::Tools::new(&cfg_value, None);
    let mut from_now = tools.tail("kafka", &["--output", "json"]);
    let mut all = tools.tail("kafka", &["--output", "json", "--from-beginning"]);
    from_now.ready().await;
    all.ready().await;
    for i in 0..10 {
        api.update(typed(&configmap("ns", &format!("cm-{:02}", i * 2), "2")));
    }
    for i in 30..35 {
        api.delete(
            "v1",
            "ConfigMap",
            if i % 2 == 0 { "ns" } else { "other" },
            &format!("cm-{i:02}"),
        );
    }
    published(55).await;
    from_now.printed(15).await;
    all.printed(55).await;
    // Nothing more comes: give a late extra line the time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(running.stop().await.undelivered.is_empty());

    // What the topic holds, read directly.
    let records = consume_async(brokers.clone(), &topics.events(), 55).await;
    let on_topic: Vec<Value> = check_events(&records);
    let (code, lines, stderr) = all.interrupt();
    assert_eq!(code, Some(0), "Ctrl-C stops cleanly: {stderr}");
    assert_quiet(&stderr);
    let printed = support::tools::events(&lines);
    assert_eq!(
        support::sorted_ids(&printed),
        support::sorted_ids(&on_topic),
        "--from-beginning: every message, once"
    );
    assert_eq!(
        printed
            .iter()
            .map(|e| e["data"].clone())
            .collect::<HashSet<_>>()
            .len(),
        55,
        "binary records mapped back with their data"
    );
    let (code, lines, stderr) = from_now.interrupt();
    assert_eq!(code, Some(0), "{stderr}");
    assert_quiet(&stderr);
    let printed = support::tools::events(&lines);
    let newer: Vec<Value> = on_topic
        .iter()
        .filter(|e| !e["type"].as_str().unwrap().ends_with(".added"))
        .cloned()
        .collect();
    assert_eq!(
        support::sorted_ids(&printed),
        support::sorted_ids(&newer),
        "from now: only what came after the start"
    );

    // Filters, --count, and the lines for people.
    let (code, out, err) = tools.run(
        "tail",
        "kafka",
        &[
            "--from-beginning",
            "--type",
            "deleted",
            "--namespace",
            "ns",
            "--count",
            "2",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    for l in &lines {
        let fields: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(fields[1..3], ["deleted", "ConfigMap"], "{l}");
        assert!(fields[3].starts_with("ns/cm-3"), "{l}");
        assert!(fields[0].parse::<jiff::Timestamp>().is_ok(), "{l}");
        assert!(
            !l.contains('\x1b'),
            "no colors when stdout is not a terminal"
        );
    }
    let (code, out, err) = tools.run(
        "tail",
        "kafka",
        &[
            "--from-beginning",
            "-l",
            "team in (t1,t3),team!=t3",
            "--type",
            "added",
            "--count",
            "10",
            "-o",
            "json",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let teams: HashSet<String> = out
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["data"]["object"]["metadata"]["labels"]["team"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(teams, HashSet::from(["t1".to_owned()]));
    assert_eq!(out.lines().count(), 10);
    let (code, _, err) = tools.run("tail", "kafka", &["--subject", "x"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--topic"), "{err}");
}

/// ConfigMap `ns/a`, created in `api`, exported to `TOPIC` on a one-broker mock cluster by the
/// service (shutdown grace `grace`, the config adjusted by `adjust`); returns once its add is
/// on the topic: the cluster (for injecting errors), its bootstrap servers and the service.
async fn one_object_on_a_mock_cluster(
    api: &ApiServer,
    grace: &str,
    adjust: impl FnOnce(&mut kube_event_bridge::config::Config),
) -> (
    rdkafka::mocking::MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    String,
    RunningApp,
) {
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    mock.create_topic(TOPIC, 1, 1).unwrap();
    let brokers = mock.bootstrap_servers();
    api.create(typed(&configmap("ns", "a", "1")));
    let mut cfg = ConfigBuilder::new()
        .grace_period(grace)
        .configmaps()
        .sink(kafka_sink(
            "kafka",
            &brokers,
            json!({"create_topics": null}),
        ))
        .route("configmap", &["kafka"])
        .build();
    adjust(&mut cfg);
    let running = RunningApp::start(cfg, api).await;
    running.synced().await;
    consume_async(brokers.clone(), TOPIC, 1).await;
    (mock, brokers, running)
}

/// A message the broker refuses as too large (after the hand-over) goes again trimmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_broker_refuses_as_too_large_goes_again_trimmed() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let api = ApiServer::start().await;
    let (mock, brokers, running) = one_object_on_a_mock_cluster(&api, "10s", |cfg| {
        cfg.message.diff = kube_event_bridge::config::DiffMode::Patch;
    })
    .await;
    // The broker refuses the next two produce requests as too large (a topic whose
    // max.message.bytes is below the producer's message.max.bytes): the update goes again
    // without oldObject, then without its patch.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE; 2],
    );
    api.update(typed(&configmap("ns", "a", "2")));
    let records = consume_async(brokers.clone(), TOPIC, 2).await;
    let update = records[1].json();
    assert_eq!(update["type"], "io.github.kube-event-bridge.object.updated");
    assert!(update.get("k8struncated").is_none());
    assert!(update["data"].get("oldObject").is_none() && update["data"].get("patch").is_none());
    assert_eq!(
        update["data"]["object"]["data"]["v"], "2",
        "the object itself fits"
    );
    let m = &running.metrics;
    assert_eq!(support::degraded(m, "kafka"), [0, 1, 0, 0]);
    running.stop().await;
}

/// Delivery under injected produce errors (librdkafka's mock cluster): one message of a key is
/// in flight at a time; when reports fail, the failed notification and the later ones of its
/// key go back, in order, and are re-sent. Every notification arrives (re-sends keep their
/// ids), and the last message of each key is its newest state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_reports_of_pipelined_messages_are_retried_and_the_newest_state_comes_last() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    mock.create_topic(TOPIC, 1, 1).unwrap();
    mock.create_topic("kube-event-bridge.checkpoints", 1, 1)
        .unwrap();
    let brokers = mock.bootstrap_servers();
    let api = Arc::new(ApiServer::start().await);
    for k in 0..5 {
        api.create(typed(&configmap("ns", &format!("hot-{k}"), "0")));
    }
    let sink = kafka_sink(
        "kafka",
        &brokers,
        json!({"create_topics": null, "delivery_timeout": "1s"}),
    );
    let cfg = ConfigBuilder::new()
        .grace_period("10s")
        .configmaps()
        .sink(sink)
        .route("configmap", &["kafka"])
        .build();
    let running = RunningApp::start(cfg, &api).await;
    running.synced().await;
    consume_async(brokers.clone(), TOPIC, 5).await;
    // Every produce request fails for a while: librdkafka retries inside, then reports the
    // messages as failed after the delivery timeout; the bridge re-sends them.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 40],
    );
    for v in 1..=30 {
        for k in 0..5 {
            api.update(typed(&configmap("ns", &format!("hot-{k}"), &v.to_string())));
        }
    }
    let published = || {
        running
            .metrics
            .sink_published
            .with_label_values(&["kafka", "configmap", "updated"])
            .get()
    };
    wait::until("150 updates acknowledged", PATIENCE, async || {
        published() >= 150
    })
    .await;
    let failed = running.outage_failures("kafka");
    let report = running.stop().await;
    assert!(report.undelivered.is_empty(), "{:?}", report.undelivered);
    assert!(failed > 0, "the injected errors made reports fail");
    // Read everything on the topic (re-sends included) until quiet.
    let records = tokio::task::spawn_blocking({
        let brokers = brokers.clone();
        move || {
            let mut all = Vec::new();
            kube_event_bridge::sinks::kafka::reader::read_to_end(
                &rdkafka::ClientConfig::new()
                    .set("bootstrap.servers", &brokers)
                    .clone(),
                &[TOPIC.to_owned()],
                |r| all.push(r),
            )
            .unwrap();
            all
        }
    })
    .await
    .unwrap();
    let mut ids = HashSet::new();
    let mut last: HashMap<String, u64> = HashMap::new();
    let mut newest: HashMap<String, u64> = HashMap::new();
    for r in &records {
        let e: Value = serde_json::from_slice(r.value.as_ref().unwrap()).unwrap();
        ids.insert(e["id"].as_str().unwrap().to_owned());
        let key = String::from_utf8(r.key.clone()).unwrap();
        let rv: u64 = e["k8sresourceversion"].as_str().unwrap().parse().unwrap();
        last.insert(key.clone(), rv);
        let n = newest.entry(key).or_default();
        *n = (*n).max(rv);
    }
    assert_eq!(ids.len(), 155, "every notification arrived at least once");
    assert_eq!(
        last, newest,
        "the last message of each key is its newest state"
    );
    println!(
        "{} records for 155 notifications ({} re-sent), {failed} failed reports",
        records.len(),
        records.len() - 155
    );
}

/// A fatal error of librdkafka's idempotent producer (here an out-of-order sequence the
/// broker reports, which the producer cannot recover from) stops it for good: `/readyz` and
/// `/healthz` turn 503 naming the cause, and the message stays with its route (retried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_producer_error_fails_readiness_naming_it() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let api = ApiServer::start().await;
    // A short grace period: the held update never drains.
    let (mock, _, running) = one_object_on_a_mock_cluster(&api, "1s", |_| {}).await;
    let (code, _) = support::http_get(running.admin, "/readyz").await;
    assert_eq!(code, 200);
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER; 5],
    );
    api.update(typed(&configmap("ns", "a", "2")));
    let patience = wait::Patience::of(Duration::from_secs(30)).polling(Duration::from_millis(200));
    let mut body = String::new();
    let failed = wait::within(patience, async || {
        let (code, b) = support::http_get(running.admin, "/readyz").await;
        body = b;
        code == 503
    })
    .await;
    assert!(failed, "readiness stayed green: {body}");
    assert!(
        body.contains("sink kafka") && body.contains("failed for good"),
        "{body}"
    );
    // Liveness too: the pod is restarted (and resumes) rather than holding the lease while
    // publishing nothing.
    let (code, body) = support::http_get(running.admin, "/healthz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("failed for good"), "{body}");
    // The update is held (retried), not settled.
    assert!(
        running
            .metrics
            .sink_published
            .with_label_values(&["kafka", "configmap", "updated"])
            .get()
            == 0
    );
    running.stop().await;
}

/// A checkpoint read ends while other producers keep writing the topic, as the owners of
/// other shards do: two transactional producers commit (and now and then abort) batches on
/// every partition all along, holding a transaction open most of the time, and an idempotent
/// one writes without a pause. The read ends, and it holds every record acknowledged before
/// it began and none that was aborted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_ends_while_other_producers_keep_committing() {
    use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
    use std::sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    };
    let topics = Topics::of("busy-read");
    let topic = topics.topic("checkpoints");
    Kafka::shared().create_topic(&topic, 3);
    let committed: Arc<Mutex<HashSet<String>>> = Arc::default();
    let aborted: Arc<Mutex<HashSet<String>>> = Arc::default();
    let (stop, half) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let (brokers, topic) = (topics.brokers.clone(), topic.clone());
            let (committed, aborted) = (committed.clone(), aborted.clone());
            let (stop, half) = (stop.clone(), half.clone());
            // Writer 2 is idempotent, without transactions or pauses.
            let transactional = w < 2;
            std::thread::spawn(move || {
                let mut config = rdkafka::ClientConfig::new();
                config.set("bootstrap.servers", &brokers);
                if transactional {
                    config.set("transactional.id", format!("busy-read-{w}"));
                } else {
                    config
                        .set("enable.idempotence", "true")
                        .set("linger.ms", "0");
                }
                let p: ThreadedProducer<_> = config.create().unwrap();
                if transactional {
                    p.init_transactions(Duration::from_secs(30)).unwrap();
                }
                let mut n = 0u64;
                // The transactional writers stop half way: the idempotent one alone never
                // leaves the end of a partition still for long.
                let done = || {
                    stop.load(Ordering::Relaxed) || (transactional && half.load(Ordering::Relaxed))
                };
                while !done() {
                    if !transactional {
                        let keys: Vec<_> = (n..n + 10).map(|n| format!("w{w}-{n}")).collect();
                        n += 10;
                        for key in &keys {
                            p.send(BaseRecord::to(&topic).key(key).payload("x"))
                                .map_err(|(e, _)| e)
                                .unwrap();
                        }
                        p.flush(Duration::from_secs(30)).unwrap();
                        committed.lock().unwrap().extend(keys);
                        continue;
                    }
                    p.begin_transaction().unwrap();
                    let mut keys = Vec::new();
                    for _ in 0..30 {
                        let key = format!("w{w}-{n}");
                        n += 1;
                        p.send(BaseRecord::to(&topic).key(&key).payload("x"))
                            .map_err(|(e, _)| e)
                            .unwrap();
                        keys.push(key);
                    }
                    // Held open a while, as a shard's transaction is.
                    std::thread::sleep(Duration::from_millis(40));
                    p.flush(Duration::from_secs(30)).unwrap();
                    if n.is_multiple_of(7) {
                        p.abort_transaction(Duration::from_secs(30)).unwrap();
                        aborted.lock().unwrap().extend(keys);
                    } else {
                        p.commit_transaction(Duration::from_secs(30)).unwrap();
                        committed.lock().unwrap().extend(keys);
                    }
                }
            })
        })
        .collect();
    wait::until("the writers committed", PATIENCE, async || {
        committed.lock().unwrap().len() > 300
    })
    .await;
    for round in 0..6 {
        if round == 3 {
            half.store(true, Ordering::Relaxed);
        }
        let before = committed.lock().unwrap().clone();
        let (brokers, topic) = (topics.brokers.clone(), topic.clone());
        let read = tokio::time::timeout(
            Duration::from_secs(90),
            tokio::task::spawn_blocking(move || {
                let mut keys = HashSet::new();
                kube_event_bridge::sinks::kafka::reader::read_to_end(
                    rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers),
                    &[topic],
                    |r| {
                        keys.insert(String::from_utf8(r.key).unwrap());
                    },
                )
                .map(|()| keys)
            }),
        )
        .await
        .expect("the read ended while the writers went on")
        .unwrap()
        .unwrap();
        let missing: Vec<_> = before.difference(&read).collect();
        assert!(
            missing.is_empty(),
            "committed before the read began: {missing:?}"
        );
        let phantom: Vec<_> = aborted
            .lock()
            .unwrap()
            .intersection(&read)
            .cloned()
            .collect();
        assert!(phantom.is_empty(), "aborted records read: {phantom:?}");
        println!(
            "read {} keys ({} committed before the read)",
            read.len(),
            before.len()
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
}

/// Item 5 of the sharding issue: each shard's term publishes with a producer of its own, so a
/// hand-over of one shard (its queue purged) fails none of another shard's records. Records
/// linger in librdkafka's queue for 2 s here, so a purge would catch every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_of_one_shard_purges_none_of_another_shards_records() {
    use kube_event_bridge::{shard::Shard, sinks::Sink};
    let topics = Topics::of("shard-lanes");
    Kafka::shared().create_topic(&topics.events(), 1);
    let cfg = kafka_settings(topics.sink("kafka", json!({"properties": {"linger.ms": "2000"}})));
    let sink = Arc::new(KafkaSink::connect("kafka", &cfg).await.unwrap());
    let shards = [0, 1].map(|index| Shard { index, count: 2 });
    let [a, b] = shards.map(|shard| sink.clone().shard_view(shard).expect("a view per shard"));
    // No term yet: nothing goes out.
    let m = |name: &str| support::message(topics.name, name, "{}");
    let err = a
        .submit(&m("early"))
        .await
        .err()
        .expect("no term, no producer");
    assert!(
        err.to_string().contains("0-of-2") && err.is_retriable(),
        "{err}"
    );
    a.begin_term(shards[0], None).await.unwrap();
    b.begin_term(shards[1], None).await.unwrap();
    let mut acks_a = Vec::new();
    for i in 0..50 {
        acks_a.push(a.submit(&m(&format!("a-{i}"))).await.unwrap());
    }
    let mut acks_b = Vec::new();
    for i in 0..5 {
        acks_b.push(b.submit(&m(&format!("b-{i}"))).await.unwrap());
    }
    // Shard 1 is handed on undrained: its queue goes, and only its.
    b.abandon_queued();
    b.end_term(shards[1]);
    assert_eq!((a.abandoned(), b.abandoned()), (0, 1));
    for ack in acks_b {
        assert!(ack.await.is_err(), "shard 1's queued records are purged");
    }
    for ack in acks_a {
        ack.await.expect("shard 0's records are delivered");
    }
    let keys: HashSet<String> = consume_async(topics.brokers.clone(), &topics.events(), 50)
        .await
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(keys.len(), 50);
    assert!(keys.iter().all(|k| k.starts_with("ns/a-")), "{keys:?}");
    // Shard 1 again: a fresh producer for the new term.
    b.begin_term(shards[1], None).await.unwrap();
    b.publish(&m("b-again")).await.unwrap();
    // The sink itself (shutdown) purges every shard's queue.
    let late = a.submit(&m("late")).await.unwrap();
    sink.abandon_queued();
    assert!(late.await.is_err());
    assert_eq!((a.abandoned(), b.abandoned()), (1, 2));
    sink.end_terms();
    assert!(
        a.submit(&m("after")).await.is_err(),
        "no term after shutdown"
    );
}
