//! Bad input never crashes the service (property tests, bounded cases so CI stays fast):
//! - random YAML documents and random values at known config fields load as `Ok` or as an
//!   error that names the field, never a panic;
//! - random objects (deep nesting, huge strings, odd unicode, numbers out of range, missing
//!   metadata) go through the informer's transform, the cache's byte form and the encoder:
//!   the message is valid JSON carrying exactly the transformed object, or a clear error;
//!   cached straight from a list page's bytes, they are what the parsed path caches;
//! - random filter expressions compile or fail with a message; random pairs of objects go
//!   through a filter, `ignore_fields` and the patch between them (which applies, and is the
//!   patch `json_patch::diff` gives for the parsed objects, also for an object and itself
//!   changed deep inside), and every trim step of the encoder gives valid JSON.
//!
//! `PROPS_SCALE=20 cargo test --test bad_input_props` runs 20 times the cases (a longer run
//! than CI's).

#[path = "support/objects.rs"]
mod objects;

use std::sync::Arc;

use kube::api::DynamicObject;
use kube_event_bridge::{
    config::{Config, MessageConfig},
    informer::{CachedObject, Notification, NotificationKind},
    message::{Encoder, Encoding, object_transform},
};
use objects::{configmaps, core_resource};
use proptest::prelude::*;
use serde_json::{Value, json};

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPS_SCALE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1)
            * n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Strings with the characters that break naive code: quotes, backslashes, control
/// characters, NUL, lone-surrogate-free odd unicode (RTL marks, emoji, combining marks).
fn odd_string() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9.-]{0,20}",
        proptest::collection::vec(
            prop_oneof![
                Just('"'),
                Just('\\'),
                Just('\u{0}'),
                Just('\n'),
                Just('\u{1b}'),
                Just('\u{202e}'),
                Just('\u{fffd}'),
                Just('😀'),
                Just('\u{301}'),
                Just('/'),
                Just(':'),
                any::<char>(),
            ],
            0..30
        )
        .prop_map(|c| c.into_iter().collect()),
    ]
}

/// Numbers at and past the edges of every JSON number type.
fn odd_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(Value::from),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(f64::MAX)),
        Just(json!(5e-324)),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        odd_number(),
        odd_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            proptest::collection::btree_map(odd_string(), inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// `depth` nested arrays or objects around a value.
fn nested(depth: usize, objects: bool) -> Value {
    let mut v = json!("bottom");
    for i in 0..depth {
        v = if objects {
            json!({ format!("k{i}"): v })
        } else {
            json!([v])
        };
    }
    v
}

/// A random object: metadata fields present, absent, or of odd values; a random body.
fn any_object() -> impl Strategy<Value = Value> {
    let meta_string = || proptest::option::weighted(0.9, odd_string());
    let labels = proptest::option::of(proptest::collection::btree_map(
        odd_string(),
        odd_string(),
        0..4,
    ));
    let big = prop_oneof![
        Just(Value::Null),
        (0usize..300_000).prop_map(|n| Value::String("\u{e9}\"x".repeat(n / 3))),
        // As deep as kube decodes (serde_json stops at 128 levels; the message wraps the
        // object in two more).
        (1usize..120).prop_map(|d| nested(d, true)),
        (1usize..120).prop_map(|d| nested(d, false)),
    ];
    (
        meta_string(),
        meta_string(),
        meta_string(),
        meta_string(),
        labels,
        any_json(),
        big,
    )
        .prop_map(|(name, namespace, uid, rv, labels, body, big)| {
            let mut metadata = serde_json::Map::new();
            for (k, v) in [
                ("name", name),
                ("namespace", namespace),
                ("uid", uid),
                ("resourceVersion", rv),
            ] {
                if let Some(v) = v {
                    metadata.insert(k.into(), Value::String(v));
                }
            }
            if let Some(l) = labels {
                metadata.insert("labels".into(), json!(l));
            }
            metadata.insert("managedFields".into(), json!([{"manager": "kubectl"}]));
            json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": metadata,
                "data": {"body": body, "big": big},
                "stringData": {"token": "secret"},
            })
        })
}

/// The patch from `old` to `new`, diffed on their text, is `json_patch::diff`'s for the parsed
/// objects, operation for operation, and applied to `old` gives `new`.
fn patch_is_the_parsed_objects(
    old: &CachedObject,
    new: &CachedObject,
) -> Result<(), proptest::test_runner::TestCaseError> {
    let patch = kube_event_bridge::message::patch_between(old, new).unwrap();
    let mut doc: Value = serde_json::from_str(old.json().get()).unwrap();
    let parsed = json_patch::diff(&doc, &serde_json::from_str(new.json().get()).unwrap());
    prop_assert_eq!(&patch, &parsed);
    prop_assert!(json_patch::patch(&mut doc, &patch).is_ok());
    prop_assert_eq!(
        doc,
        serde_json::from_str::<Value>(new.json().get()).unwrap()
    );
    Ok(())
}

proptest! {
    #![proptest_config(cases(64))]

    /// An object the API server could send (or a worse one) goes through transform, cache
    /// and encoder without a panic; what is published is exactly the transformed object.
    #[test]
    fn random_objects_are_cached_and_encoded_or_refused_clearly(raw in any_object()) {
        // What kube would decode from a watch line.
        let Ok(mut obj) = serde_json::from_value::<DynamicObject>(raw) else {
            return Ok(()); // not an object kube could decode: refused before the cache
        };
        for (kind, plural) in [("ConfigMap", "configmaps"), ("Secret", "secrets")] {
            let res = core_resource(kind, plural);
            let options = MessageConfig::default();
            object_transform(&res, &options).apply(&mut obj);
            prop_assert!(obj.metadata.managed_fields.is_none());
            let cached = Arc::new(CachedObject::new(&obj));
            prop_assert_eq!(cached.name(), obj.metadata.name.as_deref());
            prop_assert_eq!(cached.namespace(), obj.metadata.namespace.as_deref());
            prop_assert_eq!(cached.uid(), obj.metadata.uid.as_deref());
            prop_assert_eq!(cached.resource_version(), obj.metadata.resource_version.as_deref());
            let want = serde_json::to_value(&obj).unwrap();
            let stored: Value = serde_json::from_str(cached.json().get()).unwrap();
            prop_assert_eq!(&stored, &want);
            if kind == "Secret" {
                prop_assert!(!cached.json().get().contains("\"secret\""), "Secret data is redacted");
            }
            for encoding in [Encoding::Structured, Encoding::Binary] {
                let encoder = Encoder::new("props", &res, &options, encoding);
                let key = "ns/name";
                for kind in [
                    NotificationKind::Add { obj: cached.clone(), is_initial_list: false },
                    NotificationKind::Update { old: cached.clone(), new: cached.clone() },
                    NotificationKind::Delete { obj: cached.clone(), final_state_unknown: true },
                ] {
                    match encoder.encode(key, &Notification::new(kind)) {
                        Ok(m) => {
                            let payload = serde_json::from_slice::<Value>(&m.payload);
                            prop_assert!(payload.is_ok(), "the payload is JSON");
                            let payload = payload.unwrap();
                            let data = if encoding == Encoding::Structured { &payload["data"] } else { &payload };
                            prop_assert_eq!(&data["object"], &want);
                        }
                        Err(e) => {
                            // Only an object without its identity is refused, and it says so.
                            let text = e.to_string();
                            prop_assert!(
                                obj.metadata.uid.is_none() || obj.metadata.resource_version.is_none()
                                    || obj.metadata.name.is_none(),
                                "refused an object with its identity: {}", text
                            );
                            prop_assert!(text.contains("uid") || text.contains("resourceVersion") || text.contains("name"), "{}", text);
                        }
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(cases(64))]

    /// A random object as a list page carries it (compact, with or without its types):
    /// cached straight from the bytes, it is what the parsed path caches (same identity, same
    /// JSON value), or, where the parsed path refuses it, valid JSON with Secret data redacted
    /// that the encoder takes or refuses clearly.
    #[test]
    fn random_objects_cache_alike_from_bytes_and_parsed(raw in any_object(), typeless in any::<bool>()) {
        let mut raw = raw;
        if typeless && let Some(m) = raw.as_object_mut() {
            m.remove("kind");
            m.remove("apiVersion");
        }
        let text = raw.to_string();
        for (kind, plural) in [("ConfigMap", "configmaps"), ("Secret", "secrets")] {
            let t = object_transform(&core_resource(kind, plural), &MessageConfig::default());
            let bytes = t.cache(&text);
            let Ok(mut obj) = serde_json::from_str::<DynamicObject>(&text) else {
                if let Ok(cached) = bytes {
                    prop_assert!(serde_json::from_str::<Value>(cached.json().get()).is_ok());
                    if kind == "Secret" {
                        prop_assert!(!cached.json().get().contains("\"secret\""), "Secret data is redacted");
                    }
                    let encoder = Encoder::new("props", &core_resource(kind, plural), &MessageConfig::default(), Encoding::Structured);
                    let n = Notification::new(NotificationKind::Add { obj: Arc::new(cached), is_initial_list: true });
                    if let Ok(m) = encoder.encode("ns/name", &n) {
                        prop_assert!(serde_json::from_slice::<Value>(&m.payload).is_ok());
                    }
                }
                continue;
            };
            t.apply(&mut obj);
            let tree = CachedObject::new(&obj);
            prop_assert!(bytes.is_ok(), "{:?}", bytes.err());
            let bytes = bytes.unwrap();
            prop_assert_eq!(bytes.name(), tree.name());
            prop_assert_eq!(bytes.namespace(), tree.namespace());
            prop_assert_eq!(bytes.uid(), tree.uid());
            prop_assert_eq!(bytes.resource_version(), tree.resource_version());
            let value = |c: &CachedObject| serde_json::from_str::<Value>(c.json().get()).unwrap();
            prop_assert_eq!(value(&bytes), value(&tree));
        }
    }

    /// Any text as a filter: compiles or fails with a message, never panics.
    #[test]
    fn random_filters_compile_or_fail_clearly(
        text in prop_oneof![
            odd_string(),
            "(object|oldObject|type|\\.|metadata|labels|\\[|\\]|\"a\"|==|&&|\\|\\||!|has\\(|\\)| |1|size){0,14}",
        ]
    ) {
        if let Err(e) = kube_event_bridge::pipeline::filter::Expr::compile(&text) {
            prop_assert!(!e.to_string().trim().is_empty());
        }
    }

    /// An object and the same object with one value deep inside replaced (the usual update):
    /// the patch diffed on the text is `json_patch::diff`'s of the parsed objects and applies.
    #[test]
    fn a_deep_change_gives_the_parsed_objects_patch(
        old in any_object(),
        value in any_json(),
        steps in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let Ok(obj) = serde_json::from_value::<DynamicObject>(old) else {
            return Ok(());
        };
        let old = CachedObject::new(&obj);
        let mut changed: Value = serde_json::from_str(old.json().get()).unwrap();
        let mut at = &mut changed;
        for step in steps {
            let len = match &*at {
                Value::Object(m) => m.len(),
                Value::Array(a) => a.len(),
                _ => 0,
            };
            if len == 0 {
                break;
            }
            at = match at {
                Value::Object(m) => m.values_mut().nth(step % len).unwrap(),
                Value::Array(a) => &mut a[step % len],
                _ => unreachable!(),
            };
        }
        *at = value;
        let Ok(obj) = serde_json::from_value::<DynamicObject>(changed) else {
            return Ok(());
        };
        patch_is_the_parsed_objects(&old, &CachedObject::new(&obj))?;
    }

    /// Two random objects as an update: the filter evaluates or errs, suppression compares,
    /// the patch from one to the other applies, and every trim step is valid JSON.
    #[test]
    fn random_updates_are_filtered_diffed_and_trimmed(old in any_object(), new in any_object()) {
        use kube_event_bridge::{config::DiffMode, message::Trim, pipeline::filter};
        let (Ok(old), Ok(new)) = (
            serde_json::from_value::<DynamicObject>(old),
            serde_json::from_value::<DynamicObject>(new),
        ) else {
            return Ok(());
        };
        let (old, new) = (Arc::new(CachedObject::new(&old)), Arc::new(CachedObject::new(&new)));
        let expr = filter::Expr::compile(
            "has(object.metadata.labels) && object.metadata.labels.exists(k, k.startsWith('a')) \
             || oldObject.metadata.name == object.metadata.name",
        )
        .unwrap();
        let _ = expr.eval(&new, Some(&old), kube_event_bridge::config::EventType::Updated);
        let pointers = ["/status", "/metadata/labels/a~1b"].map(|p| filter::PointerBuf::parse(p).unwrap());
        let _ = filter::equal_ignoring(&old, &new, &pointers);
        patch_is_the_parsed_objects(&old, &new)?;
        let options = MessageConfig { diff: DiffMode::Patch, ..Default::default() };
        let encoder = Encoder::new("props", &configmaps(), &options, Encoding::Structured);
        let n = Notification::new(NotificationKind::Update { old, new });
        for trim in [Trim::None, Trim::OldObject, Trim::Patch, Trim::Reference] {
            if let Ok(m) = encoder.encode_trimmed("ns/name", &n, trim) {
                prop_assert!(serde_json::from_slice::<Value>(&m.payload).is_ok());
            }
        }
    }
}

/// A valid config with a NATS and a Kafka sink, so that most fields exist to be broken.
fn base_config() -> Value {
    json!({
        "cluster": "props",
        "admin": {"address": "127.0.0.1:0"},
        "log": {"format": "json", "level": "info"},
        "kubernetes": {"qps": 50, "burst": 100, "page_size": 500},
        "resources": [{"api_version": "v1", "kind": "ConfigMap", "namespaces": ["a"],
                       "filter": "has(object.metadata.labels)",
                       "publish_if": "type != 'synced'",
                       "ignore_fields": ["/status"], "exclude_namespaces": ["b"]}],
        "sinks": [
            {"name": "out", "type": "stdout", "max_pending": 1000, "workers": 4,
             "max_objects_in_flight": 512},
            {"name": "bus", "type": "nats", "nats": {"servers": ["nats://127.0.0.1:4222"],
                      "stream": {"name": "K8S", "subjects": ["k8s.>"]}},
             "retry": {"base_delay": "10ms", "max_delay": "1s"}},
        ],
        "routes": [{"resource": "configmap", "sinks": ["out", "bus"]}],
    })
}

/// Fields of [`base_config`], as (path in the document, the name an error must mention).
const FIELDS: &[(&str, &str)] = &[
    ("/cluster", "cluster"),
    ("/admin/address", "address"),
    ("/log/format", "format"),
    ("/log/level", "level"),
    ("/kubernetes/qps", "qps"),
    ("/kubernetes/burst", "burst"),
    ("/kubernetes/page_size", "page_size"),
    ("/resources/0/api_version", "api_version"),
    ("/resources/0/kind", "kind"),
    ("/resources/0/namespaces", "namespaces"),
    ("/resources/0/filter", "filter"),
    ("/resources/0/publish_if", "publish_if"),
    ("/resources/0/ignore_fields", "ignore_fields"),
    ("/resources/0/exclude_namespaces", "exclude_namespaces"),
    ("/sinks/0/name", "name"),
    ("/sinks/0/type", "type"),
    ("/sinks/0/max_pending", "max_pending"),
    ("/sinks/0/workers", "workers"),
    ("/sinks/0/max_objects_in_flight", "max_objects_in_flight"),
    ("/sinks/1/nats/servers", "servers"),
    ("/sinks/1/nats/stream/name", "stream"),
    ("/sinks/1/nats/stream/subjects", "subjects"),
    ("/sinks/1/retry/base_delay", "base_delay"),
    ("/sinks/1/retry/max_delay", "max_delay"),
    ("/routes/0/resource", "resource"),
    ("/routes/0/sinks", "sinks"),
];

fn load_yaml(text: &str) -> Result<Config, String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, text).unwrap();
    Config::load(&path).map_err(|e| e.to_string())
}

#[test]
fn the_base_config_is_valid() {
    load_yaml(&base_config().to_string()).expect("the base config loads");
}

proptest! {
    #![proptest_config(cases(96))]

    /// Any text as a config file: loads or fails with a message, never panics.
    #[test]
    fn random_yaml_never_panics(
        text in prop_oneof![
            any::<String>(),
            any_json().prop_map(|v| v.to_string()),
            "([a-z_]{1,10}: ?(\\[|\\{|-|[0-9a-z\"']{0,6})\n {0,4}){1,12}",
        ]
    ) {
        match load_yaml(&text) {
            Ok(_) => {}
            Err(e) => prop_assert!(!e.trim().is_empty()),
        }
    }

    /// A random value at a known field: the config loads, or the error names the field.
    #[test]
    fn a_bad_value_at_a_field_is_named(field in 0..FIELDS.len(), value in any_json()) {
        let (pointer, name) = FIELDS[field];
        let mut doc = base_config();
        *doc.pointer_mut(pointer).unwrap() = value.clone();
        if let Err(e) = load_yaml(&doc.to_string()) {
            // A value the config cannot take is reported at its field; a value that breaks
            // a reference (a renamed sink, a renamed resource) is reported where it is used.
            let named = e.contains(name)
                || (pointer.starts_with("/sinks/") && e.contains("routes"))
                || (pointer.starts_with("/resources/") && e.contains("routes"))
                || (pointer.starts_with("/routes/") && e.contains("sink"));
            prop_assert!(named, "{} = {}: error does not name the field: {}", pointer, value, e);
        }
    }
}

/// A sink with no room for an object in flight could never publish: refused, by name.
#[test]
fn a_sink_without_room_in_flight_is_refused() {
    let mut doc = base_config();
    doc["sinks"][0]["max_objects_in_flight"] = json!(0);
    let e = load_yaml(&doc.to_string()).unwrap_err();
    assert!(
        e.contains("max_objects_in_flight") && e.contains("must be at least 1"),
        "{e}"
    );
}
