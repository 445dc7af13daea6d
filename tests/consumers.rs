//! The consumers users already run, against what the bridge wrote to real Kafka from a real
//! kube-apiserver (and to NATS JetStream): the CloudEvents SDKs (Go's sdk-go with its Sarama and
//! NATS JetStream bindings, Java's cloudevents-kafka `CloudEventDeserializer`) read every message in binary and in structured
//! mode with each attribute of the type the CloudEvents type system gives it in that mode, and
//! the data as the bridge meant it; and the examples under `examples/` (Go, Java, Python,
//! Rust) fold the events topics and a state topic (Go: JetStream streams too) into exactly the
//! API server's objects.
//! `scripts/build-examples` builds them (`scripts/test` runs it); a missing one fails here.

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use kube::api::ApiResource;
use serde_json::{Value, json};
use support::{
    built_tool,
    cluster::Cluster,
    config::{ConfigBuilder, kafka_sink},
    kafka::{Kafka, Record, read_topic},
    parity::ready,
    replica::{Replica, dump},
    wait::{self, Patience},
};

const NS: &str = "consumers";

/// The three topics: binary mode, structured mode with `exactly_once`, and a state topic.
struct Topics {
    binary: String,
    structured: String,
    state: String,
}

/// The JetStream streams, binary and structured mode, each over subjects of its own.
const NATS_STREAMS: [(&str, &str); 2] = [
    ("CONSUMERS_BINARY", "binary"),
    ("CONSUMERS_STRUCTURED", "structured"),
];

/// The bridge watches ConfigMaps in [`NS`] and writes each change to the three topics and the
/// two JetStream streams.
/// `resync`: every object again every 2 s (`synced`).
fn bridge(
    dir: &Path,
    kafka: &Kafka,
    topics: &Topics,
    nats: &str,
    kubeconfig: &Path,
    resync: bool,
) -> Replica {
    let brokers = kafka.brokers();
    let nats_sink = |stream: &str, encoding: &str| {
        let prefix = stream.to_lowercase();
        support::config::nats_sink(
            &format!("nats-{encoding}"),
            nats,
            json!({
                "encoding": encoding,
                "subject": format!("{prefix}.{{kind}}.{{namespace}}.{{name}}"),
                "stream": {"name": stream, "create": true, "subjects": [format!("{prefix}.>")]},
            }),
        )
    };
    let config = ConfigBuilder::new()
        .cluster("consumers")
        .resource(json!({
            "api_version": "v1", "kind": "ConfigMap", "namespaces": [NS],
            "resync_period": if resync { "2s" } else { "0s" },
        }))
        .sink(kafka_sink(
            "binary",
            &brokers,
            json!({
                "topic": topics.binary,
                "encoding": "binary",
                "checkpoint_topic": format!("{}.checkpoints", topics.binary),
            }),
        ))
        .sink(kafka_sink(
            "structured",
            &brokers,
            json!({
                "topic": topics.structured,
                "exactly_once": true,
                // Long transactions: the SIGKILL below leaves one open (aborted when the
                // next producer starts), which read_committed consumers must not see.
                "transaction_interval": "2s",
                "checkpoint_topic": format!("{}.checkpoints", topics.structured),
            }),
        ))
        .sink(kafka_sink(
            "state",
            &brokers,
            json!({
                "mode": "state",
                "topic": topics.state,
                "checkpoint_topic": format!("{}.checkpoints", topics.state),
            }),
        ))
        .sink(nats_sink(NATS_STREAMS[0].0, NATS_STREAMS[0].1))
        .sink(nats_sink(NATS_STREAMS[1].0, NATS_STREAMS[1].1))
        .route(
            "configmap",
            &[
                "binary",
                "structured",
                "state",
                "nats-binary",
                "nats-structured",
            ],
        )
        .value();
    Replica::start(dir, "bridge", &config, kubeconfig)
}

fn configmap(name: &str, value: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "consumers"}},
        "data": {"value": value},
    })
}

/// The ConfigMaps API of [`NS`].
async fn configmaps(cluster: &Cluster) -> kube::Api<k8s_openapi::api::core::v1::ConfigMap> {
    kube::Api::namespaced(cluster.client().await, NS)
}

fn name(i: usize) -> String {
    format!("cm-{i:02}")
}

async fn create(
    api: &kube::Api<k8s_openapi::api::core::v1::ConfigMap>,
    range: std::ops::Range<usize>,
    value: &str,
) {
    for i in range {
        api.create(
            &Default::default(),
            &serde_json::from_value(configmap(&name(i), value)).unwrap(),
        )
        .await
        .unwrap();
    }
}

async fn update(
    api: &kube::Api<k8s_openapi::api::core::v1::ConfigMap>,
    range: std::ops::Range<usize>,
    value: &str,
) {
    for i in range {
        let mut cm = api.get(&name(i)).await.unwrap();
        cm.data = Some([("value".to_owned(), value.to_owned())].into());
        api.replace(&name(i), &Default::default(), &cm)
            .await
            .unwrap();
    }
}

async fn delete(
    api: &kube::Api<k8s_openapi::api::core::v1::ConfigMap>,
    range: std::ops::Range<usize>,
) {
    for i in range {
        api.delete(&name(i), &Default::default()).await.unwrap();
    }
}

/// What a consumer ends with, compared with the API server, in the suite's loss columns.
#[derive(Debug, Default, PartialEq, Eq)]
struct Ending {
    lost_deletes: Vec<String>,
    phantom_deletes: Vec<String>,
    stale: Vec<String>,
    missing: Vec<String>,
}

/// `state` (key → resourceVersion, as an example prints it) against `live` (key → (uid,
/// resourceVersion)); a live key the example lacks is a phantom delete if the topic holds any
/// message about it, else missing.
fn ending(
    state: &BTreeMap<String, String>,
    live: &BTreeMap<String, (String, String)>,
    seen: &BTreeSet<String>,
) -> Ending {
    let mut e = Ending::default();
    for (key, rv) in state {
        match live.get(key) {
            None => e.lost_deletes.push(key.clone()),
            Some((_, want)) if want != rv => e.stale.push(key.clone()),
            Some(_) => {}
        }
    }
    for key in live.keys().filter(|k| !state.contains_key(*k)) {
        if seen.contains(key) {
            e.phantom_deletes.push(key.clone());
        } else {
            e.missing.push(key.clone());
        }
    }
    e
}

/// The CloudEvent a record holds as the bridge meant it: each attribute's CloudEvents type
/// and value in the record's content mode, and the data.
fn meant(record: &Record) -> (BTreeMap<String, (String, String)>, Value) {
    let type_of = |name: &str, value: &Value| -> String {
        match (name, value) {
            ("source", _) => "URI-reference".into(),
            ("time", _) => "Timestamp".into(),
            (_, Value::Bool(_)) => "Boolean".into(),
            (_, Value::Number(_)) => "Integer".into(),
            _ => "String".into(),
        }
    };
    let text = |value: &Value| match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut attributes = BTreeMap::new();
    if record.header("content-type") == Some("application/cloudevents+json") {
        let event = record.json();
        for (name, value) in event.as_object().unwrap() {
            if name != "data" {
                attributes.insert(name.clone(), (type_of(name, value), text(value)));
            }
        }
        return (attributes, event["data"].clone());
    }
    // Binary mode: every attribute is a header string (a Boolean extension too).
    for (name, value) in &record.headers {
        let name = match name.as_str() {
            "content-type" => "datacontenttype",
            other => match other
                .strip_prefix("ce_")
                .or_else(|| other.strip_prefix("ce-"))
            {
                Some(n) => n,
                None => continue,
            },
        };
        let ty = type_of(name, &Value::String(value.clone()));
        attributes.insert(name.to_owned(), (ty, value.clone()));
    }
    (attributes, record.json())
}

/// The attributes every event of a namespaced object has (docs/src/message-format.md).
const REQUIRED: [&str; 16] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "k8scluster",
    "k8sgroup",
    "k8sversion",
    "k8skind",
    "k8sresource",
    "k8snamespace",
    "k8sname",
    "k8suid",
    "k8sresourceversion",
];

/// The Boolean extensions: present (true) or absent.
const FLAGS: [&str; 5] = [
    "k8sinitial",
    "k8sfinalstateunknown",
    "k8sresumed",
    "k8sfilteredout",
    "k8struncated",
];

/// What an SDK may add on its own (the Go SDK's Sarama binding: where the message was read).
const SDK_ADDITIONS: [&str; 4] = [
    "partitionkey",
    "kafkatopic",
    "kafkapartition",
    "kafkaoffset",
];

/// The CloudEvents type of attribute `name` in binary or structured mode, as the message
/// format documents it, whatever the bridge wrote: in binary mode every extension travels as
/// a header string, a Boolean one too.
fn documented_type(name: &str, binary: bool) -> Option<&'static str> {
    match name {
        "source" => Some("URI-reference"),
        "time" => Some("Timestamp"),
        n if FLAGS.contains(&n) => Some(if binary { "String" } else { "Boolean" }),
        n if REQUIRED.contains(&n) => Some("String"),
        _ => None,
    }
}

/// How the events an SDK consumer printed differ from what the bridge meant (`records`, by
/// partition and offset) and from the documented format: one line per mismatch; and the
/// attributes the SDK added on its own (only [`SDK_ADDITIONS`] are allowed).
fn mismatches(
    printed: &[Value],
    records: &BTreeMap<(i32, i64), Record>,
) -> (Vec<String>, BTreeSet<String>) {
    let mut wrong = Vec::new();
    let mut added = BTreeSet::new();
    // Every record once, nothing else (an aborted transaction's records are not in `records`).
    let offsets: Vec<(i32, i64)> = printed
        .iter()
        .map(|e| {
            (
                e["partition"].as_i64().unwrap() as i32,
                e["offset"].as_i64().unwrap(),
            )
        })
        .collect();
    let distinct: BTreeSet<_> = offsets.iter().copied().collect();
    if distinct.len() != offsets.len() {
        wrong.push(format!(
            "{} events read twice",
            offsets.len() - distinct.len()
        ));
    }
    let unread = records.keys().filter(|k| !distinct.contains(k)).count();
    if unread > 0 {
        wrong.push(format!("{unread} records not read"));
    }
    for (event, at) in printed.iter().zip(offsets) {
        let Some(record) = records.get(&at) else {
            wrong.push(format!("{at:?}: read, but no committed record there"));
            continue;
        };
        let binary = record.header("content-type") != Some("application/cloudevents+json");
        let (want, data) = meant(record);
        let got = event["attributes"].as_object().unwrap();
        let seen = |name: &str| {
            got.get(name).map(|a| {
                (
                    a["type"].as_str().unwrap().to_owned(),
                    a["value"].as_str().unwrap().to_owned(),
                )
            })
        };
        // The documented format: every required attribute, each attribute's type.
        for name in REQUIRED {
            if seen(name).is_none() {
                wrong.push(format!("{at:?} {name}: missing"));
            }
        }
        for name in got.keys() {
            let (ty, value) = seen(name).unwrap();
            match documented_type(name, binary) {
                Some(documented) if documented != ty => wrong.push(format!(
                    "{at:?} {name}: {ty} {value:?}, documented {documented}"
                )),
                Some(_) => {}
                None if SDK_ADDITIONS.contains(&name.as_str()) => {
                    added.insert(name.clone());
                }
                None => wrong.push(format!("{at:?} {name}: {ty} {value:?}, not ours")),
            }
            if FLAGS.contains(&name.as_str()) && value != "true" {
                wrong.push(format!(
                    "{at:?} {name}: {value:?} (a flag is true or absent)"
                ));
            }
        }
        for (name, documented) in [
            ("specversion", "1.0"),
            ("datacontenttype", "application/json"),
        ] {
            if seen(name).is_some_and(|(_, v)| v != documented) {
                wrong.push(format!("{at:?} {name}: not {documented}"));
            }
        }
        // What the bridge wrote: each attribute's value, and the data.
        for (name, (_, value)) in &want {
            let Some((ty, seen_value)) = seen(name) else {
                wrong.push(format!("{at:?} {name}: written, not read"));
                continue;
            };
            let same = if ty == "Timestamp" {
                let parsed = |v: &str| v.parse::<jiff::Timestamp>().ok();
                parsed(&seen_value).is_some() && parsed(&seen_value) == parsed(value)
            } else {
                &seen_value == value
            };
            if !same {
                wrong.push(format!("{at:?} {name}: {seen_value:?}, meant {value:?}"));
            }
        }
        if event["data"] != data {
            wrong.push(format!("{at:?} data: {}, meant {data}", event["data"]));
        }
    }
    (wrong, added)
}

/// One example run over `topic`: the events it printed (with `--print-events`) and its final
/// state (key → resourceVersion).
struct Run {
    events: Vec<Value>,
    messages: u64,
    state: BTreeMap<String, String>,
}

/// Starts `command`, waits for it (2 min at most) and parses what it printed.
async fn run(what: &str, mut command: Command) -> Run {
    let output = tokio::task::spawn_blocking(move || {
        command
            .stdin(std::process::Stdio::null())
            .output()
            .expect("the example runs")
    });
    let output = tokio::time::timeout(Duration::from_secs(120), output)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within 2 min"))
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}\n{stdout}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let mut lines: Vec<Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{what}: {e}: {l}")))
        .collect();
    let last = lines
        .pop()
        .unwrap_or_else(|| panic!("{what} printed nothing"));
    let state = last["state"]
        .as_object()
        .unwrap_or_else(|| panic!("{what}: no state in {last}"))
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect();
    Run {
        events: lines,
        messages: last["messages"].as_u64().unwrap(),
        state,
    }
}

/// The Go example's binary.
fn go_example() -> PathBuf {
    fresh(
        built_tool("examples/go/consume-sdk-go", "scripts/build-examples"),
        &[
            "examples/go/main.go",
            "examples/go/go.mod",
            "examples/go/go.sum",
        ],
    )
}

/// The Go example over JetStream stream `stream`.
fn go_over_nats(url: &str, stream: &str) -> Command {
    let mut c = Command::new(go_example());
    c.args([
        "-nats",
        url,
        "-stream",
        stream,
        "-idle-exit",
        "3s",
        "-print-events",
    ]);
    c
}

/// What a JetStream stream holds, as records (partition 0, the stream sequence as offset; the
/// key is the event's subject attribute, `namespace/name`).
async fn nats_records(url: &str, stream: &str) -> Vec<Record> {
    support::nats::read_stream(url, stream)
        .await
        .into_iter()
        .map(|m| {
            let headers: Vec<(String, String)> = m
                .headers
                .iter()
                .flat_map(|(name, values)| {
                    values
                        .iter()
                        .map(|v| (name.to_string(), v.as_str().to_owned()))
                        .collect::<Vec<_>>()
                })
                .collect();
            let mut r = Record {
                partition: 0,
                offset: m.sequence as i64,
                key: String::new(),
                value: Some(m.payload.to_vec()),
                headers,
            };
            r.key = match r.header("ce-subject") {
                Some(subject) => subject.to_owned(),
                None => r.json()["subject"].as_str().unwrap_or_default().to_owned(),
            };
            r
        })
        .collect()
}

/// `built` (by `scripts/build-examples`), failing when a file of `sources` changed since.
fn fresh(built: PathBuf, sources: &[&str]) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).unwrap();
    for source in sources {
        assert!(
            modified(&root.join(source)) <= modified(&built),
            "{} is older than {source}: run scripts/build-examples",
            built.display()
        );
    }
    built
}

/// The command that runs example `language` over `topic` (a state topic when `state`),
/// exiting after 3 s without a message.
fn example(language: &str, brokers: &str, topic: &str, state: bool, events: bool) -> Command {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut c = match language {
        "go" => {
            let mut c = Command::new(go_example());
            c.args(["-brokers", brokers, "-topic", topic, "-idle-exit", "3s"]);
            if state {
                c.arg("-state");
            }
            if events {
                c.arg("-print-events");
            }
            return c;
        }
        "java" => {
            let jars: PathBuf = built_tool("examples/java/jars", "scripts/build-examples");
            let mut c = Command::new("java");
            c.arg("-cp")
                .arg(format!("{}/*", jars.display()))
                .arg(root.join("examples/java/Consume.java"))
                .args(["--idle-exit", "3"]);
            if events {
                c.arg("--print-events");
            }
            c
        }
        "python" => {
            let mut c = Command::new("python3");
            c.arg(root.join("examples/python/consume.py"))
                .args(["--idle-exit", "3"]);
            c
        }
        "rust" => {
            let mut c = Command::new(fresh(
                built_tool("debug/examples/consume", "scripts/build-examples"),
                &["examples/rust/consume.rs"],
            ));
            c.args(["--idle-exit", "3"]);
            c
        }
        other => panic!("no example in {other}"),
    };
    c.args(["--brokers", brokers, "--topic", topic]);
    if state {
        c.arg("--state");
    }
    c
}

/// Every example folds each topic into exactly the API server's objects, and the Go and Java
/// SDKs read every event of both content modes with the attributes, types and data the bridge
/// meant (SDK additions such as `partitionkey` allowed).
#[tokio::test(flavor = "multi_thread")]
async fn the_sdks_read_both_content_modes_and_every_example_ends_with_the_servers_objects() {
    let cluster = Cluster::start().await;
    cluster.create_namespace(NS).await;
    let kafka = Kafka::shared();
    let topics = Topics {
        binary: "consumers.binary".into(),
        structured: "consumers.structured".into(),
        state: "consumers.state".into(),
    };
    for t in [&topics.binary, &topics.structured, &topics.state] {
        kafka.create_topic(t, 3);
    }
    let nats = support::nats::NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let api = configmaps(&cluster).await;
    // Ten objects before the bridge starts: its first list (`k8sinitial`, a Boolean).
    create(&api, 0..10, "0").await;
    let mut replica = bridge(dir.path(), kafka, &topics, &nats.url(), &kubeconfig, true);
    ready(&replica).await;
    // Changes it watches: 30 created, 15 updated (5 twice), 10 deleted, 3 of them created again
    // (new uids under old keys).
    create(&api, 10..40, "0").await;
    update(&api, 0..15, "1").await;
    update(&api, 0..5, "2").await;
    delete(&api, 20..30).await;
    create(&api, 20..23, "again").await;
    let brokers = kafka.brokers();
    // Published once each topic's fold is the server's (the examples read what is there then).
    let read = |topic: &str| {
        let (brokers, topic) = (brokers.clone(), topic.to_owned());
        async move {
            tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, true))
                .await
                .unwrap()
        }
    };
    // A state topic's value is the object (its attributes travel as headers beside it).
    let folded = |records: &[Record], state_topic: bool| -> BTreeMap<String, String> {
        let mut state = BTreeMap::new();
        for r in records {
            let (rv, deleted) = match &r.value {
                None => (String::new(), true),
                Some(_) if state_topic => (
                    r.json()["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                    false,
                ),
                Some(_) => {
                    let (attributes, data) = meant(r);
                    let ty = &attributes["type"].1;
                    (
                        data["object"]["metadata"]["resourceVersion"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                        ty.ends_with(".deleted"),
                    )
                }
            };
            if deleted {
                state.remove(&r.key);
            } else {
                state.insert(r.key.clone(), rv);
            }
        }
        state
    };
    let resource = ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
    let mut records = BTreeMap::new();
    let mut live = BTreeMap::new();
    for round in ["live", "restart"] {
        if round == "restart" {
            // SIGKILLed with its exactly_once transaction open (a burst's records written
            // and not committed yet: it commits every 2 s, so a burst committed first is
            // followed by another), changed while down, started again without resyncs: its
            // resume sends what changed (`k8sresumed`, and deletes found by the list,
            // `k8sfinalstateunknown`).
            for attempt in 1.. {
                let value = format!("burst {attempt}");
                update(&api, 30..40, &value).await;
                let holds = |records: &[Record]| {
                    records.iter().any(|r| {
                        r.value
                            .as_deref()
                            .is_some_and(|v| v.windows(value.len()).any(|w| w == value.as_bytes()))
                    })
                };
                let read = |committed: bool| {
                    let (brokers, topic) = (brokers.clone(), topics.structured.clone());
                    tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, committed))
                };
                let mut written = false;
                for _ in 0..100 {
                    if holds(&read(false).await.unwrap()) {
                        written = true;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                assert!(written, "the burst was never written");
                if !holds(&read(true).await.unwrap()) {
                    break;
                }
                assert!(
                    attempt < 10,
                    "every burst was committed before it could be seen open"
                );
            }
            replica.signal("KILL");
            delete(&api, 0..3).await;
            update(&api, 5..8, "while down").await;
            replica = bridge(dir.path(), kafka, &topics, &nats.url(), &kubeconfig, false);
            ready(&replica).await;
        }
        live = cluster.objects(&resource, Some(NS)).await;
        let want: BTreeMap<String, String> = live
            .iter()
            .map(|(k, (_, rv))| (k.clone(), rv.clone()))
            .collect();
        for topic in [&topics.binary, &topics.structured, &topics.state] {
            let mut got = Vec::new();
            wait::until(
                format!("{topic} folds into the server's objects"),
                Patience::of(Duration::from_secs(90)).polling(Duration::from_millis(500)),
                async || {
                    got = read(topic).await;
                    folded(&got, topic == &topics.state) == want
                },
            )
            .await;
            records.insert(topic.clone(), got);
        }
        for (stream, _) in NATS_STREAMS {
            let mut got = Vec::new();
            wait::until(
                format!("JetStream stream {stream} folds into the server's objects"),
                Patience::of(Duration::from_secs(90)).polling(Duration::from_millis(500)),
                async || {
                    got = nats_records(&nats.url(), stream).await;
                    folded(&got, false) == want
                },
            )
            .await;
            records.insert(stream.to_owned(), got);
        }
    }
    assert_eq!(live.len(), 30);
    // The killed replica's open transaction was aborted: records a read_uncommitted consumer
    // would see and a read_committed one must not.
    let uncommitted = {
        let (brokers, topic) = (brokers.clone(), topics.structured.clone());
        tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, false).len())
            .await
            .unwrap()
    };
    let committed = records[&topics.structured].len();
    println!(
        "{}: {committed} records committed, {} aborted",
        topics.structured,
        uncommitted - committed
    );
    assert!(
        uncommitted > committed,
        "no aborted records: {uncommitted} read uncommitted, {committed} committed"
    );
    if replica.log().contains(" ERROR ") {
        dump(std::slice::from_ref(&replica));
    }

    // What the stream holds: every type, and each Boolean extension the scenario makes.
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for r in &records[&topics.structured] {
        let (attributes, _) = meant(r);
        let ty = &attributes["type"].1;
        *kinds
            .entry(ty.rsplit('.').next().unwrap().to_owned())
            .or_default() += 1;
        for (name, (ty, _)) in &attributes {
            if ty == "Boolean" {
                *kinds.entry(name.clone()).or_default() += 1;
            }
        }
    }
    println!("the structured topic holds {kinds:?}");
    for kind in [
        "added",
        "updated",
        "deleted",
        "synced",
        "k8sinitial",
        "k8sresumed",
        "k8sfinalstateunknown",
    ] {
        assert!(kinds.contains_key(kind), "no {kind} in {kinds:?}");
    }

    // The SDKs, both content modes: Go and Java over Kafka, Go over JetStream (which also
    // folds the streams).
    let mut failures = Vec::new();
    let mut sdk_runs = Vec::new();
    for language in ["go", "java"] {
        for topic in [&topics.binary, &topics.structured] {
            let what = format!("{language} SDK on Kafka topic {topic}");
            let r = run(&what, example(language, &brokers, topic, false, true)).await;
            sdk_runs.push((what, topic.clone(), r));
        }
    }
    for (stream, _) in NATS_STREAMS {
        let what = format!("go SDK on JetStream stream {stream}");
        let r = run(&what, go_over_nats(&nats.url(), stream)).await;
        sdk_runs.push((what, stream.to_owned(), r));
    }
    for (what, source, r) in &sdk_runs {
        let by_offset: BTreeMap<(i32, i64), Record> = records[source]
            .iter()
            .map(|r| ((r.partition, r.offset), r.clone()))
            .collect();
        let (wrong, added) = mismatches(&r.events, &by_offset);
        println!(
            "{what}: {} events read of {} messages, {} attribute or data mismatches, added on its own: {added:?}",
            r.events.len(),
            by_offset.len(),
            wrong.len()
        );
        for w in wrong.iter().take(10) {
            println!("  {w}");
        }
        if r.events.len() != by_offset.len() || !wrong.is_empty() {
            failures.push(what.clone());
        }
        if source.starts_with("CONSUMERS_") {
            let seen: BTreeSet<String> = records[source].iter().map(|r| r.key.clone()).collect();
            let e = ending(&r.state, &live, &seen);
            println!("  {what} ends with {} objects: {e:?}", r.state.len());
            if e != Ending::default() {
                failures.push(format!("{what}: its fold"));
            }
        }
    }

    // Every example, every topic: the state it ends with.
    for language in ["go", "java", "python", "rust"] {
        for topic in [&topics.binary, &topics.structured, &topics.state] {
            let state = topic == &topics.state;
            let r = run(
                &format!("{language} example on {topic}"),
                example(language, &brokers, topic, state, false),
            )
            .await;
            let seen: BTreeSet<String> = records[topic].iter().map(|r| r.key.clone()).collect();
            let e = ending(&r.state, &live, &seen);
            println!(
                "{language} example, {topic}: {} messages, {} objects; lost deletes {}, phantom deletes {}, stale {}, missing {}",
                r.messages,
                r.state.len(),
                e.lost_deletes.len(),
                e.phantom_deletes.len(),
                e.stale.len(),
                e.missing.len()
            );
            if e != Ending::default() {
                println!("  {e:?}");
                failures.push(format!("{language} example on {topic}"));
            }
            // Every committed record, nothing of the aborted transaction.
            if r.messages != records[topic].len() as u64 {
                println!(
                    "  read {} messages of {} committed",
                    r.messages,
                    records[topic].len()
                );
                failures.push(format!("{language} example on {topic}: its count"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}
