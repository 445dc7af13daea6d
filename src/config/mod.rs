//! Settings: a YAML file plus `KEB_` environment overrides, validated before anything starts.
//!
//! Every struct denies unknown fields and every field carries a `///` line: those lines are the
//! book's config reference, `docs/src/config-reference.md` (a test keeps the two in sync).
//! Errors name the field path (`resources[2].kind: missing field`) so that a bad config can be
//! fixed without reading code.
//!
//! Each component owns its settings and checks them ([`KubernetesConfig`] in `cluster`,
//! [`LeaderElectionConfig`] in `leader`, [`MessageConfig`] in `message`, each sink's in its
//! folder); this module assembles them into one document ([`resource`] and [`sink`] hold the
//! entries of its lists), loads it, and checks what spans sections: names and routes.

pub mod resource;
pub mod sink;

use std::{collections::HashSet, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

pub use crate::{
    admin::AdminConfig,
    cluster::KubernetesConfig,
    informer::EventType,
    leader::LeaderElectionConfig,
    message::{DiffMode, MessageConfig},
    pipeline::filter::FilterErrorPolicy,
    shard::ShardingConfig,
    sinks::{SecretRef, stdout::StdoutSinkConfig},
};
pub use resource::{ResourceConfig, ScopeSelection};
pub use sink::{RateLimitConfig, RetryConfig, SinkConfig, SinkType};

use crate::problems::{Problems, Section};

/// Errors while loading or validating the configuration. All of them are fatal at start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read or is not valid YAML.
    #[error("cannot load config from {path}: {cause}")]
    Load {
        /// The file that was given.
        path: PathBuf,
        /// What the `config` crate reported (in the message).
        cause: config::ConfigError,
    },
    /// One or more fields are wrong; each line names the field path and the reason.
    #[error("invalid config:\n  {}", .0.join("\n  "))]
    Invalid(Vec<String>),
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The whole configuration of one kube-event-bridge process.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Name of the cluster, used in each message's `source` and `k8scluster` attribute.
    #[serde(default = "default_cluster")]
    pub cluster: String,
    /// How to reach the Kubernetes API.
    #[serde(default)]
    pub kubernetes: KubernetesConfig,
    /// The admin HTTP server (`/metrics`, `/healthz`, `/readyz`).
    #[serde(default)]
    pub admin: AdminConfig,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// What goes into each message.
    #[serde(default)]
    pub message: MessageConfig,
    /// Shutdown behaviour.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// Leader election among replicas (off by default).
    #[serde(default)]
    pub leader_election: LeaderElectionConfig,
    /// Splitting every resource's objects into shards that the replicas share (one by
    /// default: single-leader mode).
    #[serde(default)]
    pub sharding: ShardingConfig,
    /// The resources to watch; each one is served by a shared informer.
    pub resources: Vec<ResourceConfig>,
    /// Where notifications go.
    pub sinks: Vec<SinkConfig>,
    /// Which resources go to which sinks.
    pub routes: Vec<RouteConfig>,
}

/// Logging.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `auto`: `json` when standard error is not a terminal (a pod's log, a file, a pipe),
    /// `pretty` on a terminal; or `pretty` for people, `json` for log collectors, always.
    #[serde(default)]
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `info,kube_event_bridge=debug`; `RUST_LOG` overrides it.
    #[serde(default = "default_log_level")]
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::default(),
            level: default_log_level(),
        }
    }
}

impl LogConfig {
    /// Checks the filter; paths relative to `log`.
    pub fn validate(&self, p: &mut Section) {
        if self.level.parse::<tracing_subscriber::EnvFilter>().is_err() {
            p.add(
                "level",
                format!("{:?} is not a valid tracing filter", self.level),
            );
        }
    }
}

/// Log output format.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `json` unless standard error is a terminal.
    #[default]
    Auto,
    /// Human-readable lines (coloured only on a terminal without `NO_COLOR`).
    Pretty,
    /// One JSON object per line.
    Json,
}

/// Shutdown behaviour.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// How long SIGTERM/SIGINT waits for pending notifications to be delivered before giving up.
    #[serde(default = "default_grace_period", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub grace_period: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace_period: default_grace_period(),
        }
    }
}

/// Which resources go to which sinks.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Name of a resource (its `name`, or the default derived from kind and group).
    pub resource: String,
    /// Names of the sinks that receive its notifications.
    pub sinks: Vec<String>,
}

fn default_cluster() -> String {
    "default".into()
}
fn default_log_level() -> String {
    "info".into()
}
// Kubernetes gives a pod 30 s between SIGTERM and SIGKILL by default; leave some of it for exit.
fn default_grace_period() -> Duration {
    Duration::from_secs(25)
}

/// Environment variables with this prefix override file settings: `KEB_ADMIN__ADDRESS`,
/// `KEB_LOG__LEVEL`, `KEB_KUBERNETES__CONTEXT`.
pub const ENV_PREFIX: &str = "KEB";

impl Config {
    /// Loads `path`, applies `KEB_*` environment overrides, deserializes and validates.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let load_err = |cause| Error::Load {
            path: path.to_owned(),
            cause,
        };
        let raw = config::Config::builder()
            .add_source(config::File::from(path).format(config::FileFormat::Yaml))
            .add_source(
                config::Environment::with_prefix(ENV_PREFIX)
                    .prefix_separator("_")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()
            .map_err(load_err)?;
        let value: serde_json::Value = raw.try_deserialize().map_err(load_err)?;
        Self::from_value(value)
    }

    /// The JSON Schema (draft 2020-12) of the config file, derived from these types: every
    /// field with its `///` line as description, its default, and `additionalProperties: false`
    /// where unknown fields are refused. Published as `schemas/config.schema.json` (a test
    /// keeps it current) for editors, CI linting and the Helm chart's `values.schema.json`. It
    /// checks the shape only: what spans fields (routes naming resources, durations that must
    /// fit each other) is [`Config::validate`]'s.
    pub fn json_schema() -> serde_json::Value {
        let mut schema = serde_json::to_value(schemars::schema_for!(Config)).expect("a schema");
        schema["$id"] = "https://kube-event-bridge.io/schemas/config.schema.json".into();
        schema["title"] = "kube-event-bridge config".into();
        // serde's aliases are not in the derived schema: `apiVersion` (as in manifests) is
        // `api_version`'s, and either one is required.
        let resource = &mut schema["$defs"]["ResourceConfig"];
        let mut alias = resource["properties"]["api_version"].clone();
        alias["description"] = "Alias of `api_version`.".into();
        resource["properties"]["apiVersion"] = alias;
        resource["required"] = serde_json::json!(["kind"]);
        resource["oneOf"] = serde_json::json!([
            {"required": ["api_version"]},
            {"required": ["apiVersion"]}
        ]);
        schema
    }

    /// Deserializes an already-parsed document and validates it.
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        let config: Config = serde_path_to_error::deserialize(value).map_err(|err| {
            let path = err.path().to_string();
            let inner = err.into_inner().to_string();
            Error::Invalid(vec![describe_serde_error(&path, &inner)])
        })?;
        config.validate()?;
        Ok(config)
    }

    /// The longest a message handed to a sink can take to be delivered (or fail for good):
    /// `kafka.delivery_timeout`, `nats.ack_timeout`; with the sink's index and setting.
    pub fn longest_delivery(&self) -> Option<(std::time::Duration, usize, &'static str)> {
        self.sinks
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match (&s.kafka, &s.nats) {
                (Some(k), _) => Some((k.delivery_timeout, i, "kafka.delivery_timeout")),
                (_, Some(n)) => Some((n.ack_timeout, i, "nats.ack_timeout")),
                _ => None,
            })
            .max_by_key(|(d, ..)| *d)
    }

    /// The longest delivery (see [`Self::longest_delivery`]) of the sinks whose messages no
    /// transaction fences: every sink but Kafka with `exactly_once`, whose messages (and
    /// checkpoint records) all travel in transactions a new leader's producer fences.
    pub fn longest_unfenced_delivery(&self) -> std::time::Duration {
        self.sinks
            .iter()
            .filter_map(|s| match (&s.kafka, &s.nats) {
                (Some(k), _) if k.exactly_once => None,
                (Some(k), _) => Some(k.delivery_timeout),
                (_, Some(n)) => Some(n.ack_timeout),
                _ => None,
            })
            .max()
            .unwrap_or_default()
    }

    /// The `transactional.id`s of the producers that publish shard `shard` (the Kafka sinks
    /// with `exactly_once`), sorted: what the shard's Lease holder announces (see
    /// [`crate::leader::FencedBy`]).
    pub fn transactional_ids(&self, shard: crate::shard::Shard) -> Vec<String> {
        let mut ids: Vec<String> = self
            .sinks
            .iter()
            .filter(|s| s.kafka.as_ref().is_some_and(|k| k.exactly_once))
            .map(|s| crate::sinks::kafka::transactional_id(&self.cluster, &s.name, shard))
            .collect();
        ids.sort();
        ids
    }

    /// How long a new leader waits after taking the lease over (see
    /// [`crate::leader::takeover_wait`]).
    pub fn takeover_wait(&self) -> std::time::Duration {
        let longest = self.longest_delivery().map(|(d, ..)| d).unwrap_or_default();
        crate::leader::takeover_wait(&self.leader_election, longest)
    }

    /// Checks every section (each validates itself) and what spans sections: names,
    /// routes, dead letters. Reports every problem, not just the first.
    pub fn validate(&self) -> Result<()> {
        let mut p = Problems::new();
        if self.cluster.trim().is_empty() {
            p.add("cluster", "must not be empty");
        }
        self.kubernetes.validate(&mut p.at("kubernetes"));
        self.log.validate(&mut p.at("log"));
        self.leader_election.validate(&mut p.at("leader_election"));
        self.sharding.validate(&mut p.at("sharding"));
        if self.sharding.shards > 1 && !self.leader_election.enabled {
            p.add(
                "sharding.shards",
                "more than one shard needs leader_election.enabled: true (each shard is owned \
                 through a Lease)",
            );
        }
        for (i, s) in self.sinks.iter().enumerate() {
            if s.kafka.as_ref().is_some_and(|k| k.exactly_once) && !s.resume {
                p.add(
                    format!("sinks[{i}].resume"),
                    "exactly_once needs resume (its checkpoint is what a restart or a new \
                     leader resumes exactly after); set resume: true",
                );
            }
        }
        if self.resources.is_empty() {
            p.add("resources", "at least one resource is required");
        }
        let mut resource_names = HashSet::new();
        for (i, r) in self.resources.iter().enumerate() {
            let name = r.effective_name();
            if !resource_names.insert(name.clone()) {
                p.add(
                    format!("resources[{i}].name"),
                    format!("{name:?} is used by another resource; set distinct names"),
                );
            }
            r.validate(&mut p.at(format!("resources[{i}]")));
        }
        let sink_names = self.validate_sinks(&mut p);
        if self.leader_election.enabled {
            let wait = self.takeover_wait();
            if wait > crate::leader::MAX_TAKEOVER_WAIT {
                let (_, i, setting) = self.longest_delivery().expect("a wait needs a sink");
                p.add(
                    format!("sinks[{i}].{setting}"),
                    format!(
                        "with leader election a new leader waits this long, less \
                         leader_election.lease_duration - renew_deadline, before it publishes \
                         (the last leader's messages may be delivered until then): {:?}; at most \
                         {:?} is allowed, shorten it",
                        wait,
                        crate::leader::MAX_TAKEOVER_WAIT
                    ),
                );
            }
        }
        let routed = self.validate_routes(&mut p, &resource_names, &sink_names);
        self.validate_overlaps(&mut p);
        for (i, r) in self.resources.iter().enumerate() {
            if !routed.contains(r.effective_name().as_str()) {
                p.add(
                    format!("resources[{i}]"),
                    format!("{:?} is not used by any route", r.effective_name()),
                );
            }
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(Error::Invalid(p.into_vec()))
        }
    }

    /// The sinks' names (each given once) and dead letters; returns the names.
    fn validate_sinks(&self, p: &mut Problems) -> HashSet<&str> {
        if self.sinks.is_empty() {
            p.add("sinks", "at least one sink is required");
        }
        let mut sink_names = HashSet::new();
        for (i, s) in self.sinks.iter().enumerate() {
            if s.name.is_empty() {
                p.add(format!("sinks[{i}].name"), "must not be empty");
            } else if !sink_names.insert(s.name.as_str()) {
                p.add(
                    format!("sinks[{i}].name"),
                    format!("{:?} is used by another sink", s.name),
                );
            }
            s.validate(&mut p.at(format!("sinks[{i}]")));
        }
        for (i, s) in self.sinks.iter().enumerate() {
            if let Some(dlq) = &s.dead_letter {
                if dlq == &s.name {
                    p.add(
                        format!("sinks[{i}].dead_letter"),
                        "a sink cannot be its own dead-letter sink",
                    );
                } else if !sink_names.contains(dlq.as_str()) {
                    p.add(
                        format!("sinks[{i}].dead_letter"),
                        format!("no sink is named {dlq:?}"),
                    );
                } else if self
                    .sinks
                    .iter()
                    .any(|d| &d.name == dlq && d.kafka.as_ref().is_some_and(|k| k.exactly_once))
                {
                    p.add(
                        format!("sinks[{i}].dead_letter"),
                        format!(
                            "sink {dlq:?} has exactly_once: a dead-letter sink takes messages \
                             of every shard outside any route's transaction; use a sink without it"
                        ),
                    );
                }
            }
        }
        sink_names
    }

    /// Every route names a resource and sinks that exist, each pair once; returns the
    /// resources routed.
    fn validate_routes<'a>(
        &'a self,
        p: &mut Problems,
        resource_names: &HashSet<String>,
        sink_names: &HashSet<&str>,
    ) -> HashSet<&'a str> {
        if self.routes.is_empty() {
            p.add("routes", "at least one route is required");
        }
        let mut routed = HashSet::new();
        let mut pairs = HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            if !resource_names.contains(&route.resource) {
                p.add(
                    format!("routes[{i}].resource"),
                    format!("no resource is named {:?}", route.resource),
                );
            }
            routed.insert(route.resource.as_str());
            if route.sinks.is_empty() {
                p.add(
                    format!("routes[{i}].sinks"),
                    "at least one sink is required",
                );
            }
            for (j, sink) in route.sinks.iter().enumerate() {
                if !sink_names.contains(sink.as_str()) {
                    p.add(
                        format!("routes[{i}].sinks[{j}]"),
                        format!("no sink is named {sink:?}"),
                    );
                } else if !pairs.insert((route.resource.as_str(), sink.as_str())) {
                    p.add(
                        format!("routes[{i}].sinks[{j}]"),
                        format!(
                            "resource {:?} is already routed to sink {sink:?}",
                            route.resource
                        ),
                    );
                }
            }
        }
        routed
    }

    /// Two entries that can select the same object and send it to one sink render the same
    /// topic (or subject, or file) and key from two queues with no order between them: a
    /// `k8sfilteredout` delete from one could land after the other's `added`.
    fn validate_overlaps(&self, p: &mut Problems) {
        let mut seen: Vec<(&str, &str)> = Vec::new();
        for (i, route) in self.routes.iter().enumerate() {
            let Some(r) = self
                .resources
                .iter()
                .find(|r| r.effective_name() == route.resource)
            else {
                continue;
            };
            for sink in &route.sinks {
                for &(other_name, other_sink) in &seen {
                    let other = self
                        .resources
                        .iter()
                        .find(|o| o.effective_name() == other_name)
                        .expect("seen only when found");
                    if other_sink == sink
                        && other_name != route.resource
                        && r.may_share_objects_with(other)
                    {
                        p.add(
                            format!("routes[{i}]"),
                            format!(
                                "resources {other_name:?} and {:?} can both select the same \
                                 objects (same kind, overlapping namespaces) and both go to sink \
                                 {sink:?}: their messages would share topics and keys with no \
                                 order between them (one's delete could land after the other's \
                                 add). Merge them into one entry, make them disjoint \
                                 (namespaces, exclude, exclude_namespaces), or send them to \
                                 different sinks",
                                route.resource
                            ),
                        );
                    }
                }
            }
            seen.extend(
                route
                    .sinks
                    .iter()
                    .map(|s| (route.resource.as_str(), s.as_str())),
            );
        }
    }

    /// The config as pretty JSON, for `check-config`.
    pub fn to_pretty_json(&self) -> String {
        let mut doc = serde_json::to_value(self).expect("config serializes");
        // Secrets are references (`SecretRef`) everywhere but in a NATS URL's user info.
        for (i, sink) in self.sinks.iter().enumerate() {
            if let Some(nats) = &sink.nats {
                doc["sinks"][i]["nats"]["servers"] = serde_json::json!(nats.servers_redacted());
            }
        }
        serde_json::to_string_pretty(&doc).expect("config serializes")
    }
}

/// Turns serde's messages into `path: reason`; a missing field is reported at its own path.
fn describe_serde_error(path: &str, message: &str) -> String {
    if let Some(rest) = message.strip_prefix("missing field `") {
        let field = rest.split('`').next().unwrap_or_default();
        let full = if path == "." || path.is_empty() {
            field.to_owned()
        } else {
            format!("{path}.{field}")
        };
        return format!("{full}: missing field");
    }
    let path = if path == "." || path.is_empty() {
        "(top level)"
    } else {
        path
    };
    // serde quotes a wrongly typed value (`servers: nats://u:p@h` for a list): never a URL's
    // credentials.
    format!(
        "{path}: {}",
        crate::sinks::nats::scrub_url_credentials(message)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn minimal() -> serde_json::Value {
        json!({
            "resources": [{"api_version": "v1", "kind": "ConfigMap"}],
            "sinks": [{"name": "out", "type": "stdout"}],
            "routes": [{"resource": "configmap", "sinks": ["out"]}],
        })
    }

    fn errors_of(v: serde_json::Value) -> Vec<String> {
        match Config::from_value(v) {
            Err(Error::Invalid(e)) => e,
            other => panic!("expected invalid config, got {other:?}"),
        }
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_value(minimal()).unwrap();
        assert_eq!(c.cluster, "default");
        assert_eq!(c.kubernetes.page_size, 5000);
        assert!(c.kubernetes.gzip);
        assert_eq!(c.resources[0].events.len(), 4);
        assert!(c.message.strip_managed_fields && !c.message.allow_secret_data);
    }

    #[test]
    fn objects_in_flight_default_by_kind_and_a_setting_wins() {
        let mut v = minimal();
        v["sinks"] = json!([
            {"name": "out", "type": "stdout"},
            {"name": "eos", "type": "kafka", "kafka": {"brokers": ["b:9092"], "exactly_once": true}},
            {"name": "set", "type": "kafka", "max_objects_in_flight": 100,
             "kafka": {"brokers": ["b:9092"], "exactly_once": true}},
        ]);
        let c = Config::from_value(v).unwrap();
        let room: Vec<usize> = c.sinks.iter().map(SinkConfig::objects_in_flight).collect();
        assert_eq!(room, [4096, 32_768, 100]);
    }

    #[test]
    fn a_delivery_timeout_that_would_stall_a_failover_is_refused_naming_it() {
        let mut v = minimal();
        v["leader_election"] = json!({"enabled": true});
        v["sinks"] = json!([{"name": "out", "type": "kafka",
            "kafka": {"brokers": ["b:9092"], "delivery_timeout": "10m"}}]);
        v["routes"][0]["sinks"] = json!(["out"]);
        let e = errors_of(v.clone());
        assert!(
            e.len() == 1
                && e[0].starts_with(
                    "sinks[0].kafka.delivery_timeout: with leader election a new leader waits"
                ),
            "{e:?}"
        );
        // The default (30 s) means a 25 s takeover wait with the default lease.
        v["sinks"][0]["kafka"]["delivery_timeout"] = json!("30s");
        let c = Config::from_value(v).unwrap();
        assert_eq!(c.takeover_wait(), std::time::Duration::from_secs(25));
    }

    #[test]
    fn missing_field_is_named_with_its_path() {
        let mut v = minimal();
        v["resources"] = json!([{"api_version": "v1", "kind": "Pod"}, {"api_version": "v1"}]);
        assert_eq!(errors_of(v), ["resources[1].kind: missing field"]);
    }

    #[test]
    fn unknown_field_is_named() {
        let mut v = minimal();
        v["sinks"][0]["max_pendng"] = json!(3);
        let e = errors_of(v);
        assert!(
            e[0].starts_with("sinks[0].max_pendng: unknown field `max_pendng`"),
            "{e:?}"
        );
    }

    #[test]
    fn cross_field_errors_are_all_reported() {
        let mut v = minimal();
        v["routes"] = json!([{"resource": "pods", "sinks": ["nowhere"]}]);
        v["resources"][0]["resync_period"] = json!("200ms");
        let e = errors_of(v);
        assert!(
            e.contains(&"routes[0].resource: no resource is named \"pods\"".to_string()),
            "{e:?}"
        );
        assert!(
            e.contains(&"routes[0].sinks[0]: no sink is named \"nowhere\"".to_string()),
            "{e:?}"
        );
        assert!(
            e.contains(&"resources[0].resync_period: must be 0 (off) or at least 1s".to_string()),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|l| l.starts_with("resources[0]: \"configmap\" is not used")),
            "{e:?}"
        );
    }

    #[test]
    fn two_entries_that_can_select_one_object_for_one_sink_are_refused_naming_both() {
        let with = |resources: serde_json::Value, sinks: [&[&str]; 2]| {
            let mut v = minimal();
            v["sinks"] =
                json!([{"name": "out", "type": "stdout"}, {"name": "other", "type": "stdout"}]);
            let names: Vec<String> = resources
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["name"].as_str().unwrap().to_owned())
                .collect();
            v["resources"] = resources;
            v["routes"] = json!([
                {"resource": names[0], "sinks": sinks[0]},
                {"resource": names[1], "sinks": sinks[1]},
            ]);
            Config::from_value(v)
        };
        let shop = json!({"name": "shop", "api_version": "v1", "kind": "ConfigMap", "filter": "object.metadata.labels['team'] == 'shop'"});
        let all_core = json!({"name": "core", "api_version": "v1", "kind": "*"});
        // A wildcard and an explicit entry of the same kind, to one sink.
        let e = match with(json!([all_core, shop]), [&["out"], &["out"]]) {
            Err(Error::Invalid(e)) => e,
            other => panic!("expected invalid, got {other:?}"),
        };
        assert!(
            e.iter().any(|l| l
                .starts_with("routes[1]: resources \"core\" and \"shop\" can both select")
                && l.contains("sink \"out\"")),
            "{e:?}"
        );
        // Two filters of one kind (an object can move between them), to one sink.
        let billing =
            json!({"name": "billing", "api_version": "v1", "kind": "ConfigMap", "filter": "true"});
        assert!(with(json!([shop, billing]), [&["out"], &["out"]]).is_err());
        // Allowed: different sinks, disjoint namespaces, a kind the wildcard excludes, other
        // groups, another version of another group's kind.
        assert!(with(json!([shop, billing]), [&["out"], &["other"]]).is_ok());
        let a = json!({"name": "a", "api_version": "v1", "kind": "ConfigMap", "namespaces": ["a"]});
        let b = json!({"name": "b", "api_version": "v1", "kind": "ConfigMap", "namespaces": ["b"]});
        assert!(with(json!([a, b]), [&["out"], &["out"]]).is_ok());
        let not_a = json!({"name": "not-a", "api_version": "v1", "kind": "ConfigMap", "exclude_namespaces": ["a"]});
        assert!(with(json!([a, not_a]), [&["out"], &["out"]]).is_ok());
        assert!(with(json!([b, not_a]), [&["out"], &["out"]]).is_err());
        let but_cm =
            json!({"name": "core", "api_version": "v1", "kind": "*", "exclude": ["ConfigMap"]});
        assert!(with(json!([but_cm, shop]), [&["out"], &["out"]]).is_ok());
        let apps = json!({"name": "apps", "api_version": "apps/*", "kind": "*"});
        assert!(with(json!([apps, shop]), [&["out"], &["out"]]).is_ok());
        let everything = json!({"name": "all", "api_version": "*", "kind": "*"});
        assert!(with(json!([everything, shop]), [&["out"], &["out"]]).is_err());
        let d1 = json!({"name": "d1", "api_version": "apps/v1", "kind": "Deployment"});
        let d2 = json!({"name": "d2", "api_version": "apps/v1beta1", "kind": "Deployment"});
        assert!(
            with(json!([d1, d2]), [&["out"], &["out"]]).is_err(),
            "versions do not make kinds"
        );
    }

    #[test]
    fn a_zero_checkpoint_interval_is_an_error_naming_the_field() {
        let mut v = minimal();
        v["sinks"][0]["checkpoint_interval"] = json!("0s");
        let e = errors_of(v);
        assert!(
            e.iter()
                .any(|l| l.starts_with("sinks[0].checkpoint_interval: must be at least 10ms")),
            "{e:?}"
        );
    }

    #[test]
    fn bad_api_version_and_namespace() {
        let mut v = minimal();
        v["resources"][0]["api_version"] = json!("apps/");
        v["resources"][0]["namespaces"] = json!(["Default"]);
        let e = errors_of(v);
        assert!(
            e.iter().any(|l| l.starts_with("resources[0].api_version:")),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|l| l.starts_with("resources[0].namespaces[0]:")),
            "{e:?}"
        );
    }

    #[test]
    fn default_names_include_the_group() {
        let mut v = minimal();
        v["resources"] = json!([{"apiVersion": "apps/v1", "kind": "Deployment"}]);
        v["routes"][0]["resource"] = json!("deployment.apps");
        Config::from_value(v).unwrap();
    }

    #[test]
    fn nats_sink_problems_are_named_by_path() {
        let mut v = minimal();
        v["sinks"] = json!([{"name": "out", "type": "nats", "nats": {
            "servers": [],
            "subject": "k8s.{nope}",
            "auth": {"token": {"file": "/t", "env": "T"}, "user": "u"},
        }}]);
        let e = errors_of(v);
        for expected in [
            "sinks[0].nats.servers: at least one server URL is required",
            "sinks[0].nats.subject: unknown placeholder {nope}",
            "sinks[0].nats.stream: jetstream mode needs the stream",
            "sinks[0].nats.auth: choose one of token, user/password, nkey_seed, credentials_file",
            "sinks[0].nats.auth: user and password go together",
            "sinks[0].nats.auth.token: give exactly one of `file` and `env`",
        ] {
            assert!(
                e.iter().any(|l| l.starts_with(expected)),
                "{expected:?} not in {e:?}"
            );
        }
        let mut v = minimal();
        v["sinks"][0]["nats"] = json!({"servers": ["nats://x:4222"]});
        assert!(
            errors_of(v).contains(
                &"sinks[0].nats: only a sink of type nats takes this section".to_string()
            )
        );
    }

    #[test]
    fn exactly_once_settings_are_checked() {
        let mut v = minimal();
        v["sinks"] = json!([{"name": "out", "type": "kafka", "kafka": {
            "brokers": ["k:9092"],
            "exactly_once": true,
            "transaction_interval": "1ms",
            "transaction_timeout": "20s",
            "delivery_timeout": "30s",
            "properties": {"transactional.id": "mine"},
        }}]);
        v["leader_election"] = json!({"enabled": true, "identity": "a"});
        v["sharding"] = json!({"shards": 4});
        let e = errors_of(v.clone());
        for expected in [
            "sinks[0].kafka.transaction_interval: must be at least 10ms",
            "sinks[0].kafka.transaction_timeout: must exceed transaction_interval + delivery_timeout",
            "sinks[0].kafka.properties.transactional.id: set by the sink itself",
        ] {
            assert!(
                e.iter().any(|l| l.starts_with(expected)),
                "{expected:?} not in {e:?}"
            );
        }
        // Sharded, it is fine; as a dead-letter sink it is not.
        let mut d = minimal();
        d["leader_election"] = json!({"enabled": true, "identity": "a"});
        d["sharding"] = json!({"shards": 4});
        d["sinks"] = json!([
            {"name": "out", "type": "kafka", "dead_letter": "dlq",
             "kafka": {"brokers": ["k:9092"], "exactly_once": true}},
            {"name": "dlq", "type": "kafka",
             "kafka": {"brokers": ["k:9092"], "exactly_once": true}},
        ]);
        let e = errors_of(d.clone());
        assert!(
            e.len() == 1 && e[0].starts_with("sinks[0].dead_letter: sink \"dlq\" has exactly_once"),
            "{e:?}"
        );
        d["sinks"][1]["kafka"]["exactly_once"] = json!(false);
        assert!(Config::from_value(d).is_ok());
        // Off, none of it applies.
        v["sinks"][0]["kafka"]["exactly_once"] = json!(false);
        v["sinks"][0]["kafka"]["properties"] = json!({});
        assert!(Config::from_value(v.clone()).is_ok());
        // Without resume every restart would send everything again.
        v["sharding"] = json!({"shards": 1});
        v["sinks"][0]["kafka"] = json!({"brokers": ["k:9092"], "exactly_once": true});
        v["sinks"][0]["resume"] = json!(false);
        let e = errors_of(v);
        assert!(
            e.iter()
                .any(|l| l.starts_with("sinks[0].resume: exactly_once needs resume")),
            "{e:?}"
        );
    }

    #[test]
    fn kafka_sink_problems_are_named_by_path() {
        let mut v = minimal();
        v["sinks"] = json!([{"name": "out", "type": "kafka", "kafka": {
            "brokers": [],
            "topic": "k8s.{name}",
            "mode": "state",
            "encoding": "binary",
            "properties": {"acks": "1", "ssl.keystore.password": "s3cret",
                           "delivery.report.only.error": "true"},
            "sasl": {"mechanism": "PLAIN", "username": "u", "password": {}},
        }}]);
        let e = errors_of(v);
        assert!(!e.iter().any(|l| l.contains("s3cret")), "{e:?}");
        for expected in [
            "sinks[0].kafka.properties.ssl.keystore.password: a secret may not be inline",
            "sinks[0].kafka.brokers: at least one broker is required",
            "sinks[0].kafka.topic: placeholder {name} is not allowed here",
            "sinks[0].kafka.encoding: state mode writes objects",
            "sinks[0].kafka.properties.acks: set by the sink itself",
            "sinks[0].kafka.properties.delivery.report.only.error: the sink needs every message's delivery report",
            "sinks[0].kafka.sasl.password: give exactly one of `file` and `env`",
        ] {
            assert!(
                e.iter().any(|l| l.starts_with(expected)),
                "{expected:?} not in {e:?}"
            );
        }
        let mut v = minimal();
        v["sinks"][0]["type"] = json!("kafka");
        v["sinks"][0]["kafka"] = json!({"brokers": ["b:9092"], "topic": "k8s/{resource}"});
        let e = errors_of(v);
        assert!(
            e.iter().any(|l| l.starts_with(
                "sinks[0].kafka.topic: \"k8s/{resource}\" does not make valid topic names"
            )),
            "{e:?}"
        );
    }

    #[test]
    fn every_shipped_config_loads() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "yaml") {
                Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                n += 1;
            }
        }
        assert!(n > 0, "no config files found");
    }
}
