//! Scenarios every broker sink passes, written once: tests/kafka.rs and tests/nats.rs run
//! each on their broker ([`Broker`]) and then check what only their broker has (Kafka's keys
//! and partitions, NATS's subjects and message ids) on the messages a scenario returns.

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use super::{
    ApiServer, RunningApp,
    broker::{Broker, Delivered},
    config::ConfigBuilder,
    event_type,
    objects::{configmap, typed},
    schema,
};

/// Object `i` of a scenario: namespace `ns-0` or `ns-1`, a name with dots (which NATS
/// subjects escape).
fn object(i: usize, v: &str) -> k8s_openapi::api::core::v1::ConfigMap {
    configmap(&format!("ns-{}", i % 2), &format!("app.v{i}.config"), v)
}

/// A config with the broker's sink `out` and ConfigMaps routed to it.
fn config(broker: &Broker, extra: Value) -> kube_event_bridge::config::Config {
    ConfigBuilder::new()
        .grace_period("10s")
        .configmaps()
        .sink(broker.sink_with("out", extra))
        .route("configmap", &["out"])
        .build()
}

/// 12 objects in two namespaces listed, then each updated and 3 deleted: every notification
/// arrives once, as a structured CloudEvent with its deterministic id, in order per object.
/// Returns what the consumer read (27 messages).
pub async fn every_change_once_in_order(broker: &Broker) -> Vec<Delivered> {
    let api = ApiServer::start().await;
    for i in 0..12 {
        api.create(typed(&object(i, "1")));
    }
    let running = RunningApp::start(config(broker, json!({})), &api).await;
    running.synced().await;
    for i in 0..12 {
        api.update(typed(&object(i, "2")));
    }
    for i in 0..3 {
        let o = object(i, "");
        let (ns, name) = (o.metadata.namespace.unwrap(), o.metadata.name.unwrap());
        api.delete("v1", "ConfigMap", &ns, &name);
    }
    let delivered = broker.delivered_at_least(27).await;
    let report = running.stop().await;
    assert!(report.undelivered.is_empty(), "{:?}", report.undelivered);
    assert_eq!(delivered.len(), 27, "once each on {}", broker.name());
    let mut ids = HashSet::new();
    let mut versions: HashMap<String, Vec<u64>> = HashMap::new();
    for m in &delivered {
        let e = &m.body;
        assert_eq!(
            m.header("content-type"),
            Some("application/cloudevents+json"),
            "structured mode"
        );
        schema::check_cloudevent(e);
        assert_eq!(e["specversion"], "1.0");
        let rv = e["k8sresourceversion"].as_str().unwrap();
        let id = format!("{}:{rv}:{}", e["k8suid"].as_str().unwrap(), event_type(e));
        assert_eq!(e["id"].as_str(), Some(id.as_str()), "deterministic id");
        assert!(ids.insert(id.clone()), "{id} twice");
        let subject = e["subject"].as_str().unwrap().to_owned();
        versions
            .entry(subject)
            .or_default()
            .push(rv.parse().unwrap());
    }
    assert_eq!(versions.len(), 12);
    for (object, rvs) in &versions {
        assert!(rvs.windows(2).all(|w| w[0] < w[1]), "{object}: {rvs:?}");
    }
    let count = |t: &str| {
        delivered
            .iter()
            .filter(|m| event_type(&m.body) == t)
            .count()
    };
    assert_eq!(
        (count("added"), count("updated"), count("deleted")),
        (12, 12, 3)
    );
    delivered
}

/// In binary mode (with `extra` settings besides `encoding`) an object's message carries
/// the CloudEvents attributes as headers (the broker's prefix) and the data as its body,
/// which together make a valid structured event. Returns the message.
pub async fn binary_mode(broker: &Broker, extra: Value) -> Delivered {
    let api = ApiServer::start().await;
    api.create(typed(&configmap("ns", "a", "1")));
    let mut settings = json!({"encoding": "binary"});
    for (k, v) in extra.as_object().unwrap() {
        settings[k] = v.clone();
    }
    let running = RunningApp::start(config(broker, settings), &api).await;
    let delivered = broker.delivered_at_least(1).await;
    running.stop().await;
    let m = delivered.into_iter().next().unwrap();
    let ce = broker.ce_prefix();
    let attr = |name: &str| m.header(&format!("{ce}{name}"));
    assert_eq!(attr("specversion"), Some("1.0"));
    assert_eq!(
        attr("type"),
        Some("io.github.kube-event-bridge.object.added")
    );
    assert_eq!(attr("subject"), Some("ns/a"));
    assert_eq!(attr("k8skind"), Some("ConfigMap"));
    assert_eq!(attr("k8sinitial"), Some("true"));
    assert_eq!(m.header("content-type"), Some("application/json"));
    assert_eq!(m.body["object"]["data"]["v"], "1");
    assert!(
        m.body.get("specversion").is_none(),
        "the body is the data, not the envelope"
    );
    schema::check_cloudevent(&schema::structured_from_binary(
        m.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        ce,
        m.body.clone(),
    ));
    m
}
