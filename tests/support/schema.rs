//! The published message schemas (`schemas/*.schema.json`, draft 2020-12), checked against
//! every message the integration tests read back from a sink: a message that does not match
//! fails the test that received it.

use std::sync::OnceLock;

use serde_json::Value;

fn load(name: &str) -> jsonschema::Validator {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("schemas")
        .join(name);
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    jsonschema::options()
        .should_validate_formats(true)
        .build(&schema)
        .unwrap_or_else(|e| panic!("{} is not a valid schema: {e}", path.display()))
}

fn cloudevent() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| load("cloudevent.schema.json"))
}

fn state_value() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| load("state-value.schema.json"))
}

fn errors(v: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    v.iter_errors(instance).map(|e| e.to_string()).collect()
}

/// The schema's complaints about a structured CloudEvent (empty when it matches).
pub fn cloudevent_errors(event: &Value) -> Vec<String> {
    errors(cloudevent(), event)
}

/// Panics unless `event` (structured, or mapped back from binary) matches
/// `schemas/cloudevent.schema.json`.
pub fn check_cloudevent(event: &Value) {
    let errors = cloudevent_errors(event);
    assert!(
        errors.is_empty(),
        "message does not match schemas/cloudevent.schema.json: {errors:?}\n{event}"
    );
}

/// Panics unless `value` (a state topic record's value) matches
/// `schemas/state-value.schema.json`.
pub fn check_state_value(value: &Value) {
    let errors = errors(state_value(), value);
    assert!(
        errors.is_empty(),
        "value does not match schemas/state-value.schema.json: {errors:?}\n{value}"
    );
}

/// A binary-mode message mapped back to structured mode, as `tail` does it.
pub fn structured_from_binary<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
    prefix: &str,
    data: Value,
) -> Value {
    kube_event_bridge::consumer::event::structured_from_binary(headers, prefix, Some(data))
}
