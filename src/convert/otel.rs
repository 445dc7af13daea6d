//! From an OpenTelemetry Collector config: its `k8sobjects` receivers (one resource per
//! `objects[]` entry) and the exporters their `logs` pipelines feed (`kafka` → a Kafka sink,
//! `debug`/`logging` → standard output, `file` → a file).
//!
//! What differs in kind, not in setting: the receiver's `pull` mode lists every `interval`;
//! the bridge watches and re-publishes every object as `synced` each `resync_period`, with
//! every change in between. Messages are CloudEvents JSON, not OTLP log records.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use super::{
    Conversion, Error, Notes, Result, compression, flag, kafka_sasl, strings, text, unused,
};

/// Built-in kinds by plural name and group (the first group wins when `group` is unset, as
/// the receiver picks the first group discovery lists, the core group first).
const BUILT_IN: &[(&str, &str, &str, &str)] = &[
    // (plural, group, version, kind)
    ("pods", "", "v1", "Pod"),
    ("events", "", "v1", "Event"),
    ("services", "", "v1", "Service"),
    ("endpoints", "", "v1", "Endpoints"),
    ("namespaces", "", "v1", "Namespace"),
    ("nodes", "", "v1", "Node"),
    ("configmaps", "", "v1", "ConfigMap"),
    ("secrets", "", "v1", "Secret"),
    ("serviceaccounts", "", "v1", "ServiceAccount"),
    ("persistentvolumes", "", "v1", "PersistentVolume"),
    ("persistentvolumeclaims", "", "v1", "PersistentVolumeClaim"),
    ("replicationcontrollers", "", "v1", "ReplicationController"),
    ("resourcequotas", "", "v1", "ResourceQuota"),
    ("limitranges", "", "v1", "LimitRange"),
    ("events", "events.k8s.io", "v1", "Event"),
    ("deployments", "apps", "v1", "Deployment"),
    ("replicasets", "apps", "v1", "ReplicaSet"),
    ("statefulsets", "apps", "v1", "StatefulSet"),
    ("daemonsets", "apps", "v1", "DaemonSet"),
    ("controllerrevisions", "apps", "v1", "ControllerRevision"),
    ("jobs", "batch", "v1", "Job"),
    ("cronjobs", "batch", "v1", "CronJob"),
    (
        "horizontalpodautoscalers",
        "autoscaling",
        "v2",
        "HorizontalPodAutoscaler",
    ),
    ("ingresses", "networking.k8s.io", "v1", "Ingress"),
    ("ingressclasses", "networking.k8s.io", "v1", "IngressClass"),
    (
        "networkpolicies",
        "networking.k8s.io",
        "v1",
        "NetworkPolicy",
    ),
    (
        "poddisruptionbudgets",
        "policy",
        "v1",
        "PodDisruptionBudget",
    ),
    ("roles", "rbac.authorization.k8s.io", "v1", "Role"),
    (
        "rolebindings",
        "rbac.authorization.k8s.io",
        "v1",
        "RoleBinding",
    ),
    (
        "clusterroles",
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRole",
    ),
    (
        "clusterrolebindings",
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRoleBinding",
    ),
    ("storageclasses", "storage.k8s.io", "v1", "StorageClass"),
    (
        "customresourcedefinitions",
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
    ),
    ("leases", "coordination.k8s.io", "v1", "Lease"),
    ("endpointslices", "discovery.k8s.io", "v1", "EndpointSlice"),
    (
        "priorityclasses",
        "scheduling.k8s.io",
        "v1",
        "PriorityClass",
    ),
];

// The receiver's default `interval` in pull mode.
const DEFAULT_PULL_INTERVAL: &str = "1h";

/// Converts a Collector config with at least one `k8sobjects` receiver.
pub(crate) fn convert(doc: &Value) -> Result<Conversion> {
    let mut notes = Notes::default();
    let receivers: BTreeMap<&str, &Value> = doc
        .get("receivers")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter(|(k, _)| is_component(k, "k8sobjects"))
                .map(|(k, v)| (k.as_str(), v))
                .collect()
        })
        .unwrap_or_default();
    if receivers.is_empty() {
        return Err(Error::Format(
            "no `k8sobjects` receiver under `receivers`: is this an OpenTelemetry Collector \
             config that uses the Kubernetes objects receiver?"
                .into(),
        ));
    }
    if let Some(others) = doc.get("receivers").and_then(Value::as_object) {
        for name in others
            .keys()
            .filter(|k| !receivers.contains_key(k.as_str()))
        {
            notes.add(format!(
                "receivers.{name}: not a k8sobjects receiver; left out"
            ));
        }
    }

    let feeds = feeds(doc, &receivers, &mut notes);
    let mut sinks = sinks(doc, &feeds, &mut notes);
    let mut out = Receivers::default();
    for (rname, receiver) in &receivers {
        out.add(rname, receiver, &feeds, &sinks, &mut notes);
    }
    if out.need_stdout {
        sinks.insert(
            "stdout".into(),
            json!({ "name": "stdout", "type": "stdout" }),
        );
    }
    if out.resources.is_empty() {
        return Err(Error::Format(
            "no k8sobjects receiver lists an object the bridge can watch (objects[].name)".into(),
        ));
    }
    let mut config = json!({
        "resources": out.resources,
        "sinks": sinks.into_values().collect::<Vec<_>>(),
        "routes": out.routes,
    });
    if out.leader {
        config["leader_election"] = json!({ "enabled": true });
    }
    Ok(Conversion {
        config,
        notes: notes.0,
    })
}

/// Which exporters each k8sobjects receiver feeds, through the logs pipelines (and the
/// connectors between them).
fn feeds<'a>(
    doc: &Value,
    receivers: &BTreeMap<&'a str, &Value>,
    notes: &mut Notes,
) -> BTreeMap<&'a str, BTreeSet<String>> {
    let mut feeds: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let pipelines = doc.pointer("/service/pipelines").and_then(Value::as_object);
    for (pname, p) in pipelines.into_iter().flatten() {
        let ins: Vec<String> = strings(p, "receivers");
        let ours: Vec<&str> = receivers
            .keys()
            .copied()
            .filter(|r| ins.iter().any(|i| i == r))
            .collect();
        if ours.is_empty() {
            continue;
        }
        for processor in strings(p, "processors") {
            notes.add(format!(
                "service.pipelines.{pname}.processors: {processor} is not applied (filters \
                 are CEL expressions here: resources[].filter, publish_if, ignore_fields)"
            ));
        }
        for r in ours {
            feeds.entry(r).or_default().extend(strings(p, "exporters"));
        }
    }
    // Connectors (`connectors:`, e.g. `forward`) are an exporter of one pipeline and a
    // receiver of others: follow them to the exporters those pipelines feed.
    let connectors = doc.get("connectors").and_then(Value::as_object);
    let is_connector = |name: &str| connectors.is_some_and(|c| c.contains_key(name));
    for targets in feeds.values_mut() {
        let mut seen = BTreeSet::new();
        while let Some(c) = targets
            .iter()
            .find(|t| is_connector(t) && !seen.contains(*t))
            .cloned()
        {
            seen.insert(c.clone());
            targets.remove(&c);
            for p in pipelines.into_iter().flat_map(|p| p.values()) {
                if strings(p, "receivers").contains(&c) {
                    targets.extend(strings(p, "exporters"));
                }
            }
        }
        targets.retain(|t| !seen.contains(t));
        for c in &seen {
            notes.add(format!(
                "connectors.{c}: followed to the pipelines it feeds; its own settings (routing \
                 conditions, for one) are not applied"
            ));
        }
    }
    feeds
}

/// Sinks from the exporters that are fed, by exporter name.
fn sinks(
    doc: &Value,
    feeds: &BTreeMap<&str, BTreeSet<String>>,
    notes: &mut Notes,
) -> BTreeMap<String, Value> {
    let exporters = doc.get("exporters").and_then(Value::as_object);
    let mut sinks: BTreeMap<String, Value> = BTreeMap::new();
    let fed: BTreeSet<&String> = feeds.values().flatten().collect();
    for name in fed {
        let Some(exporter) = exporters.and_then(|e| e.get(name.as_str())) else {
            notes.add(format!(
                "service.pipelines: exporter {name} is not defined under `exporters`"
            ));
            continue;
        };
        if let Some(sink) = sink(name, exporter, notes) {
            sinks.insert(name.clone(), sink);
        }
    }
    sinks
}

/// The resources and routes made of the receivers' objects so far.
#[derive(Default)]
struct Receivers {
    resources: Vec<Value>,
    routes: Vec<Value>,
    /// Resource names taken.
    names: BTreeSet<String>,
    /// A receiver feeds no exporter the bridge has: its objects go to standard output.
    need_stdout: bool,
    /// A receiver used the Collector's leader elector.
    leader: bool,
}

impl Receivers {
    /// The resources and routes of receiver `rname`: one per object it lists, routed to the
    /// sinks it feeds.
    fn add(
        &mut self,
        rname: &str,
        receiver: &Value,
        feeds: &BTreeMap<&str, BTreeSet<String>>,
        sinks: &BTreeMap<String, Value>,
        notes: &mut Notes,
    ) {
        let path = format!("receivers.{rname}");
        unused(
            receiver,
            &["objects", "auth_type", "k8s_leader_elector", "error_mode"],
            &path,
            notes,
        );
        match text(receiver, "auth_type").as_deref() {
            None | Some("serviceAccount") | Some("kubeConfig") => {}
            Some(other) => notes.add(format!(
                "{path}.auth_type: {other}: the bridge uses $KUBECONFIG, ~/.kube/config or \
                 the pod's service account, in that order"
            )),
        }
        if text(receiver, "k8s_leader_elector").is_some() {
            self.leader = true;
            notes.add(format!(
                "{path}.k8s_leader_elector: replaced by leader_election (a Lease of the \
                 bridge's own; see the Scaling and leader election chapter)"
            ));
        }
        let targets: Vec<String> = feeds
            .get(rname)
            .map(|f| {
                f.iter()
                    .filter(|e| sinks.contains_key(e.as_str()))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let targets = if targets.is_empty() {
            self.need_stdout = true;
            notes.add(format!(
                "{path}: no logs pipeline takes it to an exporter the bridge has (kafka, \
                 debug, logging, file); its objects go to standard output"
            ));
            vec!["stdout".to_owned()]
        } else {
            targets
        };
        let objects = receiver
            .get("objects")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if objects.is_empty() {
            notes.add(format!("{path}.objects: empty; nothing to watch"));
        }
        let prefix = rname
            .split_once('/')
            .map(|(_, n)| format!("{n}-"))
            .unwrap_or_default();
        for (i, object) in objects.iter().enumerate() {
            let opath = format!("{path}.objects[{i}]");
            let Some(resource) = resource(object, &opath, notes) else {
                continue;
            };
            let base = format!(
                "{prefix}{}",
                resource["name"].as_str().expect("resource() names it")
            );
            let mut name = base.clone();
            let mut n = 2;
            while !self.names.insert(name.clone()) {
                name = format!("{base}-{n}");
                n += 1;
            }
            let mut resource = resource;
            resource["name"] = json!(name);
            self.resources.push(resource);
            self.routes
                .push(json!({ "resource": name, "sinks": targets }));
        }
    }
}

/// `name` is `kind` or `kind/anything`.
fn is_component(name: &str, kind: &str) -> bool {
    name == kind || name.strip_prefix(kind).is_some_and(|r| r.starts_with('/'))
}

/// One `objects[]` entry as a `resources[]` entry (named after the plural, `.group` added).
fn resource(object: &Value, path: &str, notes: &mut Notes) -> Option<Value> {
    unused(
        object,
        &[
            "name",
            "group",
            "mode",
            "interval",
            "label_selector",
            "field_selector",
            "namespaces",
            "exclude_watch_type",
            "resource_version",
        ],
        path,
        notes,
    );
    let Some(plural) = text(object, "name") else {
        notes.add(format!("{path}: no `name`; left out"));
        return None;
    };
    let group = text(object, "group");
    let known = BUILT_IN.iter().find(|(p, g, _, _)| {
        *p == plural
            && group
                .as_deref()
                .is_none_or(|want| want == *g || (want == "core" && g.is_empty()))
    });
    let (group, api_version, kind) = match known {
        Some((_, g, v, k)) => {
            let av = if g.is_empty() {
                (*v).to_owned()
            } else {
                format!("{g}/{v}")
            };
            ((*g).to_owned(), av, (*k).to_owned())
        }
        None => {
            let g = group.unwrap_or_default();
            let kind = kind_of(&plural);
            let av = if g.is_empty() {
                "v1".to_owned()
            } else {
                format!("{g}/v1")
            };
            notes.add(format!(
                "{path}: {plural} is not a built-in kind: guessed kind {kind} and apiVersion \
                 {av}; check them with `kubectl api-resources`"
            ));
            (g, av, kind)
        }
    };
    let name = if group.is_empty() {
        plural.clone()
    } else {
        format!("{plural}.{group}")
    };
    let mut r = json!({ "name": name, "api_version": api_version, "kind": kind });
    let namespaces = strings(object, "namespaces");
    if namespaces.iter().any(|n| n.contains("${")) {
        notes.add(format!(
            "{path}.namespaces: {namespaces:?} names environment variables, which the \
             Collector expands; every namespace is watched: set namespaces by hand"
        ));
    } else if !namespaces.is_empty() {
        r["namespaces"] = json!(namespaces);
    }
    if let Some(s) = text(object, "label_selector") {
        r["label_selector"] = json!(s);
    }
    if let Some(s) = text(object, "field_selector") {
        r["field_selector"] = json!(s);
    }
    let mut events = vec!["added", "updated", "deleted"];
    let watch = text(object, "mode").as_deref() == Some("watch");
    match text(object, "mode").as_deref() {
        Some("watch") => {}
        None | Some("pull") => {
            let interval =
                text(object, "interval").unwrap_or_else(|| DEFAULT_PULL_INTERVAL.to_owned());
            r["resync_period"] = json!(interval);
            events.push("synced");
            notes.add(format!(
                "{path}.mode: pull lists every {interval}; the bridge watches, publishes every \
                 change, and re-publishes each object as `synced` every {interval} \
                 (resync_period)"
            ));
        }
        Some(other) => {
            notes.add(format!(
                "{path}.mode: {other} is not pull or watch; watching"
            ));
        }
    }
    // The receiver applies it in watch mode only.
    let excluded = if watch {
        strings(object, "exclude_watch_type")
    } else {
        Vec::new()
    };
    for excluded in excluded {
        let ours = match excluded.to_ascii_uppercase().as_str() {
            "ADDED" => "added",
            "MODIFIED" => "updated",
            "DELETED" => "deleted",
            // Never published by the bridge in the first place.
            "BOOKMARK" | "ERROR" => continue,
            _ => {
                notes.add(format!(
                    "{path}.exclude_watch_type: {excluded} is not ADDED, MODIFIED or DELETED"
                ));
                continue;
            }
        };
        events.retain(|e| *e != ours);
    }
    if events.is_empty() {
        notes.add(format!(
            "{path}.exclude_watch_type: excludes every event type; nothing would be \
             published, so the entry is left out"
        ));
        return None;
    }
    r["events"] = json!(events);
    if text(object, "resource_version").is_some() {
        notes.add(format!(
            "{path}.resource_version: no equivalent: the bridge starts from a consistent list \
             and, with sinks[].resume, from what it last published"
        ));
    }
    Some(r)
}

/// `widgets` → `Widget`, `policies` → `Policy`, `ingresses` → `Ingress`.
fn kind_of(plural: &str) -> String {
    let singular = if let Some(s) = plural.strip_suffix("ies") {
        format!("{s}y")
    } else if ["sses", "xes", "ches", "shes"]
        .iter()
        .any(|e| plural.ends_with(e))
    {
        plural[..plural.len() - 2].to_owned()
    } else {
        plural.strip_suffix('s').unwrap_or(plural).to_owned()
    };
    let clean: String = singular
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let mut chars = clean.chars();
    match chars.next() {
        Some(c) => c.to_ascii_uppercase().to_string() + chars.as_str(),
        None => "Unknown".into(),
    }
}

/// A sink for an exporter the bridge has an equivalent of.
fn sink(name: &str, exporter: &Value, notes: &mut Notes) -> Option<Value> {
    let path = format!("exporters.{name}");
    if is_component(name, "debug") || is_component(name, "logging") {
        unused(exporter, &[], &path, notes);
        return Some(json!({ "name": name, "type": "stdout" }));
    }
    if is_component(name, "file") {
        unused(exporter, &["path"], &path, notes);
        let mut s = json!({ "name": name, "type": "stdout" });
        if let Some(p) = text(exporter, "path") {
            s["stdout"] = json!({ "path": p });
        }
        return Some(s);
    }
    if !is_component(name, "kafka") {
        notes.add(format!(
            "{path}: no equivalent (the bridge's sinks are Kafka, NATS and stdout); left out"
        ));
        return None;
    }
    unused(
        exporter,
        &[
            "brokers",
            "topic",
            "logs",
            "client_id",
            "auth",
            "tls",
            "producer",
            "encoding",
            "protocol_version",
        ],
        &path,
        notes,
    );
    let brokers = {
        let b = strings(exporter, "brokers");
        if b.is_empty() {
            vec!["localhost:9092".to_owned()]
        } else {
            b
        }
    };
    let topic = exporter
        .get("logs")
        .and_then(|l| text(l, "topic"))
        .or_else(|| text(exporter, "topic"))
        .unwrap_or_else(|| "otlp_logs".into());
    for value in brokers.iter().chain([&topic]) {
        if value.contains("${") {
            notes.add(format!(
                "{path}: {value:?} names an environment variable, which the Collector expands \
                 and the bridge does not; expand it by hand"
            ));
        }
    }
    let mut kafka = json!({ "brokers": brokers, "topic": topic });
    let mut properties = serde_json::Map::new();
    if let Some(id) = text(exporter, "client_id") {
        properties.insert("client.id".into(), json!(id));
    }
    if let Some(enc) = text(exporter, "encoding")
        .or_else(|| exporter.get("logs").and_then(|l| text(l, "encoding")))
    {
        notes.add(format!(
            "{path}.encoding: {enc}: messages are CloudEvents JSON (sinks[].kafka.encoding: \
             structured or binary), not OTLP log records"
        ));
    }
    if text(exporter, "protocol_version").is_some() {
        notes.add(format!(
            "{path}.protocol_version: not needed (librdkafka negotiates the version)"
        ));
    }
    if let Some(producer) = exporter.get("producer") {
        producer_settings(producer, &path, &mut kafka, &mut properties, notes);
    }
    if let Some(tls) = exporter
        .get("tls")
        .or_else(|| exporter.pointer("/auth/tls"))
        && let Some(ours) = kafka_tls(tls, &format!("{path}.tls"), notes)
    {
        kafka["tls"] = ours;
    }
    if let Some(sasl) = exporter.pointer("/auth/sasl") {
        let spath = format!("{path}.auth.sasl");
        unused(sasl, &["username", "password", "mechanism"], &spath, notes);
        let mechanism = text(sasl, "mechanism").unwrap_or_else(|| "PLAIN".into());
        match mechanism.to_ascii_uppercase().as_str() {
            m @ ("PLAIN" | "SCRAM-SHA-256" | "SCRAM-SHA-512") => {
                kafka["sasl"] = kafka_sasl(m, sasl, &spath, name, notes);
            }
            other => notes.add(format!(
                "{spath}.mechanism: {other} has no equivalent (PLAIN, SCRAM-SHA-256 and \
                 SCRAM-SHA-512 are); no SASL configured"
            )),
        }
    }
    if let Some(auth) = exporter.get("auth") {
        unused(auth, &["sasl", "tls"], &format!("{path}.auth"), notes);
    }
    if !properties.is_empty() {
        kafka["properties"] = Value::Object(properties);
    }
    Some(json!({ "name": name, "type": "kafka", "kafka": kafka }))
}

/// An exporter's `producer` settings as the Kafka sink's (`compression`) and librdkafka
/// `properties`.
fn producer_settings(
    producer: &Value,
    path: &str,
    kafka: &mut Value,
    properties: &mut serde_json::Map<String, Value>,
    notes: &mut Notes,
) {
    unused(
        producer,
        &["compression", "max_message_bytes"],
        &format!("{path}.producer"),
        notes,
    );
    if let Some(c) = text(producer, "compression") {
        match compression(&c) {
            Some(ours) => kafka["compression"] = json!(ours),
            None => notes.add(format!(
                "{path}.producer.compression: {c} is not none, gzip, snappy, lz4 or zstd"
            )),
        }
    }
    if let Some(m) = text(producer, "max_message_bytes") {
        properties.insert("message.max.bytes".into(), json!(m));
    }
}

/// An exporter's `tls` settings as the Kafka sink's, or `None` for plain text.
fn kafka_tls(tls: &Value, tpath: &str, notes: &mut Notes) -> Option<Value> {
    unused(
        tls,
        &[
            "ca_file",
            "cert_file",
            "key_file",
            "insecure",
            "insecure_skip_verify",
        ],
        tpath,
        notes,
    );
    if flag(tls, "insecure") {
        notes.add(format!(
            "{tpath}.insecure: true (plain text): the bridge connects without TLS when \
             `tls` is unset"
        ));
        None
    } else {
        let mut t = serde_json::Map::new();
        for key in ["ca_file", "cert_file", "key_file"] {
            if let Some(v) = text(tls, key) {
                t.insert(key.into(), json!(v));
            }
        }
        if flag(tls, "insecure_skip_verify") {
            notes.add(format!(
                "{tpath}.insecure_skip_verify: not offered: the bridge always verifies \
                 the brokers' certificates (set ca_file)"
            ));
        }
        Some(Value::Object(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_from_plurals() {
        assert_eq!(kind_of("widgets"), "Widget");
        assert_eq!(kind_of("policies"), "Policy");
        assert_eq!(kind_of("gatewayclasses"), "Gatewayclass");
        assert_eq!(kind_of("boxes"), "Box");
    }
}
