//! The config file's JSON Schema (`schemas/config.schema.json`, derived from the config types
//! by `kube-event-bridge schema`) is current, is what the Helm chart's `values.schema.json`
//! checks `config:` with, accepts every config we ship, and refuses the mistakes
//! `check-config` refuses (a misspelt field, a wrong type, an unknown enum value), naming
//! where they are.
//!
//! `UPDATE_SCHEMAS=1 cargo test --test config_schema` rewrites both files from the code.

mod support;

use std::path::{Path, PathBuf};

use kube_event_bridge::config::Config;
use serde_json::{Value, json};
use support::deployed::yaml_docs;

const CONFIG_SCHEMA: &str = "schemas/config.schema.json";
const VALUES_SCHEMA: &str = "deploy/helm/kube-event-bridge/values.schema.json";
/// What each shipped config's first line names (relative to the repository root).
const SCHEMA_LINE: &str = "# yaml-language-server: $schema=";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap() + "\n"
}

/// The values schema with its `$defs` replaced by the config schema's, plus `Config` (the
/// config schema's root) that `properties.config` refers to.
fn values_schema_from(values: &Value, config: &Value) -> Value {
    let mut values = values.clone();
    let mut defs = config["$defs"].clone();
    let mut root = config.clone();
    let root = root.as_object_mut().unwrap();
    for k in ["$defs", "$schema", "$id"] {
        root.remove(k);
    }
    defs["Config"] = Value::Object(root.clone());
    values["$defs"] = defs;
    values
}

#[test]
fn the_published_schemas_are_the_codes() {
    let config = Config::json_schema();
    let values_path = root().join(VALUES_SCHEMA);
    let mut values: Value =
        serde_json::from_str(&std::fs::read_to_string(&values_path).unwrap()).unwrap();
    let wanted_values = values_schema_from(&values, &config);
    assert_eq!(
        values["properties"]["config"]["$ref"], "#/$defs/Config",
        "{VALUES_SCHEMA}: config: is checked with the config schema"
    );
    if std::env::var_os("UPDATE_SCHEMAS").is_some() {
        std::fs::write(root().join(CONFIG_SCHEMA), pretty(&config)).unwrap();
        std::fs::write(&values_path, pretty(&wanted_values)).unwrap();
        values = wanted_values.clone();
    }
    let published = std::fs::read_to_string(root().join(CONFIG_SCHEMA)).unwrap();
    assert!(
        published == pretty(&config),
        "{CONFIG_SCHEMA} is not what the config types give: run \
         UPDATE_SCHEMAS=1 cargo test --test config_schema"
    );
    assert!(
        values == wanted_values,
        "{VALUES_SCHEMA}'s $defs are not the config schema's: run \
         UPDATE_SCHEMAS=1 cargo test --test config_schema"
    );
}

fn validator() -> jsonschema::Validator {
    jsonschema::validator_for(&Config::json_schema()).expect("a valid JSON Schema")
}

/// Where the schema finds fault with `config`: `instance path: message` per error.
fn schema_errors(v: &jsonschema::Validator, config: &Value) -> Vec<String> {
    v.iter_errors(config)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Every config the repository ships, as `(where, config)`: config/*.yaml, deploy/'s
/// config.yaml files, and the `config:` of the chart's values and examples.
fn shipped() -> Vec<(String, Value, Option<PathBuf>)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("config"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.push(root().join("deploy/base/config.yaml"));
    for overlay in std::fs::read_dir(root().join("deploy/overlays")).unwrap() {
        files.push(overlay.unwrap().path().join("config.yaml"));
    }
    files.sort();
    for f in files {
        let config = yaml_docs(&f).remove(0);
        out.push((f.display().to_string(), config, Some(f)));
    }
    let mut values: Vec<PathBuf> = std::fs::read_dir(root().join("deploy/helm/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    values.sort();
    values.insert(0, root().join("deploy/helm/kube-event-bridge/values.yaml"));
    for f in values {
        let config = yaml_docs(&f).remove(0)["config"].clone();
        out.push((format!("{}: config", f.display()), config, None));
    }
    out
}

/// Every shipped config matches the schema, loads (`Config::from_value`, as `check-config`
/// does), and each config file names the schema on its first line for editors.
#[test]
fn every_shipped_config_matches_the_schema() {
    let v = validator();
    for (at, config, file) in shipped() {
        let errors = schema_errors(&v, &config);
        assert!(
            errors.is_empty(),
            "{at} does not match {CONFIG_SCHEMA}: {errors:#?}"
        );
        if let Err(e) = Config::from_value(config) {
            panic!("{at} matches the schema but does not load: {e}");
        }
        if let Some(f) = file {
            let first = std::fs::read_to_string(&f).unwrap();
            let first = first.lines().next().unwrap_or_default();
            let relative = pathdiff(f.parent().unwrap(), &root().join(CONFIG_SCHEMA));
            assert_eq!(
                first,
                format!("{SCHEMA_LINE}{relative}"),
                "{at}: the first line names the schema for editors"
            );
        }
        eprintln!("ok {at}");
    }
}

/// `to` relative to the directory `from` (both under the repository root).
fn pathdiff(from: &Path, to: &Path) -> String {
    let from = from.strip_prefix(root()).unwrap();
    let to = to.strip_prefix(root()).unwrap();
    let ups = from.components().count();
    let mut parts: Vec<String> = vec!["..".into(); ups];
    parts.push(to.display().to_string());
    parts.join("/")
}

/// A small valid config to break.
fn base() -> Value {
    json!({
        "resources": [{"api_version": "v1", "kind": "ConfigMap"}],
        "sinks": [{"name": "k", "type": "kafka", "kafka": {"brokers": ["localhost:9092"]}}],
        "routes": [{"resource": "configmap", "sinks": ["k"]}],
    })
}

/// Breaks a valid config in one place.
type Break = fn(&mut Value);

/// Mistakes the schema refuses as the config loader does, each named where it is.
#[test]
fn the_schema_refuses_what_the_config_refuses() {
    let v = validator();
    assert!(schema_errors(&v, &base()).is_empty());
    Config::from_value(base()).unwrap();
    // `apiVersion` is `api_version`'s alias for both.
    let mut alias = base();
    alias["resources"][0] = json!({"apiVersion": "v1", "kind": "ConfigMap"});
    assert!(
        schema_errors(&v, &alias).is_empty(),
        "{:?}",
        schema_errors(&v, &alias)
    );
    Config::from_value(alias).unwrap();

    let cases: Vec<(&str, Break)> = vec![
        ("", |c| c["sink"] = json!([])),
        ("/resources/0", |c| c["resources"][0]["knd"] = json!("Pod")),
        ("/resources/0", |c| {
            c["resources"][0]
                .as_object_mut()
                .unwrap()
                .remove("api_version");
        }),
        ("/sinks/0/kafka", |c| {
            c["sinks"][0]["kafka"]["brokerz"] = json!("x")
        }),
        ("/sinks/0/type", |c| c["sinks"][0]["type"] = json!("kafak")),
        ("/sinks/0/workers", |c| {
            c["sinks"][0]["workers"] = json!("many")
        }),
        ("/resources/0/events/0", |c| {
            c["resources"][0]["events"] = json!(["modified"])
        }),
        ("/log/format", |c| c["log"] = json!({"format": "yaml"})),
        ("/shutdown/grace_period", |c| {
            c["shutdown"] = json!({"grace_period": 25})
        }),
        ("/leader_election", |c| {
            c["leader_election"] = json!({"enable": true})
        }),
    ];
    for (path, break_it) in cases {
        let mut config = base();
        break_it(&mut config);
        let errors = schema_errors(&v, &config);
        let loaded = Config::from_value(config.clone());
        eprintln!(
            "{config}\n  schema: {errors:?}\n  loader: {:?}",
            loaded.as_ref().err()
        );
        assert!(
            errors.iter().any(|e| e.starts_with(&format!("{path}: "))),
            "the schema names {path:?}: {errors:?}"
        );
        assert!(loaded.is_err(), "the loader refuses it too: {config}");
    }
}
