//! The configs tests and benches run the bridge with, built as the document a config file
//! holds: [`ConfigBuilder`] and the sink sections the broker tests share.
//!
//! Benches include this file with `#[path]`: it uses nothing of the `support` module around it.
#![allow(dead_code)] // each test binary and bench uses a different part

use std::path::Path;

use kube_event_bridge::config::Config;
use serde_json::{Value, json};

/// The JetStream stream a [`nats_sink`] publishes to (created if missing).
pub const NATS_STREAM: &str = "K8S";

/// A bridge config under construction. [`ConfigBuilder::new`] is what every test starts
/// from; each method adds one section or entry, in the config file's own terms.
#[derive(Clone, Debug)]
pub struct ConfigBuilder {
    doc: Value,
}

impl Default for ConfigBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ConfigBuilder {
    /// Cluster `test`, the admin server on a free loopback port, and no resources, sinks or
    /// routes yet; every other section at its default.
    pub fn new() -> Self {
        Self {
            doc: json!({
                "cluster": "test",
                "admin": {"address": "127.0.0.1:0"},
                "resources": [],
                "sinks": [],
                "routes": [],
            }),
        }
    }

    /// Sets the top-level section `key` to `value` (for a section without a method here).
    pub fn set(mut self, key: &str, value: Value) -> Self {
        self.doc[key] = value;
        self
    }

    /// The cluster name messages carry.
    pub fn cluster(self, name: &str) -> Self {
        self.set("cluster", json!(name))
    }

    /// `shutdown.grace_period`, as the config file writes it (`"5s"`).
    pub fn grace_period(self, grace: &str) -> Self {
        self.set("shutdown", json!({"grace_period": grace}))
    }

    /// The `kubernetes` section.
    pub fn kubernetes(self, section: Value) -> Self {
        self.set("kubernetes", section)
    }

    /// The `message` section.
    pub fn message(self, section: Value) -> Self {
        self.set("message", section)
    }

    /// Leader election as `identity` with the defaults' timings.
    pub fn leader_election(self, identity: &str) -> Self {
        self.set(
            "leader_election",
            json!({"enabled": true, "identity": identity, "namespace": "kube-system"}),
        )
    }

    /// Leader election as `identity` with the tests' fast timings: a 3 s lease, renewed
    /// within 2 s, tried every `retry_period` (`"200ms"`).
    pub fn fast_leader_election(self, identity: &str, retry_period: &str) -> Self {
        self.set(
            "leader_election",
            json!({
                "enabled": true, "identity": identity, "namespace": "kube-system",
                "lease_duration": "3s", "renew_deadline": "2s", "retry_period": retry_period,
            }),
        )
    }

    /// Adds a resource entry.
    pub fn resource(mut self, resource: Value) -> Self {
        push(&mut self.doc["resources"], resource);
        self
    }

    /// Adds every resource entry of the array `resources`.
    pub fn resources(self, resources: Value) -> Self {
        let Value::Array(resources) = resources else {
            panic!("resources must be an array: {resources}");
        };
        resources.into_iter().fold(self, Self::resource)
    }

    /// Adds all ConfigMaps (the resource named `configmap`).
    pub fn configmaps(self) -> Self {
        self.resource(json!({"api_version": "v1", "kind": "ConfigMap"}))
    }

    /// Adds a sink entry.
    pub fn sink(mut self, sink: Value) -> Self {
        push(&mut self.doc["sinks"], sink);
        self
    }

    /// Adds a stdout sink `name` writing JSON lines to the file `path`.
    pub fn stdout(self, name: &str, path: impl AsRef<Path>) -> Self {
        self.sink(json!({"name": name, "type": "stdout", "stdout": {"path": path.as_ref()}}))
    }

    /// Adds a route from `resource` to `sinks`.
    pub fn route(mut self, resource: &str, sinks: &[&str]) -> Self {
        push(
            &mut self.doc["routes"],
            json!({"resource": resource, "sinks": sinks}),
        );
        self
    }

    /// Routes each resource added so far (by its `name`) to `sinks`.
    pub fn route_each_resource_to(self, sinks: &[&str]) -> Self {
        self.resource_names()
            .iter()
            .fold(self, |b, name| b.route(name, sinks))
    }

    /// Gives each resource added so far (by its `name`) a stdout sink of the same name
    /// writing `dir/{name}.jsonl`, and routes it there.
    pub fn stdout_per_resource(self, dir: &Path) -> Self {
        let names = self.resource_names();
        let with_sinks = names.iter().fold(self, |b, name| {
            b.stdout(name, dir.join(format!("{name}.jsonl")))
        });
        names
            .iter()
            .fold(with_sinks, |b, name| b.route(name, &[name]))
    }

    fn resource_names(&self) -> Vec<String> {
        self.doc["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r["name"]
                    .as_str()
                    .expect("a resource routed by name has a name")
                    .to_owned()
            })
            .collect()
    }

    /// The document, as a config file would hold it.
    pub fn value(&self) -> Value {
        self.doc.clone()
    }

    /// The loaded, checked config.
    pub fn build(self) -> Config {
        Config::from_value(self.doc).expect("the test config is valid")
    }
}

fn push(list: &mut Value, entry: Value) {
    list.as_array_mut().expect("a list").push(entry);
}

/// The tests' retry settings for a broker sink: fast, and not rate-limited below the load.
fn fast_retry() -> Value {
    json!({"base_delay": "10ms", "max_delay": "500ms", "qps": 1000.0, "burst": 1000})
}

/// A Kafka sink `name` on `brokers` (32 workers, topics created with 3 partitions, a 5 s
/// delivery timeout, fast retries); each field of `extra` replaces or adds one of `kafka`.
pub fn kafka_sink(name: &str, brokers: &str, extra: Value) -> Value {
    let mut kafka =
        json!({"brokers": [brokers], "create_topics": {"partitions": 3}, "delivery_timeout": "5s"});
    for (k, v) in extra.as_object().unwrap() {
        kafka[k] = v.clone();
    }
    json!({"name": name, "type": "kafka", "workers": 32, "kafka": kafka, "retry": fast_retry()})
}

/// A NATS sink `name` on `url` (16 workers, a 1 s ack timeout, JetStream stream
/// [`NATS_STREAM`] over `k8s.>` created with a 10 min duplicate window, fast retries); each
/// field of `extra` replaces or adds one of `nats`.
pub fn nats_sink(name: &str, url: &str, extra: Value) -> Value {
    let mut nats = json!({
        "servers": [url],
        "ack_timeout": "1s",
        "stream": {"name": NATS_STREAM, "create": true, "subjects": ["k8s.>"], "duplicate_window": "10m"},
    });
    for (k, v) in extra.as_object().unwrap() {
        nats[k] = v.clone();
    }
    json!({"name": name, "type": "nats", "workers": 16, "nats": nats, "retry": fast_retry()})
}

/// The NATS settings of sink section `sink` ([`nats_sink`]), parsed as the service parses them.
pub fn nats_settings(sink: Value) -> kube_event_bridge::sinks::nats::NatsSinkConfig {
    let section: kube_event_bridge::config::SinkConfig = serde_json::from_value(sink).unwrap();
    section.nats.expect("a NATS sink")
}

/// The Kafka settings of sink section `sink` ([`kafka_sink`]), parsed as the service parses
/// them.
pub fn kafka_settings(sink: Value) -> kube_event_bridge::sinks::kafka::KafkaSinkConfig {
    let section: kube_event_bridge::config::SinkConfig = serde_json::from_value(sink).unwrap();
    section.kafka.expect("a Kafka sink")
}
