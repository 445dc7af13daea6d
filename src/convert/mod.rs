//! `convert`: a kube-event-bridge config from another exporter's, for users moving over.
//!
//! Each source format has its own reader ([`otel`] for the OpenTelemetry Collector's
//! `k8sobjects` receiver and its exporters, [`event_exporter`] for kubernetes-event-exporter);
//! both produce a [`Conversion`]: the config document and the list of what has no
//! equivalent. The rules every reader follows:
//!
//! - **A superset, never less.** Where a setting cannot be carried over exactly, the converted
//!   config publishes more than the source did, never less (a match condition with no
//!   equivalent is left out, a drop condition with no equivalent drops nothing), and the
//!   notes say so.
//! - **No secret is copied.** A password written inline in the source becomes a reference to
//!   an environment variable that the notes name; one the source already read from the
//!   environment (`${VAR}`, `${env:VAR}`) becomes a reference to that variable.
//! - **What is written loads.** The document is checked with [`Config::from_value`] before it
//!   is returned, so `check-config` accepts every config `convert` prints.

pub mod event_exporter;
pub mod otel;

use serde_json::{Map, Value, json};

use crate::config::Config;

/// What went wrong reading the source config.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is not YAML.
    #[error("cannot read it as YAML: {0}")]
    Yaml(Box<config::ConfigError>),
    /// The file is YAML but not the format named by `--from`.
    #[error("{0}")]
    Format(String),
    /// The converted document does not load: the source combines settings that have no
    /// equivalent together (two entries for one kind into one destination, say).
    #[error(
        "the converted config does not load, so the source has no direct equivalent; edit the \
         source or convert parts of it: {0}"
    )]
    Invalid(Box<crate::config::Error>),
}

/// `Result` of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The formats `convert` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// An OpenTelemetry Collector config with a `k8sobjects` receiver.
    OtelK8sObjects,
    /// A kubernetes-event-exporter config (`route`, `receivers`).
    KubernetesEventExporter,
}

/// A converted config and what did not carry over.
#[derive(Debug, Clone)]
pub struct Conversion {
    /// The kube-event-bridge config document.
    pub config: Value,
    /// Settings of the source with no equivalent (or only an approximate one), one line each,
    /// naming the source setting.
    pub notes: Vec<String>,
}

impl Conversion {
    /// The config as YAML, the notes first as comments.
    pub fn to_yaml(&self, source: Source, file: &str) -> String {
        let from = match source {
            Source::OtelK8sObjects => "the OpenTelemetry Collector's k8sobjects receiver",
            Source::KubernetesEventExporter => "kubernetes-event-exporter",
        };
        let file = one_line(file);
        let mut out = format!(
            "# Converted by `kube-event-bridge convert` from {file} ({from}).\n\
             # Check it with `kube-event-bridge check-config`; the book's chapter \"Moving from\n\
             # another exporter\" says how each setting maps.\n"
        );
        if self.notes.is_empty() {
            out.push_str("# Every setting of the source carried over.\n");
        } else {
            out.push_str("#\n# Not carried over exactly:\n");
            for note in &self.notes {
                out.push_str(&format!("# - {}\n", one_line(note)));
            }
        }
        write_yaml(&self.config, 0, &mut out);
        out
    }
}

/// `text` fit for one comment line: line breaks (which would end the comment) as spaces.
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r', '\u{85}', '\u{2028}', '\u{2029}'], " ")
}

/// Reads `text` as YAML into a document.
fn read_yaml(text: &str) -> Result<Value, config::ConfigError> {
    config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Yaml))
        .build()
        .and_then(|c| c.try_deserialize())
}

/// Reads `text` as `source` and converts it.
pub fn convert(source: Source, text: &str) -> Result<Conversion> {
    let doc = read_yaml(text).map_err(|e| Error::Yaml(Box::new(e)))?;
    if !doc.is_object() {
        return Err(Error::Format("the file holds no YAML mapping".into()));
    }
    let mut conversion = match source {
        Source::OtelK8sObjects => otel::convert(&doc)?,
        Source::KubernetesEventExporter => event_exporter::convert(&doc)?,
    };
    same_topic_notes(&mut conversion);
    // What is written is what is checked: the YAML text, read back as `run` reads it.
    let written = read_yaml(&conversion.to_yaml(source, "-"))
        .map_err(|e| Error::Format(format!("the converted YAML does not read back: {e}")))?;
    Config::from_value(written).map_err(|e| Error::Invalid(Box::new(e)))?;
    Ok(conversion)
}

/// Kafka sinks with the same brokers and topic: their routes have independent queues, so
/// messages of one object through two of them have no order between them in the topic.
fn same_topic_notes(conversion: &mut Conversion) {
    let kafka: Vec<(&str, &Value)> = conversion.config["sinks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s["name"].as_str()?, s.get("kafka")?)))
        .collect();
    let mut notes = Vec::new();
    for (i, (a, ka)) in kafka.iter().enumerate() {
        for (b, kb) in &kafka[i + 1..] {
            if ka["brokers"] == kb["brokers"] && ka["topic"] == kb["topic"] {
                notes.push(format!(
                    "sinks {a} and {b} write the same topic: an object's messages through the \
                     two have no order between them; make it one sink (one route per resource)"
                ));
            }
        }
    }
    conversion.notes.extend(notes);
}

/// Collects notes and hands out names that do not collide.
#[derive(Debug, Default)]
pub(crate) struct Notes(pub Vec<String>);

impl Notes {
    pub(crate) fn add(&mut self, note: impl Into<String>) {
        let note = note.into();
        if !self.0.contains(&note) {
            self.0.push(note);
        }
    }
}

/// The secret reference for a password read from the source: `$VAR`, `${VAR}`, `${env:VAR}`
/// (a `:-default` ignored) becomes `{env: VAR}`; an inline value is not copied, and
/// `{env: fallback}` is returned with a note asking for the variable to be set. A `KEB_*`
/// variable is not taken over: those are config overrides here.
pub(crate) fn secret(value: &str, fallback: &str, what: &str, notes: &mut Notes) -> Value {
    let var = value
        .strip_prefix("${")
        .and_then(|v| v.strip_suffix('}'))
        .map(|v| v.strip_prefix("env:").unwrap_or(v))
        .map(|v| v.split_once(":-").map_or(v, |(name, _)| name))
        .or_else(|| value.strip_prefix('$'))
        .filter(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    match var {
        Some(var) if var.starts_with("KEB_") => {
            notes.add(format!(
                "{what}: the environment variable {var} starts with KEB_, which are config \
                 overrides here; set {fallback} to the password instead"
            ));
            json!({ "env": fallback })
        }
        Some(var) => json!({ "env": var }),
        None => {
            notes.add(format!(
                "{what}: the password was written inline; it is not copied. Set the \
                 environment variable {fallback} to it (from a Secret), or point `file` at a \
                 mounted Secret"
            ));
            json!({ "env": fallback })
        }
    }
}

/// A `kafka.sasl` section: `mechanism` (kube-event-bridge's name), the user name, and the
/// password as a secret reference (see [`secret`]).
pub(crate) fn kafka_sasl(
    mechanism: &str,
    sasl: &Value,
    path: &str,
    sink: &str,
    notes: &mut Notes,
) -> Value {
    let password = secret(
        &text(sasl, "password").unwrap_or_default(),
        &env_name("KAFKA_PASSWORD", sink),
        &format!("{path}.password"),
        notes,
    );
    json!({
        "mechanism": mechanism,
        "username": text(sasl, "username").unwrap_or_default(),
        "password": password,
    })
}

/// An environment variable name from a sink name: `KAFKA_PASSWORD_MY_SINK`. Never `KEB_*`:
/// those are config overrides.
pub(crate) fn env_name(prefix: &str, sink: &str) -> String {
    let tail: String = sink
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}_{tail}")
}

/// kube-event-bridge's name for a Kafka compression codec, if it has one.
pub(crate) fn compression(codec: &str) -> Option<&'static str> {
    match codec.to_ascii_lowercase().as_str() {
        "" | "none" => Some("none"),
        "gzip" => Some("gzip"),
        "snappy" => Some("snappy"),
        "lz4" => Some("lz4"),
        "zstd" => Some("zstd"),
        _ => None,
    }
}

/// A string field of a mapping (numbers and booleans as their text; absent, null or empty:
/// `None`).
pub(crate) fn text(v: &Value, key: &str) -> Option<String> {
    match v.get(key)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// A list of strings (a single string counts as a list of one).
pub(crate) fn strings(v: &Value, key: &str) -> Vec<String> {
    match v.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| match x {
                Value::String(s) => Some(s.clone()),
                Value::Number(n) => Some(n.to_string()),
                Value::Bool(b) => Some(b.to_string()),
                _ => None,
            })
            .collect(),
        Some(Value::String(s)) if !s.is_empty() => vec![s.clone()],
        _ => Vec::new(),
    }
}

/// Whether a setting is set to true (YAML booleans, or the strings `true`/`yes`).
pub(crate) fn flag(v: &Value, key: &str) -> bool {
    match v.get(key) {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => matches!(s.to_ascii_lowercase().as_str(), "true" | "yes"),
        _ => false,
    }
}

/// The keys of a mapping that the reader did not use, as notes: nothing is dropped silently.
pub(crate) fn unused(v: &Value, used: &[&str], path: &str, notes: &mut Notes) {
    if let Value::Object(m) = v {
        for key in m.keys().filter(|k| !used.contains(&k.as_str())) {
            if !m[key].is_null() {
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                notes.add(format!("{at}: no equivalent"));
            }
        }
    }
}

// Keys first in this order (the rest alphabetical), so the document reads top-down.
const KEY_ORDER: &[&str] = &[
    "cluster",
    "name",
    "type",
    "api_version",
    "kind",
    "resource",
    "namespaces",
    "label_selector",
    "field_selector",
    "kubernetes",
    "log",
    "leader_election",
    "resources",
    "sinks",
    "routes",
];

/// Writes `v` as block-style YAML at `indent`.
fn write_yaml(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) => {
            for (k, val) in ordered(m) {
                out.push_str(&format!("{pad}{}:", scalar_text(k)));
                match val {
                    Value::Object(o) if !o.is_empty() => {
                        out.push('\n');
                        write_yaml(val, indent + 2, out);
                    }
                    Value::Array(a) if a.iter().any(|x| x.is_object() || x.is_array()) => {
                        out.push('\n');
                        write_yaml(val, indent + 2, out);
                    }
                    _ => out.push_str(&format!(" {}\n", inline(val))),
                }
            }
        }
        Value::Array(a) => {
            for item in a {
                if item.is_object() && item.as_object().is_some_and(|o| !o.is_empty()) {
                    let mut inner = String::new();
                    write_yaml(item, indent + 2, &mut inner);
                    out.push_str(&format!("{pad}- {}", &inner[indent + 2..]));
                } else {
                    out.push_str(&format!("{pad}- {}\n", inline(item)));
                }
            }
        }
        _ => out.push_str(&format!("{pad}{}\n", inline(v))),
    }
}

fn ordered(m: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut entries: Vec<_> = m.iter().collect();
    entries.sort_by_key(|(k, _)| {
        (
            KEY_ORDER
                .iter()
                .position(|o| o == k)
                .unwrap_or(KEY_ORDER.len()),
            k.as_str(),
        )
    });
    entries
}

/// A scalar, an empty collection or a list of scalars, on one line.
fn inline(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => scalar_text(s),
        Value::Array(a) => format!("[{}]", a.iter().map(inline).collect::<Vec<_>>().join(", ")),
        Value::Object(o) if o.is_empty() => "{}".into(),
        // A mapping inside a list inside a list: JSON is YAML's flow style.
        Value::Object(_) => serde_json::to_string(v).expect("a value serializes"),
    }
}

/// A string plain when YAML reads it back as the same string, else double-quoted (JSON's
/// escapes are YAML's).
fn scalar_text(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '/')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
        && !matches!(
            s.to_ascii_lowercase().as_str(),
            "true" | "false" | "yes" | "no" | "on" | "off" | "null" | "y" | "n"
        );
    if plain {
        s.to_owned()
    } else {
        serde_json::to_string(s).expect("a string serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_reads_back_as_the_same_document() {
        let doc = json!({
            "cluster": "prod",
            "resources": [{"api_version": "v1", "kind": "Event", "filter": "object.type == \"Warning\" && true",
                           "namespaces": ["a", "b-c"], "events": []}],
            "sinks": [{"name": "k", "type": "kafka", "kafka": {"brokers": ["h:9092"], "topic": "yes",
                       "properties": {"client.id": "x: y #z"}, "sasl": {"password": {"env": "P"}}}}],
            "routes": [{"resource": "event", "sinks": ["k"]}],
            "n": 3, "t": true, "e": {}
        });
        let mut text = String::new();
        write_yaml(&doc, 0, &mut text);
        let back: Value = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Yaml))
            .build()
            .unwrap()
            .try_deserialize()
            .unwrap();
        assert_eq!(back, doc, "{text}");
        assert!(text.starts_with("cluster: prod\n"), "{text}");
    }

    #[test]
    fn inline_passwords_are_not_copied() {
        let mut notes = Notes::default();
        assert_eq!(
            secret("${env:KAFKA_PW}", "X", "s", &mut notes),
            json!({"env": "KAFKA_PW"})
        );
        assert_eq!(
            secret("${KAFKA_PW}", "X", "s", &mut notes),
            json!({"env": "KAFKA_PW"})
        );
        assert!(notes.0.is_empty());
        let r = secret("hunter2", "KAFKA_PASSWORD_K", "sinks k", &mut notes);
        assert_eq!(r, json!({"env": "KAFKA_PASSWORD_K"}));
        assert_eq!(notes.0.len(), 1);
        assert!(!notes.0[0].contains("hunter2"));
        assert_eq!(
            env_name("KAFKA_PASSWORD", "my-sink.1"),
            "KAFKA_PASSWORD_MY_SINK_1"
        );
    }
}
