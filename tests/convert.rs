//! `kube-event-bridge convert`: the peers' documented example configs (shaped as their READMEs
//! and example files show them, in `tests/fixtures/convert/`) become configs that
//! `check-config` accepts; settings map as the book says; inline passwords are never copied;
//! what has no equivalent is listed; and the kubernetes-event-exporter route trees, compiled
//! into CEL `publish_if` expressions, pass the Events the exporter's rules would route.

use std::{path::Path, process::Command};

use kube::api::DynamicObject;
use kube_event_bridge::{
    config::EventType, informer::object::CachedObject, pipeline::filter::Expr,
};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_kube-event-bridge");

/// Converts `fixture`, checks the result with `check-config`, and returns the effective
/// config (as `check-config` prints it), the YAML and the notes printed on stderr.
fn convert(from: &str, fixture: &str) -> (Value, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("converted.yaml");
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/convert")
        .join(fixture);
    let out = Command::new(BIN)
        .args(["convert", "--from", from])
        .arg(&src)
        .arg("--output")
        .arg(&out_path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "convert {fixture}: {stderr}");
    let yaml = std::fs::read_to_string(&out_path).unwrap();
    let check = Command::new(BIN)
        .arg("check-config")
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "check-config rejects the conversion of {fixture}:\n{}\n{yaml}",
        String::from_utf8_lossy(&check.stderr)
    );
    let effective: Value = serde_json::from_slice(&check.stdout).unwrap();
    (effective, yaml, stderr)
}

fn resource<'a>(config: &'a Value, name: &str) -> &'a Value {
    config["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == json!(name))
        .unwrap_or_else(|| panic!("no resource {name}: {config:#}"))
}

fn sink<'a>(config: &'a Value, name: &str) -> &'a Value {
    config["sinks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == json!(name))
        .unwrap_or_else(|| panic!("no sink {name}: {config:#}"))
}

fn routes_of(config: &Value, resource: &str) -> Vec<String> {
    config["routes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["resource"] == json!(resource))
        .flat_map(|r| {
            r["sinks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_owned())
        })
        .collect()
}

#[test]
fn the_k8sobjects_readme_example_keeps_its_objects_selectors_and_interval() {
    let (c, yaml, notes) = convert("otel-k8sobjects", "otel-k8sobjects.yaml");
    let pods = resource(&c, "pods");
    assert_eq!(pods["api_version"], "v1");
    assert_eq!(pods["kind"], "Pod");
    assert_eq!(
        pods["label_selector"],
        "environment in (production),tier in (frontend)"
    );
    assert_eq!(pods["field_selector"], "status.phase=Running");
    // Pull every 15 minutes: every object re-published as `synced` every 15 minutes.
    assert_eq!(pods["resync_period"], "15m");
    assert!(
        pods["events"]
            .as_array()
            .unwrap()
            .contains(&json!("synced"))
    );
    let events = resource(&c, "events.events.k8s.io");
    assert_eq!(events["api_version"], "events.k8s.io/v1");
    assert_eq!(events["kind"], "Event");
    assert_eq!(events["namespaces"], json!(["default"]));
    // OTLP has no equivalent: standard output, and the notes say so, in the file and on stderr.
    assert_eq!(sink(&c, "stdout")["type"], "stdout");
    assert_eq!(routes_of(&c, "pods"), ["stdout"]);
    for text in [&yaml, &notes] {
        assert!(text.contains("exporters.otlp: no equivalent"), "{text}");
        assert!(text.contains("objects[0].mode: pull"), "{text}");
    }
}

#[test]
fn a_collector_with_a_kafka_exporter_maps_brokers_topic_auth_and_pipelines() {
    let (c, yaml, notes) = convert("otel-k8sobjects", "otel-k8sobjects-kafka.yaml");
    let kafka = &sink(&c, "kafka")["kafka"];
    assert_eq!(
        kafka["brokers"],
        json!(["kafka-0.kafka:9093", "kafka-1.kafka:9093"])
    );
    assert_eq!(kafka["topic"], "k8s-objects");
    assert_eq!(kafka["compression"], "zstd");
    assert_eq!(kafka["properties"]["client.id"], "otel-k8s");
    assert_eq!(kafka["sasl"]["mechanism"], "SCRAM-SHA-512");
    assert_eq!(kafka["sasl"]["username"], "collector");
    // `${env:KAFKA_PASSWORD}` in the Collector: the same variable here.
    assert_eq!(kafka["sasl"]["password"]["env"], "KAFKA_PASSWORD");
    assert_eq!(kafka["tls"]["ca_file"], "/etc/kafka/ca.crt");
    // Deployments are apps/v1; core Events without DELETED (and BOOKMARK, which the bridge
    // never publishes).
    let deployments = resource(&c, "deployments.apps");
    assert_eq!(deployments["api_version"], "apps/v1");
    assert_eq!(deployments["namespaces"], json!(["shop", "payments"]));
    assert_eq!(
        resource(&c, "events")["events"],
        json!(["added", "updated"])
    );
    // The second receiver's custom resource: kind guessed, and said so; it feeds both
    // pipelines.
    let widgets = resource(&c, "crds-widgets.example.com");
    assert_eq!(widgets["kind"], "Widget");
    assert_eq!(widgets["api_version"], "example.com/v1");
    let mut sinks = routes_of(&c, "crds-widgets.example.com");
    sinks.sort();
    assert_eq!(sinks, ["debug", "kafka"]);
    assert_eq!(routes_of(&c, "deployments.apps"), ["kafka"]);
    for expected in [
        "guessed kind Widget",
        "processors: batch is not applied",
        "encoding: otlp_json",
        "exporters.debug.verbosity: no equivalent",
        "receivers.otlp: not a k8sobjects receiver",
    ] {
        assert!(notes.contains(expected), "{expected:?} not in:\n{notes}");
        assert!(yaml.contains(expected), "{expected:?} not in:\n{yaml}");
    }
}

#[test]
fn kubernetes_event_exporter_routes_become_one_filtered_resource_per_receiver() {
    let (c, _yaml, notes) = convert(
        "kubernetes-event-exporter",
        "kubernetes-event-exporter.yaml",
    );
    assert_eq!(c["log"]["level"], "debug");
    assert_eq!(c["log"]["format"], "json");
    assert_eq!(c["kubernetes"]["qps"], 60.0);
    assert_eq!(c["kubernetes"]["burst"], 60);
    for name in ["dump", "alert", "slack", "pipe", "firehose"] {
        let r = resource(&c, &format!("events-to-{name}"));
        assert_eq!(
            (&r["api_version"], &r["kind"]),
            (&json!("v1"), &json!("Event"))
        );
        // The exporter publishes additions and updates of Events, never their deletion.
        assert_eq!(r["events"], json!(["added", "updated"]));
        assert_eq!(routes_of(&c, &format!("events-to-{name}")), [name]);
        // No equivalent of Elasticsearch, Opsgenie, Slack, webhooks or Firehose: standard
        // output keeps the routing until the user points it at a broker.
        assert_eq!(sink(&c, name)["type"], "stdout");
    }
    // The Kafka receiver no route uses is left out, and said so.
    assert!(
        c["sinks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["name"] != "kafka")
    );
    for expected in [
        "receivers[4] (kafka): no route sends events to it",
        "receivers[0] (dump): elasticsearch has no equivalent",
        "\"*test*\" is not a regular expression",
        "match[0].labels",
        "maxEventAgeSeconds",
    ] {
        assert!(notes.contains(expected), "{expected:?} not in:\n{notes}");
    }

    // The filters route exactly as the exporter's rules do. `*test*` and `*beta*` are not
    // regular expressions (Go's regexp rejects them too), so "alert" drops nothing.
    let passes = |name: &str, event: &Value| -> bool {
        let r = resource(&c, &format!("events-to-{name}"));
        let Some(filter) = r["publish_if"].as_str() else {
            return true;
        };
        let expr = Expr::compile(filter).unwrap();
        let obj: DynamicObject = serde_json::from_value(event.clone()).unwrap();
        expr.eval(&CachedObject::new(&obj), None, EventType::Added)
            .unwrap_or_else(|e| panic!("{name}: {filter}: {e}"))
    };
    let normal_pod = event("test-env", "Normal", "Pod", 7);
    let warning_node = event("shop", "Warning", "Node", 1);
    let warning_deploy = event("shop", "Warning", "Deployment", 1);
    assert!(passes("dump", &normal_pod) && passes("dump", &warning_node));
    assert!(passes("alert", &normal_pod) && passes("pipe", &warning_node));
    assert!(passes("slack", &normal_pod) && passes("slack", &warning_deploy));
    assert!(!passes("slack", &warning_node));
    assert!(!passes("firehose", &normal_pod) && passes("firehose", &warning_node));
    // An Event without a source or involved object kind reads as "" (Go's zero value).
    let mut bare = event("shop", "Warning", "Pod", 1);
    bare.as_object_mut().unwrap().remove("involvedObject");
    assert!(!passes("slack", &bare) && passes("firehose", &bare));
}

#[test]
fn kubernetes_event_exporter_kafka_receiver_maps_tls_sasl_and_never_copies_the_password() {
    let (c, yaml, notes) = convert(
        "kubernetes-event-exporter",
        "kubernetes-event-exporter-kafka.yaml",
    );
    let kafka = &sink(&c, "dump")["kafka"];
    assert_eq!(kafka["brokers"], json!(["kafka-0:9092"]));
    assert_eq!(kafka["topic"], "kube-event");
    assert_eq!(kafka["compression"], "snappy");
    assert_eq!(kafka["properties"]["client.id"], "kubernetes");
    assert_eq!(kafka["tls"]["ca_file"], "kafka-ca.crt");
    assert_eq!(kafka["tls"]["cert_file"], "kafka-client.crt");
    assert_eq!(kafka["tls"]["key_file"], "kafka-client.key");
    assert_eq!(kafka["sasl"]["mechanism"], "SCRAM-SHA-512");
    assert_eq!(kafka["sasl"]["username"], "kube-event-producer");
    assert_eq!(kafka["sasl"]["password"]["env"], "KAFKA_PASSWORD_DUMP");
    for text in [&yaml, &notes, &c.to_string()] {
        assert!(!text.contains("kube-event-producer-password"), "{text}");
    }
    assert!(
        notes.contains("Set the environment variable KAFKA_PASSWORD_DUMP"),
        "{notes}"
    );
    assert_eq!(c["cluster"], "prod-eu");
    assert_eq!(c["leader_election"]["enabled"], true);
    assert_eq!(
        c["leader_election"]["lease_name"],
        "kubernetes-event-exporter"
    );
    assert_eq!(
        resource(&c, "events-to-dump")["namespaces"],
        json!(["shop"])
    );
    assert_eq!(
        sink(&c, "critical-events-queue")["stdout"]["path"],
        "/var/log/critical-events.jsonl"
    );
    let filter = resource(&c, "events-to-critical-events-queue")["publish_if"]
        .as_str()
        .unwrap();
    let expr = Expr::compile(filter).unwrap();
    let eval = |e: Value| {
        let obj: DynamicObject = serde_json::from_value(e).unwrap();
        expr.eval(&CachedObject::new(&obj), None, EventType::Updated)
            .unwrap()
    };
    assert!(eval(event("shop", "Warning", "Pod", 1)));
    assert!(!eval(event("shop", "Normal", "Pod", 1)));
}

/// `minCount`, patterns the two regex engines read alike and ones they do not, and a
/// namespace the exporter would read from the environment.
#[test]
fn min_count_portable_patterns_and_environment_references() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("kee.yaml");
    std::fs::write(
        &src,
        r#"
namespace: ${POD_NAMESPACE}
route:
  routes:
    - drop:
        - type: "Normal"
          minCount: 3
        - reason: "\\d+"
      match:
        - receiver: "out"
          reason: "^Back[Oo]ff$|Killing"
        - receiver: "wide"
          message: "(?i)oom"
receivers:
  - name: "out"
    stdout: {}
  - name: "wide"
    stdout: {}
"#,
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["convert", "--from", "kubernetes-event-exporter"])
        .arg(&src)
        .output()
        .unwrap();
    let notes = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{notes}");
    let yaml = String::from_utf8_lossy(&out.stdout);
    let path = dir.path().join("out.yaml");
    std::fs::write(&path, yaml.as_bytes()).unwrap();
    let check = Command::new(BIN)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(check.status.success(), "{yaml}");
    let c: Value = serde_json::from_slice(&check.stdout).unwrap();
    // The namespace is the exporter's environment's: every namespace is watched, and said so.
    assert!(
        resource(&c, "events-to-out")
            .get("namespaces")
            .is_none_or(|n| n == &json!([]))
    );
    assert!(notes.contains("POD_NAMESPACE"), "{notes}");
    // `\d` is ASCII in Go and Unicode in the bridge: that drop rule is left out; `(?i)` is
    // left out of the match rule (a superset), and both are said.
    assert!(
        notes.contains("drop[1].reason") && notes.contains("match[1].message"),
        "{notes}"
    );
    let eval = |name: &str, e: &Value| -> bool {
        let Some(expr) = resource(&c, name)["publish_if"].as_str() else {
            return true;
        };
        let obj: DynamicObject = serde_json::from_value(e.clone()).unwrap();
        Expr::compile(expr)
            .unwrap()
            .eval(&CachedObject::new(&obj), None, EventType::Added)
            .unwrap()
    };
    let with = |ty: &str, reason: &str, count: i64| {
        let mut e = event("shop", ty, "Pod", count);
        e["reason"] = json!(reason);
        e
    };
    // minCount: a Normal event is dropped from its third occurrence on.
    assert!(eval("events-to-out", &with("Normal", "BackOff", 2)));
    assert!(!eval("events-to-out", &with("Normal", "BackOff", 3)));
    assert!(eval("events-to-out", &with("Warning", "Killing", 9)));
    assert!(!eval("events-to-out", &with("Warning", "Started", 1)));
    // "wide" keeps the drop rules and loses only its unportable pattern.
    assert!(eval("events-to-wide", &with("Warning", "Started", 1)));
    assert!(!eval("events-to-wide", &with("Normal", "Started", 5)));
}

/// Runs `convert --from from` on `yaml`, checks the result with `check-config`; returns the
/// effective config and the notes.
fn convert_text(from: &str, yaml: &str) -> (Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("source.yaml");
    std::fs::write(&src, yaml).unwrap();
    let out_path = dir.path().join("out.yaml");
    let out = Command::new(BIN)
        .args(["convert", "--from", from])
        .arg(&src)
        .arg("-o")
        .arg(&out_path)
        .output()
        .unwrap();
    let notes = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{notes}");
    let check = Command::new(BIN)
        .arg("check-config")
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    (serde_json::from_slice(&check.stdout).unwrap(), notes)
}

/// Drop rules read with less than they say are left out, never widened into dropping more:
/// a YAML merge key (which the exporter's reader applies), a pattern written as a number. Two
/// receivers on one topic are said to have no order between them.
#[test]
fn drop_rules_read_incompletely_drop_nothing_and_shared_topics_are_noted() {
    let (c, notes) = convert_text(
        "kubernetes-event-exporter",
        r#"
noisy: &noisy
  type: "Normal"
route:
  routes:
    - drop:
        - <<: *noisy
        - reason: 1.10
      match:
        - receiver: "a"
        - receiver: "b"
receivers:
  - name: "a"
    kafka: {topic: "events", brokers: ["k:9092"]}
  - name: "b"
    kafka: {topic: "events", brokers: ["k:9092"]}
"#,
    );
    for name in ["events-to-a", "events-to-b"] {
        assert!(
            resource(&c, name)
                .get("publish_if")
                .is_none_or(Value::is_null),
            "{name} drops nothing: {c:#}"
        );
    }
    assert!(
        notes.contains("drop[0]: holds keys the bridge does not read"),
        "{notes}"
    );
    assert!(
        notes.contains("drop[1]: holds keys the bridge does not read"),
        "{notes}"
    );
    assert!(
        notes.contains("sinks a and b write the same topic"),
        "{notes}"
    );
}

/// A Collector whose k8sobjects receiver reaches Kafka through a `forward` connector.
#[test]
fn collector_connectors_are_followed_to_their_exporters() {
    let (c, notes) = convert_text(
        "otel-k8sobjects",
        r#"
receivers:
  k8sobjects:
    objects:
      - {name: pods, mode: watch}
connectors:
  forward: {}
exporters:
  kafka:
    brokers: [k:9092]
    topic: objects
service:
  pipelines:
    logs/in:
      receivers: [k8sobjects]
      exporters: [forward]
    logs/out:
      receivers: [forward]
      exporters: [kafka]
"#,
    );
    assert_eq!(routes_of(&c, "pods"), ["kafka"]);
    assert_eq!(sink(&c, "kafka")["kafka"]["topic"], "objects");
    assert!(notes.contains("connectors.forward: followed"), "{notes}");
}

#[test]
fn bad_input_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let not_otel = dir.path().join("kee.yaml");
    std::fs::write(&not_otel, "route: {}\nreceivers: []\n").unwrap();
    let out = Command::new(BIN)
        .args(["convert", "--from", "otel-k8sobjects"])
        .arg(&not_otel)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no `k8sobjects` receiver"), "{err}");

    let broken = dir.path().join("broken.yaml");
    std::fs::write(&broken, "route: [unclosed\n").unwrap();
    let out = Command::new(BIN)
        .args(["convert", "--from", "kubernetes-event-exporter"])
        .arg(&broken)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("broken.yaml") && err.contains("YAML"), "{err}");

    let out = Command::new(BIN)
        .args([
            "convert",
            "--from",
            "kubernetes-event-exporter",
            "/nonexistent.yaml",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read /nonexistent.yaml"));
}

/// A core v1 Event about a `kind` in `namespace`.
fn event(namespace: &str, ty: &str, kind: &str, count: i64) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": format!("x.{kind}"), "namespace": namespace, "uid": "u", "resourceVersion": "1"},
        "involvedObject": {"apiVersion": "v1", "kind": kind, "name": "x", "namespace": namespace},
        "reason": "Created",
        "message": "created",
        "type": ty,
        "count": count,
        "source": {"component": "kubelet", "host": "node-1"},
    })
}
