//! Keeps the book's configuration reference (`docs/src/config-reference.md`) in sync with the
//! settings structs (assembled in `src/config/`, each component's beside it): every field's
//! `///` line and default must appear in that table, verbatim. On failure the test prints the
//! table to paste.

use kube_event_bridge::config::Config;
use serde_json::{Value, json};

/// Where each config struct sits in the YAML document; a struct used in several sections (or
/// flattened into one) is listed once per section.
const SECTIONS: &[(&str, &str)] = &[
    ("Config", ""),
    ("KubernetesConfig", "kubernetes."),
    ("AdminConfig", "admin."),
    ("LogConfig", "log."),
    ("MessageConfig", "message."),
    ("ShutdownConfig", "shutdown."),
    ("LeaderElectionConfig", "leader_election."),
    ("ShardingConfig", "sharding."),
    ("ResourceConfig", "resources[]."),
    ("SinkConfig", "sinks[]."),
    ("RetryConfig", "sinks[].retry."),
    ("RateLimitConfig", "sinks[].rate_limit."),
    ("StdoutSinkConfig", "sinks[].stdout."),
    ("RouteConfig", "routes[]."),
    ("NatsSinkConfig", "sinks[].nats."),
    ("NatsAuthConfig", "sinks[].nats.auth."),
    ("TlsFiles", "sinks[].nats.tls."),
    ("NatsStreamConfig", "sinks[].nats.stream."),
    ("KafkaSinkConfig", "sinks[].kafka."),
    ("KafkaTlsConfig", "sinks[].kafka.tls."),
    ("TlsFiles", "sinks[].kafka.tls."),
    ("KafkaSaslConfig", "sinks[].kafka.sasl."),
    ("KafkaTopicsConfig", "sinks[].kafka.create_topics."),
    ("SecretRef", "(secret)."),
];

/// The files whose structs make up the configuration.
const SOURCES: &[&str] = &[
    include_str!("../src/config/mod.rs"),
    include_str!("../src/config/resource.rs"),
    include_str!("../src/config/sink.rs"),
    include_str!("../src/cluster.rs"),
    include_str!("../src/admin.rs"),
    include_str!("../src/leader/settings.rs"),
    include_str!("../src/shard.rs"),
    include_str!("../src/message/mod.rs"),
    include_str!("../src/sinks/secret.rs"),
    include_str!("../src/sinks/tls.rs"),
    include_str!("../src/sinks/stdout/config.rs"),
    include_str!("../src/sinks/nats/config.rs"),
    include_str!("../src/sinks/kafka/config.rs"),
];

fn minimal_input() -> Value {
    json!({
        "resources": [{"api_version": "v1", "kind": "ConfigMap"}],
        "sinks": [{"name": "out", "type": "stdout"}],
        "routes": [{"resource": "configmap", "sinks": ["out"]}],
    })
}

fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |v, seg| match seg.strip_suffix("[]") {
            Some(list) => v.get(list)?.get(0),
            None => v.get(seg),
        })
}

/// Optional sections, with their required fields, so that their own fields' defaults show.
fn with_optional_sections() -> Value {
    let mut v = minimal_input();
    v["sinks"][0]["rate_limit"] = json!({"qps": 100.0});
    v["sinks"][0]["stdout"] = json!({});
    v
}

/// A config whose first sink is a minimal Kafka sink; with `sections`, its optional sections
/// are present with their required fields.
fn with_kafka(sections: bool) -> Value {
    let mut v = minimal_input();
    v["sinks"][0] =
        json!({"name": "out", "type": "kafka", "kafka": {"brokers": ["localhost:9092"]}});
    if sections {
        let k = &mut v["sinks"][0]["kafka"];
        k["sasl"] = json!({"mechanism": "PLAIN", "username": "u", "password": {"env": "P"}});
        k["create_topics"] = json!({});
        k["tls"] = json!({});
    }
    v
}

/// A config whose first sink is a minimal NATS sink.
fn with_nats() -> Value {
    let mut v = minimal_input();
    v["sinks"][0] = json!({"name": "out", "type": "nats", "nats": {
        "servers": ["nats://localhost:4222"],
        "stream": {"name": "K8S"},
    }});
    v
}

/// `(yaml path, doc, default)` for every field, from the source.
fn fields() -> Vec<(String, String, String)> {
    let src = SOURCES.join("\n");
    let src = src.as_str();
    let minimal = minimal_input();
    let sections = with_optional_sections();
    let nats = with_nats();
    let (kafka, kafka_sections) = (with_kafka(false), with_kafka(true));
    let effective_of =
        |v: &Value| serde_json::to_value(Config::from_value(v.clone()).unwrap()).unwrap();
    let (minimal_effective, sections_effective, nats_effective) = (
        effective_of(&minimal),
        effective_of(&sections),
        effective_of(&nats),
    );
    let (kafka_effective, kafka_sections_effective) =
        (effective_of(&kafka), effective_of(&kafka_sections));
    let mut out = Vec::new();
    let mut prefixes: Vec<&str> = Vec::new();
    let mut doc: Vec<String> = Vec::new();
    let mut rename: Option<String> = None;
    let mut flattened = false;
    let mut seen_structs = Vec::new();
    for line in src.lines().map(str::trim) {
        if let Some(name) = line
            .strip_prefix("pub struct ")
            .and_then(|l| l.strip_suffix(" {"))
        {
            prefixes = SECTIONS
                .iter()
                .filter(|(s, _)| *s == name)
                .map(|(_, p)| *p)
                .collect();
            if line.starts_with("pub struct")
                && src.contains(&format!(
                    "#[serde(deny_unknown_fields)]\npub struct {name} {{"
                ))
            {
                assert!(
                    !prefixes.is_empty(),
                    "config struct {name} is missing from SECTIONS in this test"
                );
                seen_structs.push(name.to_owned());
            }
            doc.clear();
            continue;
        }
        if line == "}" {
            prefixes.clear();
        }
        if prefixes.is_empty() {
            continue;
        }
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim().to_owned());
        } else if line == "#[serde(flatten)]" {
            // The flattened struct's fields are listed under this section (see SECTIONS).
            flattened = true;
        } else if let Some(r) = line
            .strip_prefix("#[serde(rename = \"")
            .and_then(|r| r.split('"').next())
        {
            rename = Some(r.to_owned());
        } else if let Some(field) = line.strip_prefix("pub ").and_then(|l| l.split(':').next()) {
            let name = rename.take().unwrap_or_else(|| field.to_owned());
            if std::mem::take(&mut flattened) {
                doc.clear();
                continue;
            }
            for prefix in &prefixes {
                let path = format!("{prefix}{name}");
                // A field of an optional section is described as if the section were present.
                let in_optional_section = path.matches('.').count() > 1;
                let kafka_section = [
                    "sinks[].kafka.sasl.",
                    "sinks[].kafka.tls.",
                    "sinks[].kafka.create_topics.",
                ];
                let (input, effective) = if kafka_section.iter().any(|p| path.starts_with(p)) {
                    (&kafka_sections, &kafka_sections_effective)
                } else if path.starts_with("sinks[].kafka.") {
                    (&kafka, &kafka_effective)
                } else if path.starts_with("sinks[].nats.") {
                    (&nats, &nats_effective)
                } else if in_optional_section {
                    (&sections, &sections_effective)
                } else {
                    (&minimal, &minimal_effective)
                };
                let default = if path.starts_with("(secret).") {
                    "one of file, env".to_owned()
                } else if lookup(input, &path).is_some() {
                    "required".to_owned()
                } else {
                    match lookup(effective, &path) {
                        None | Some(Value::Null) => "unset".to_owned(),
                        Some(Value::Object(m)) if m.is_empty() => "`{}`".to_owned(),
                        Some(Value::Object(_)) => "see below".to_owned(),
                        Some(v) => format!("`{v}`"),
                    }
                };
                out.push((path, doc.join(" "), default));
            }
            doc.clear();
        } else if !line.starts_with("#[") {
            doc.clear();
        }
    }
    let mut sections: Vec<&str> = SECTIONS.iter().map(|(s, _)| *s).collect();
    sections.sort_unstable();
    sections.dedup();
    assert_eq!(
        seen_structs.len(),
        sections.len(),
        "every section maps to a struct: {seen_structs:?}"
    );
    out
}

#[test]
fn readme_config_reference_matches_the_code() {
    let readme = include_str!("../docs/src/config-reference.md");
    let rows: Vec<String> = fields()
        .into_iter()
        .map(|(path, doc, default)| format!("| `{path}` | {default} | {doc} |"))
        .collect();
    let missing: Vec<&String> = rows
        .iter()
        .filter(|r| !readme.contains(r.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/src/config-reference.md is out of date. Expected table:\n\n| field | default | meaning |\n|---|---|---|\n{}\n",
        rows.join("\n")
    );
}
