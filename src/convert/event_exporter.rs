//! From a kubernetes-event-exporter config (`route`, `receivers`): core `v1` Events, added
//! and updated (the exporter ignores deletes), one resource per receiver that a route reaches,
//! its route tree compiled into that resource's CEL `publish_if` (per event, as the exporter
//! routes each addition and update).
//!
//! The route tree, as the exporter walks it (`pkg/exporter/route.go`): a route drops the event
//! if any `drop` rule matches; otherwise each `match` rule that matches sends it to the rule's
//! receiver; only if every `match` rule matched does it go down the sub-routes. Rule fields are
//! Go regular expressions searched in the field (CEL's `matches` searches too, with Rust's
//! `regex`: the syntax both share carries over; a pattern beyond it is left out where that
//! widens what is published, see [`portable`]), all of a rule's fields must match, and
//! `minCount` compares with the Event's `count`. So a
//! receiver gets an event when, along some path to one of its rules, no `drop` on the way
//! matched, every `match` of each ancestor matched, and the rule itself matched.
//!
//! `labels` and `annotations` of a rule are the involved object's, which the exporter fetches
//! per event and the bridge does not: a `match` rule loses those conditions (more events pass)
//! and a `drop` rule that has them is left out (fewer are dropped): a superset either way.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::{
    Conversion, Error, Notes, Result, compression, flag, kafka_sasl, strings, text, unused,
};

/// The rule fields that are compared with the Event, and the CEL that reads each (`""` when
/// absent, as the exporter compares Go's zero value).
const FIELDS: &[(&str, &str)] = &[
    ("message", "(has(object.message) ? object.message : \"\")"),
    (
        "apiVersion",
        "(has(object.involvedObject) && has(object.involvedObject.apiVersion) ? object.involvedObject.apiVersion : \"\")",
    ),
    (
        "kind",
        "(has(object.involvedObject) && has(object.involvedObject.kind) ? object.involvedObject.kind : \"\")",
    ),
    (
        "namespace",
        "(has(object.metadata.namespace) ? object.metadata.namespace : \"\")",
    ),
    ("reason", "(has(object.reason) ? object.reason : \"\")"),
    ("type", "(has(object.type) ? object.type : \"\")"),
    (
        "component",
        "(has(object.source) && has(object.source.component) ? object.source.component : \"\")",
    ),
    (
        "host",
        "(has(object.source) && has(object.source.host) ? object.source.host : \"\")",
    ),
];

/// A condition: an OR of ANDs of CEL terms. `[]` is false, `[[]]` is true.
type Dnf = Vec<Vec<String>>;

/// Converts a kubernetes-event-exporter config.
pub(crate) fn convert(doc: &Value) -> Result<Conversion> {
    let (Some(route), Some(receivers)) = (
        doc.get("route"),
        doc.get("receivers").and_then(Value::as_array),
    ) else {
        return Err(Error::Format(
            "no `route` and `receivers`: is this a kubernetes-event-exporter config?".into(),
        ));
    };
    let mut notes = Notes::default();
    unused(
        doc,
        &[
            "route",
            "receivers",
            "logLevel",
            "logFormat",
            "clusterName",
            "namespace",
            "kubeQPS",
            "kubeBurst",
            "leaderElection",
            "maxEventAgeSeconds",
            "throttlePeriod",
        ],
        "",
        &mut notes,
    );
    let mut config = json!({});

    // Where each receiver's events come from.
    let mut reach: BTreeMap<String, Dnf> = BTreeMap::new();
    walk(route, "route", &[], &mut reach, &mut notes);

    let mut resources = Vec::new();
    let mut sinks = Vec::new();
    let mut routes = Vec::new();
    for (i, receiver) in receivers.iter().enumerate() {
        let path = format!("receivers[{i}]");
        let Some(name) = text(receiver, "name") else {
            notes.add(format!("{path}: no `name`; left out"));
            continue;
        };
        let Some(condition) = reach.remove(&name) else {
            notes.add(format!(
                "{path} ({name}): no route sends events to it; left out"
            ));
            continue;
        };
        sinks.push(sink(&name, receiver, &path, &mut notes));
        let resource_name = format!("events-to-{name}");
        let mut resource = json!({
            "name": resource_name,
            "api_version": "v1",
            "kind": "Event",
            "events": ["added", "updated"],
        });
        match text(doc, "namespace") {
            // Said once, for the first resource.
            Some(ns) if expanded_by_the_exporter(&ns) && resources.is_empty() => {
                notes.add(format!(
                    "namespace: {ns:?} names an environment variable (the exporter expands \
                     it); every namespace is watched: set resources[].namespaces by hand"
                ));
            }
            Some(ns) if expanded_by_the_exporter(&ns) => {}
            Some(ns) => resource["namespaces"] = json!([ns]),
            None => {}
        }
        // Per event, as the exporter routes each addition and update on its own (a `filter`
        // would make an Event that starts matching enter as `added`).
        if let Some(filter) = cel(&condition) {
            resource["publish_if"] = json!(filter);
        }
        resources.push(resource);
        routes.push(json!({ "resource": resource_name, "sinks": [name] }));
    }
    for name in reach.keys() {
        notes.add(format!(
            "route: receiver {name} is not defined under `receivers`"
        ));
    }
    if resources.is_empty() {
        return Err(Error::Format(
            "no route sends events to a defined receiver".into(),
        ));
    }
    config["resources"] = json!(resources);
    config["sinks"] = json!(sinks);
    config["routes"] = json!(routes);

    if let Some(cluster) = text(doc, "clusterName") {
        config["cluster"] = json!(cluster);
    }
    if let Some(level) = text(doc, "logLevel") {
        let ours = match level.to_ascii_lowercase().as_str() {
            "trace" => "trace",
            "debug" => "debug",
            "info" => "info",
            "warn" | "warning" => "warn",
            "error" | "fatal" | "panic" => "error",
            "disabled" => "off",
            _ => {
                notes.add(format!("logLevel: {level} is not a level; info"));
                "info"
            }
        };
        config["log"]["level"] = json!(ours);
    }
    if let Some(format) = text(doc, "logFormat") {
        config["log"]["format"] = json!(if format == "json" { "json" } else { "pretty" });
    }
    if let Some(qps) = doc.get("kubeQPS").and_then(Value::as_f64) {
        config["kubernetes"]["qps"] = json!(qps);
    }
    if let Some(burst) = doc.get("kubeBurst").and_then(Value::as_u64) {
        config["kubernetes"]["burst"] = json!(burst);
    }
    if let Some(le) = doc.get("leaderElection") {
        unused(
            le,
            &["enabled", "leaderElectionID"],
            "leaderElection",
            &mut notes,
        );
        if flag(le, "enabled") {
            config["leader_election"] = json!({ "enabled": true });
            if let Some(id) = text(le, "leaderElectionID") {
                config["leader_election"]["lease_name"] = json!(id);
            }
        }
    }
    for key in ["maxEventAgeSeconds", "throttlePeriod"] {
        if let Some(age) = text(doc, key) {
            notes.add(format!(
                "{key}: {age}: the exporter skips Events older than this; the bridge publishes \
                 every Event it has not published, and with sinks[].resume none twice across \
                 restarts"
            ));
        }
    }
    Ok(Conversion {
        config,
        notes: notes.0,
    })
}

/// Collects, for each receiver, the conditions under which `route` sends it an event, given
/// the conditions `above` that brought the event to `route`.
fn walk(
    route: &Value,
    path: &str,
    above: &[String],
    reach: &mut BTreeMap<String, Dnf>,
    notes: &mut Notes,
) {
    unused(route, &["drop", "match", "routes"], path, notes);
    let mut here: Vec<String> = above.to_vec();
    let drops: Vec<Vec<String>> = rules(route, "drop")
        .iter()
        .enumerate()
        .filter_map(|(i, r)| rule(r, &format!("{path}.drop[{i}]"), true, notes))
        .collect();
    if let Some(any) = or(&drops) {
        here.push(format!("!({any})"));
    }
    let matches: Vec<(Option<String>, Vec<String>)> = rules(route, "match")
        .iter()
        .enumerate()
        .map(|(i, r)| {
            (
                text(r, "receiver"),
                rule(r, &format!("{path}.match[{i}]"), false, notes).unwrap_or_default(),
            )
        })
        .collect();
    for (receiver, terms) in &matches {
        if let Some(receiver) = receiver {
            let mut path_terms = here.clone();
            path_terms.extend(terms.iter().cloned());
            reach.entry(receiver.clone()).or_default().push(path_terms);
        }
    }
    let mut below = here;
    for (_, terms) in &matches {
        below.extend(terms.iter().cloned());
    }
    for (i, sub) in rules(route, "routes").iter().enumerate() {
        walk(sub, &format!("{path}.routes[{i}]"), &below, reach, notes);
    }
}

fn rules<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// One rule as the AND of its terms (`[]`: matches everything). A drop rule with conditions
/// the bridge cannot evaluate gives `None` (it drops nothing).
fn rule(r: &Value, path: &str, drop: bool, notes: &mut Notes) -> Option<Vec<String>> {
    let mut known: Vec<&str> = FIELDS.iter().map(|(f, _)| *f).collect();
    known.extend(["minCount", "receiver", "labels", "annotations"]);
    unused(r, &known, path, notes);
    // A drop rule read with less than it says (a YAML merge key `<<` the exporter's reader
    // applies and ours does not, a field we do not know) would drop more: leave it out.
    let unknown = r
        .as_object()
        .is_some_and(|m| m.keys().any(|k| !known.contains(&k.as_str())));
    // A pattern written as a number or boolean (`reason: 1.10`) is re-rendered from the
    // parsed value (`1.1`), not the source text: as a drop condition it would drop more.
    let unquoted = FIELDS
        .iter()
        .any(|(f, _)| r.get(*f).is_some_and(|v| !v.is_string() && !v.is_null()));
    if drop && (unknown || unquoted) {
        notes.add(format!(
            "{path}: holds keys the bridge does not read or patterns that are not strings; \
             this drop rule is left out (nothing it would drop is dropped)"
        ));
        return None;
    }
    for key in ["labels", "annotations"] {
        if r.get(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            if drop {
                notes.add(format!(
                    "{path}.{key}: the involved object's {key} are not read by the bridge; \
                     this drop rule is left out (nothing it would drop is dropped)"
                ));
                return None;
            }
            notes.add(format!(
                "{path}.{key}: the involved object's {key} are not read by the bridge; the \
                 rule matches without them (a superset)"
            ));
        }
    }
    let mut terms = Vec::new();
    for (field, expr) in FIELDS {
        let Some(pattern) = text(r, field) else {
            continue;
        };
        if pattern.contains('$') && expanded_by_the_exporter(&pattern) {
            notes.add(format!(
                "{path}.{field}: {pattern:?} names an environment variable, which the \
                 exporter expands when it reads its file; expand it by hand"
            ));
        }
        if !portable(&pattern) {
            // Go's regexp and the bridge's (Rust's `regex`) may read it differently: leave
            // it out where that widens what is published.
            if drop {
                notes.add(format!(
                    "{path}.{field}: {pattern:?} uses escapes or flags that Go's regexp and the \
                     bridge's read differently; this drop rule is left out (nothing it would \
                     drop is dropped)"
                ));
                return None;
            }
            notes.add(format!(
                "{path}.{field}: {pattern:?} uses escapes or flags that Go's regexp and the \
                 bridge's read differently; the rule matches without it (a superset)"
            ));
            continue;
        }
        if regex::Regex::new(&pattern).is_err() {
            // A pattern of the syntax both engines share that does not compile (`*test*`:
            // nothing to repeat) fails in Go's regexp too: the exporter never matches it.
            notes.add(format!(
                "{path}.{field}: {pattern:?} is not a regular expression; the exporter never \
                 matches it, nor does the converted filter"
            ));
            terms.push("false".to_owned());
            continue;
        }
        let literal = serde_json::to_string(&pattern).expect("a string serializes");
        terms.push(format!("{expr}.matches({literal})"));
    }
    if let Some(min) = r.get("minCount").and_then(Value::as_i64).filter(|m| *m > 0) {
        terms.push(format!("(has(object.count) ? object.count : 0) >= {min}"));
    }
    Some(terms)
}

/// Whether `pattern` uses only the syntax that Go's regexp and Rust's `regex` read alike:
/// no backslash escapes but of punctuation (`\.`, `\*`, …), no `(?` groups or flags, no
/// counted repetition (Go caps it at 1000). Perl classes (`\d`, `\w`, `\b`) are ASCII in Go and
/// Unicode in Rust; `\Q…\E` and octal escapes exist in Go only.
fn portable(pattern: &str) -> bool {
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e) if e.is_ascii_punctuation() => {}
                _ => return false,
            },
            '(' if chars.peek() == Some(&'?') => return false,
            '{' if chars.peek().is_some_and(char::is_ascii_digit) => return false,
            _ => {}
        }
    }
    true
}

/// Whether the exporter's `os.ExpandEnv` would replace part of `value` (`$NAME`, `${NAME}`).
fn expanded_by_the_exporter(value: &str) -> bool {
    value.match_indices('$').any(|(i, _)| {
        value[i + 1..]
            .chars()
            .next()
            .is_some_and(|c| c == '{' || c == '_' || c.is_ascii_alphabetic())
    })
}

/// `a || b` of AND-terms, `None` when there are none (false). A conjunction holding `false`
/// (a pattern that never matches) is left out.
fn or(dnf: &[Vec<String>]) -> Option<String> {
    let dnf: Vec<&Vec<String>> = dnf
        .iter()
        .filter(|c| !c.iter().any(|t| t == "false"))
        .collect();
    if dnf.is_empty() {
        return None;
    }
    if dnf.iter().any(|c| c.is_empty()) {
        return Some("true".into());
    }
    Some(
        dnf.iter()
            .map(|c| {
                if c.len() == 1 {
                    c[0].clone()
                } else {
                    format!("({})", c.join(" && "))
                }
            })
            .collect::<Vec<_>>()
            .join(" || "),
    )
}

/// The filter for a receiver's condition; `None` when it passes everything.
fn cel(dnf: &Dnf) -> Option<String> {
    if dnf.iter().any(Vec::is_empty) {
        return None;
    }
    Some(or(dnf).unwrap_or_else(|| "false".into()))
}

/// The sink for a receiver. One the bridge has no equivalent of becomes a `stdout` sink of
/// the same name, so that its routing carries over until it is pointed at a broker.
fn sink(name: &str, receiver: &Value, path: &str, notes: &mut Notes) -> Value {
    if let Some(stdout) = receiver.get("stdout") {
        unused(stdout, &[], &format!("{path}.stdout"), notes);
        return json!({ "name": name, "type": "stdout" });
    }
    if let Some(file) = receiver.get("file") {
        unused(file, &["path"], &format!("{path}.file"), notes);
        let mut s = json!({ "name": name, "type": "stdout" });
        if let Some(p) = text(file, "path").filter(|p| p != "/dev/stdout") {
            s["stdout"] = json!({ "path": p });
        }
        return s;
    }
    let Some(kafka) = receiver.get("kafka") else {
        let kind = receiver
            .as_object()
            .and_then(|m| m.keys().find(|k| *k != "name").cloned())
            .unwrap_or_default();
        notes.add(format!(
            "{path} ({name}): {kind} has no equivalent (the bridge's sinks are Kafka, NATS and \
             stdout); its events go to standard output: point the route at a Kafka or NATS sink"
        ));
        return json!({ "name": name, "type": "stdout" });
    };
    let kpath = format!("{path}.kafka");
    unused(
        kafka,
        &[
            "brokers",
            "topic",
            "clientId",
            "compressionCodec",
            "tls",
            "sasl",
            "layout",
        ],
        &kpath,
        notes,
    );
    let mut k = json!({
        "brokers": strings(kafka, "brokers"),
        "topic": text(kafka, "topic").unwrap_or_else(|| "kube-event".into()),
    });
    if let Some(id) = text(kafka, "clientId") {
        k["properties"] = json!({ "client.id": id });
    }
    if let Some(c) = text(kafka, "compressionCodec") {
        match compression(&c) {
            Some(ours) => k["compression"] = json!(ours),
            None => notes.add(format!(
                "{kpath}.compressionCodec: {c} is not none, gzip, snappy, lz4 or zstd"
            )),
        }
    }
    if kafka.get("layout").is_some_and(|l| !l.is_null()) {
        notes.add(format!(
            "{kpath}.layout: messages are CloudEvents with the whole Event as `data` (see \
             the message format); a custom layout has no equivalent"
        ));
    }
    if let Some(tls) = kafka.get("tls").filter(|t| flag(t, "enable")) {
        unused(
            tls,
            &[
                "enable",
                "certFile",
                "keyFile",
                "caFile",
                "insecureSkipVerify",
            ],
            &format!("{kpath}.tls"),
            notes,
        );
        let mut t = serde_json::Map::new();
        for (theirs, ours) in [
            ("caFile", "ca_file"),
            ("certFile", "cert_file"),
            ("keyFile", "key_file"),
        ] {
            if let Some(v) = text(tls, theirs) {
                t.insert(ours.into(), json!(v));
            }
        }
        if flag(tls, "insecureSkipVerify") {
            notes.add(format!(
                "{kpath}.tls.insecureSkipVerify: not offered: the bridge always verifies the \
                 brokers' certificates (set ca_file)"
            ));
        }
        k["tls"] = Value::Object(t);
    }
    if let Some(sasl) = kafka.get("sasl").filter(|s| flag(s, "enable")) {
        let spath = format!("{kpath}.sasl");
        unused(
            sasl,
            &["enable", "username", "password", "mechanism"],
            &spath,
            notes,
        );
        let mechanism = match text(sasl, "mechanism")
            .unwrap_or_else(|| "plain".into())
            .to_ascii_lowercase()
            .as_str()
        {
            "plain" => Some("PLAIN"),
            "sha256" | "scram-sha-256" => Some("SCRAM-SHA-256"),
            "sha512" | "scram-sha-512" => Some("SCRAM-SHA-512"),
            other => {
                notes.add(format!(
                    "{spath}.mechanism: {other} has no equivalent (plain, sha256 and sha512 \
                     do); no SASL configured"
                ));
                None
            }
        };
        if let Some(m) = mechanism {
            k["sasl"] = kafka_sasl(m, sasl, &spath, name, notes);
        }
    }
    json!({ "name": name, "type": "kafka", "kafka": k })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reach(route: Value) -> BTreeMap<String, Dnf> {
        let mut reach = BTreeMap::new();
        walk(&route, "route", &[], &mut reach, &mut Notes::default());
        reach
    }

    #[test]
    fn drops_guard_every_match_and_sub_routes_need_all_matches() {
        let r = reach(json!({
            "drop": [{"type": "Normal"}],
            "match": [{"receiver": "a"}, {"namespace": "shop"}],
            "routes": [{"match": [{"reason": "Killing", "receiver": "b"}]}]
        }));
        let not_normal = "!((has(object.type) ? object.type : \"\").matches(\"Normal\"))";
        let shop =
            "(has(object.metadata.namespace) ? object.metadata.namespace : \"\").matches(\"shop\")";
        assert_eq!(r["a"], vec![vec![not_normal.to_owned()]]);
        assert_eq!(r["b"][0][0], not_normal);
        assert_eq!(r["b"][0][1], shop);
        assert!(r["b"][0][2].contains("object.reason"));
    }

    #[test]
    fn a_drop_rule_with_labels_drops_nothing_and_an_invalid_pattern_never_matches() {
        let mut notes = Notes::default();
        assert_eq!(
            rule(
                &json!({"labels": {"a": "b"}, "type": "Normal"}),
                "d",
                true,
                &mut notes
            ),
            None
        );
        assert_eq!(
            rule(&json!({"namespace": "*test*"}), "d", true, &mut notes),
            Some(vec!["false".to_owned()])
        );
        assert_eq!(notes.0.len(), 2);
    }
}
