//! Settings: a YAML file plus `KEB_` environment overrides, validated before anything starts.
//!
//! Every struct denies unknown fields and every field carries a `///` line: those lines are the
//! README's config reference (a test keeps the two in sync). Errors name the field path
//! (`resources[2].kind: missing field`) so that a bad config can be fixed without reading code.

use std::{collections::HashSet, net::SocketAddr, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

/// Errors while loading or validating the configuration. All of them are fatal at start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read or is not valid YAML.
    #[error("cannot load config from {path}: {source}")]
    Load {
        /// The file that was given.
        path: PathBuf,
        /// What the `config` crate reported.
        #[source]
        source: config::ConfigError,
    },
    /// One or more fields are wrong; each line names the field path and the reason.
    #[error("invalid config:\n  {}", .0.join("\n  "))]
    Invalid(Vec<String>),
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The whole configuration of one kube-event-bridge process.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// The resources to watch; each one is served by a shared informer.
    pub resources: Vec<ResourceConfig>,
    /// Where notifications go.
    pub sinks: Vec<SinkConfig>,
    /// Which resources go to which sinks.
    pub routes: Vec<RouteConfig>,
}

/// How to reach the Kubernetes API server.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Path of a kubeconfig file; unset means `$KUBECONFIG`, then `~/.kube/config`, then in-cluster.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use; unset means the file's current context.
    #[serde(default)]
    pub context: Option<String>,
    /// Objects per page of a list request (client-go uses 500).
    #[serde(default = "default_page_size")]
    pub page_size: u32,
    /// Use a streaming watch-list (`sendInitialEvents=true`) for the initial state instead of a
    /// paged list; needs the WatchList feature on the server (on by default from Kubernetes 1.35).
    #[serde(default)]
    pub streaming_list: bool,
    /// Server-side timeout of each watch request, in seconds (the watcher re-watches after it).
    #[serde(default = "default_watch_timeout")]
    pub watch_timeout_seconds: u32,
    /// Fail the start when a configured kind is not served; otherwise it waits as pending.
    #[serde(default)]
    pub require_all_resources: bool,
    /// How often discovery is asked again whether pending kinds are served now and watched
    /// kinds still are (besides at every CRD change, when CRDs may be watched).
    #[serde(default = "default_discovery_refresh", with = "humantime_serde")]
    pub discovery_refresh: Duration,
    /// Requests per second to the API server, over every list, watch, discovery and lease
    /// request (client-side rate limit, as client-go's QPS).
    #[serde(default = "default_qps")]
    pub qps: f64,
    /// Requests the rate limit lets through at once.
    #[serde(default = "default_burst")]
    pub burst: u32,
    /// A watch that delivers neither an event nor a bookmark for this long is restarted from
    /// its last resourceVersion and counted; 0 leaves it to kube's idle timeout (the watch
    /// timeout plus 5 s).
    #[serde(default = "default_watch_stall_timeout", with = "humantime_serde")]
    pub watch_stall_timeout: Duration,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            context: None,
            page_size: default_page_size(),
            streaming_list: false,
            watch_timeout_seconds: default_watch_timeout(),
            require_all_resources: false,
            discovery_refresh: default_discovery_refresh(),
            qps: default_qps(),
            burst: default_burst(),
            watch_stall_timeout: default_watch_stall_timeout(),
        }
    }
}

/// The admin HTTP server.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address to listen on; port 0 picks a free port (logged at start).
    #[serde(default = "default_admin_address")]
    pub address: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            address: default_admin_address(),
        }
    }
}

/// Logging.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `pretty` for people, `json` for log collectors.
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

/// Log output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Pretty,
    /// One JSON object per line.
    Json,
}

/// What goes into each message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageConfig {
    /// Put the previous state in `data.oldObject` of update messages.
    #[serde(default = "default_true")]
    pub include_old_object: bool,
    /// Remove `metadata.managedFields` from objects (it is large and rarely useful downstream).
    #[serde(default = "default_true")]
    pub strip_managed_fields: bool,
    /// Keep the values of a Secret's `data` and `stringData`; by default they are redacted.
    #[serde(default)]
    pub allow_secret_data: bool,
    /// `none`, or `patch`: update messages carry `data.patch`, an RFC 6902 JSON Patch from the
    /// last published state to the new object (`include_old_object: false` then saves bytes).
    #[serde(default)]
    pub diff: DiffMode,
}

impl Default for MessageConfig {
    fn default() -> Self {
        Self {
            include_old_object: true,
            strip_managed_fields: true,
            allow_secret_data: false,
            diff: DiffMode::None,
        }
    }
}

/// Shutdown behaviour.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// How long SIGTERM/SIGINT waits for pending notifications to be delivered before giving up.
    #[serde(default = "default_grace_period", with = "humantime_serde")]
    pub grace_period: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace_period: default_grace_period(),
        }
    }
}

/// Leader election on a `coordination.k8s.io/v1` Lease. Durations are client-go's defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaderElectionConfig {
    /// Elect one leader among the replicas; only the leader publishes, standbys keep warm
    /// caches. Off for a single replica.
    #[serde(default)]
    pub enabled: bool,
    /// Name of the Lease.
    #[serde(default = "default_lease_name")]
    pub lease_name: String,
    /// Namespace of the Lease; unset means `$POD_NAMESPACE`, then the service account's.
    #[serde(default)]
    pub namespace: Option<String>,
    /// This replica's identity in the Lease; unset means `$POD_NAME`, then the host name.
    #[serde(default)]
    pub identity: Option<String>,
    /// How long a lease lasts without renewal before another replica may take it.
    #[serde(default = "default_lease_duration", with = "humantime_serde")]
    pub lease_duration: Duration,
    /// How long the leader tries to renew before it stops publishing; below `lease_duration`,
    /// so that it stops before anyone else can start.
    #[serde(default = "default_renew_deadline", with = "humantime_serde")]
    pub renew_deadline: Duration,
    /// Pause between attempts to acquire or renew the lease.
    #[serde(default = "default_retry_period", with = "humantime_serde")]
    pub retry_period: Duration,
}

impl Default for LeaderElectionConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            lease_name: default_lease_name(),
            namespace: None,
            identity: None,
            lease_duration: default_lease_duration(),
            renew_deadline: default_renew_deadline(),
            retry_period: default_retry_period(),
        }
    }
}

fn default_lease_name() -> String {
    "kube-event-bridge".into()
}
// client-go's leader election defaults: 15 s lease, 10 s renew deadline, 2 s retry period.
fn default_lease_duration() -> Duration {
    Duration::from_secs(15)
}
fn default_renew_deadline() -> Duration {
    Duration::from_secs(10)
}
fn default_retry_period() -> Duration {
    Duration::from_secs(2)
}

/// One resource to watch.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceConfig {
    /// Name that routes and metric labels use; defaults to the lower-case kind, with `.group`
    /// for non-core groups (`pod`, `deployment.apps`).
    #[serde(default)]
    pub name: Option<String>,
    /// API version, `v1` for the core group or `group/version` (`apps/v1`, `example.com/v1`);
    /// with `kind: "*"` also `group/*` (the group's preferred version) or `*` (every group).
    #[serde(alias = "apiVersion")]
    pub api_version: String,
    /// Kind, as in an object's `kind` field (`Pod`, `Deployment`, a CRD's kind), or `*` for
    /// every kind of the API version that supports list and watch (needs `name`).
    pub kind: String,
    /// With `kind: "*"`: kinds left out, as `Kind` (any group) or `group/Kind` (`Event`,
    /// `events.k8s.io/Event`; the core group is `core/Kind`).
    #[serde(default)]
    pub exclude: Vec<String>,
    /// With `kind: "*"`: `namespaced`, `cluster` or `all` kinds.
    #[serde(default)]
    pub scope: ScopeSelection,
    /// Namespaces to watch; empty means all namespaces (and is required for cluster-scoped kinds).
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Label selector, as `kubectl -l` takes it.
    #[serde(default)]
    pub label_selector: Option<String>,
    /// Field selector, as `kubectl --field-selector` takes it.
    #[serde(default)]
    pub field_selector: Option<String>,
    /// Period of resync notifications (`synced`) for every cached object; unset or 0 disables
    /// them. At least 1s.
    #[serde(default, with = "humantime_serde")]
    pub resync_period: Option<Duration>,
    /// Which notification types to emit.
    #[serde(default = "all_event_types")]
    pub events: Vec<EventType>,
    /// Namespaces left out (with `namespaces` empty: every namespace but these), e.g.
    /// `[kube-system]`; the API server filters them (`metadata.namespace!=…` field selectors),
    /// so their objects are neither sent nor cached.
    #[serde(default)]
    pub exclude_namespaces: Vec<String>,
    /// A CEL expression over `object`, `oldObject` and `type` (`added`, `updated`, `deleted`,
    /// `synced`); only notifications for which it is true are published, plus what keeps
    /// consumers' state right (deletes of published objects, `k8sfilteredout` deletes).
    /// Example: `object.metadata.labels["team"] == "shop" && type != "synced"`.
    #[serde(default)]
    pub filter: Option<String>,
    /// What an evaluation error of `filter` (a field missing on an object) does: `pass`
    /// publishes the notification, `drop` drops it; either is counted and logged once per
    /// object.
    #[serde(default)]
    pub filter_error: FilterErrorPolicy,
    /// JSON pointers (`/status`, `/metadata/resourceVersion`): an update that changes only
    /// these fields is not published; the next published one carries the newest state.
    #[serde(default)]
    pub ignore_fields: Vec<String>,
}

/// What an evaluation error of a resource's `filter` does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FilterErrorPolicy {
    /// Publish the notification.
    #[default]
    Pass,
    /// Drop the notification (counted in `keb_filtered_total{reason="filter_error"}`).
    Drop,
}

/// What update messages carry besides the new object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiffMode {
    /// Nothing more.
    #[default]
    None,
    /// `data.patch`: an RFC 6902 JSON Patch from `oldObject` to `object`.
    Patch,
}

/// Which kinds a `kind: "*"` selection takes by scope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScopeSelection {
    /// Namespaced and cluster-scoped kinds.
    #[default]
    All,
    /// Namespaced kinds only.
    Namespaced,
    /// Cluster-scoped kinds only.
    Cluster,
}

impl ResourceConfig {
    /// The field selector the informers of a `namespaced` (or cluster-scoped) kind use:
    /// `field_selector`, and for a namespaced kind watched in every namespace one
    /// `metadata.namespace!=…` per excluded namespace, so that the API server leaves those
    /// objects out of lists and watches (they are never cached). Cluster-scoped kinds have no
    /// namespace field to select on.
    pub fn effective_field_selector(&self, namespaced: bool) -> Option<String> {
        let excluded = (namespaced && self.namespaces.is_empty())
            .then_some(&self.exclude_namespaces)
            .into_iter()
            .flatten()
            .map(|ns| format!("metadata.namespace!={ns}"));
        let all: Vec<String> = self
            .field_selector
            .iter()
            .filter(|f| !f.is_empty())
            .cloned()
            .chain(excluded)
            .collect();
        (!all.is_empty()).then(|| all.join(","))
    }

    /// Whether this entry selects kinds by pattern (`kind: "*"`).
    pub fn is_wildcard(&self) -> bool {
        self.kind == "*"
    }

    /// Whether `exclude` leaves out `kind` of `group` (`""` for core).
    pub fn excludes(&self, group: &str, kind: &str) -> bool {
        let group = if group.is_empty() { "core" } else { group };
        self.exclude.iter().any(|e| match e.rsplit_once('/') {
            Some((g, k)) => g == group && k == kind,
            None => e == kind,
        })
    }

    /// The name routes use: the explicit `name`, else `kind` lower-cased plus `.group`.
    pub fn effective_name(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        let kind = self.kind.to_lowercase();
        match self.api_version.split_once('/') {
            Some((group, _)) => format!("{kind}.{group}"),
            None => kind,
        }
    }

    /// The resync period, with 0 meaning none.
    pub fn resync(&self) -> Option<Duration> {
        self.resync_period.filter(|p| !p.is_zero())
    }
}

/// A notification type. The discriminants index per-type arrays (metrics, filters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventType {
    /// An object appeared (initial list or created).
    Added = 0,
    /// An object changed.
    Updated,
    /// An object was deleted.
    Deleted,
    /// Periodic resync of an unchanged object.
    Synced,
}

impl EventType {
    /// Every type, in discriminant order.
    pub const ALL: [EventType; 4] = [Self::Added, Self::Updated, Self::Deleted, Self::Synced];

    /// The lower-case name used in message types and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "added",
            Self::Updated => "updated",
            Self::Deleted => "deleted",
            Self::Synced => "synced",
        }
    }
}

/// One sink: where notifications are published.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// Name that routes and metric labels use.
    pub name: String,
    /// Sink type; the section of the same name holds its settings.
    #[serde(rename = "type")]
    pub kind: SinkType,
    /// Most notifications waiting for this sink (all its routes together, being published
    /// included); beyond it, what arrives for an object with something pending is merged into
    /// it (one entry per object until a delete). Deletes and the newest state of each object
    /// are never dropped.
    #[serde(default = "default_max_pending")]
    pub max_pending: usize,
    /// Delivery workers per route (resource to this sink); each publishes one object's
    /// notifications at a time, in order.
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// How failed publishes are retried.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Optional limit on publishes per second, to protect the destination.
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
    /// Name of another sink that receives a small reference record (id, key, reason, size)
    /// for every message that fails for good.
    #[serde(default)]
    pub dead_letter: Option<String>,
    /// Keep a checkpoint of what this sink acknowledged and resume from it at start and on
    /// becoming leader: changes made while down are published (deletes included), unchanged
    /// objects are not. For sinks that can store one: `kafka` (`kafka.checkpoint_topic`),
    /// `nats` in `jetstream` mode (`nats.checkpoint_bucket`) and `stdout` with a `path` (a
    /// file beside it); elsewhere it is ignored, with a log line.
    #[serde(default = "default_resume")]
    pub resume: bool,
    /// How often acknowledged changes are written to the checkpoint.
    #[serde(default = "default_checkpoint_interval", with = "humantime_serde")]
    pub checkpoint_interval: Duration,
    /// Settings of a `stdout` sink.
    #[serde(default)]
    pub stdout: Option<StdoutSinkConfig>,
    /// Settings of a `nats` sink.
    #[serde(default)]
    pub nats: Option<crate::sinks::nats::NatsSinkConfig>,
    /// Settings of a `kafka` sink.
    #[serde(default)]
    pub kafka: Option<crate::sinks::kafka::KafkaSinkConfig>,
}

impl SinkConfig {
    /// The CloudEvents content mode of this sink's messages.
    pub fn encoding(&self) -> crate::message::Encoding {
        match (self.kind, &self.nats, &self.kafka) {
            (SinkType::Nats, Some(n), _) => n.encoding,
            (SinkType::Kafka, _, Some(k)) => k.message_encoding(),
            _ => crate::message::Encoding::Structured,
        }
    }
}

/// Retries of failed publishes: client-go's default controller rate limiter, max of a per-object
/// exponential backoff and an overall token bucket.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// First delay of an object's retries; it doubles with each failure.
    #[serde(default = "default_retry_base", with = "humantime_serde")]
    pub base_delay: Duration,
    /// Longest delay of an object's retries.
    #[serde(default = "default_retry_max", with = "humantime_serde")]
    pub max_delay: Duration,
    /// Retries per second over all objects of a route, after `burst`.
    #[serde(default = "default_retry_qps")]
    pub qps: f64,
    /// Retries allowed at once over all objects of a route.
    #[serde(default = "default_retry_burst")]
    pub burst: u32,
    /// Retries of one notification before it fails for good (and goes to the dead-letter
    /// sink); unset means retry forever.
    #[serde(default)]
    pub max_retries: Option<u32>,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            base_delay: default_retry_base(),
            max_delay: default_retry_max(),
            qps: default_retry_qps(),
            burst: default_retry_burst(),
            max_retries: None,
        }
    }
}

/// A publish rate limit.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Publishes per second, sustained.
    pub qps: f64,
    /// Publishes allowed at once after a quiet period.
    #[serde(default = "default_rate_limit_burst")]
    pub burst: u32,
}

/// A secret, read at start from a file or an environment variable. Secrets are never written
/// inline in the config, so `check-config` and logs can show the config safely.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    /// Read the secret from this file (surrounding whitespace is trimmed).
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// Read the secret from this environment variable.
    #[serde(default)]
    pub env: Option<String>,
}

impl SecretRef {
    /// Why this reference is unusable, if it is: exactly one of `file` and `env` is needed.
    pub fn problem(&self) -> Option<String> {
        match (&self.file, &self.env) {
            (Some(_), None) | (None, Some(_)) => None,
            _ => Some("give exactly one of `file` and `env`".into()),
        }
    }

    /// Reads the secret. The error names where it looked, never the value.
    pub fn resolve(&self) -> std::result::Result<String, String> {
        match (&self.file, &self.env) {
            (Some(path), None) => std::fs::read_to_string(path)
                .map(|s| s.trim().to_owned())
                .map_err(|e| format!("cannot read secret file {}: {e}", path.display())),
            (None, Some(var)) => {
                std::env::var(var).map_err(|_| format!("environment variable {var} is not set"))
            }
            _ => Err("give exactly one of `file` and `env`".into()),
        }
    }
}

/// Sink types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkType {
    /// JSON lines on standard output or in a file; needs no broker.
    Stdout,
    /// NATS subjects, JetStream (default) or core NATS.
    Nats,
    /// Kafka topics.
    Kafka,
}

/// Settings of a `stdout` sink.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdoutSinkConfig {
    /// Append to this file instead of writing to standard output.
    #[serde(default)]
    pub path: Option<PathBuf>,
}

/// Which resources go to which sinks.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
// client-go's ListPager page size.
fn default_page_size() -> u32 {
    500
}
// Below kube-apiserver's 5-10 min range, so that proxies with shorter idle limits don't cut it.
fn default_watch_timeout() -> u32 {
    290
}
fn default_discovery_refresh() -> Duration {
    Duration::from_secs(60)
}
// kubectl's QPS; client-go's 5/10 is too low for dozens of informers listing at start.
fn default_qps() -> f64 {
    50.0
}
// Lets about a hundred informers start their lists at once.
fn default_burst() -> u32 {
    100
}
// The API server sends a bookmark about every minute: two missed, plus some slack.
fn default_watch_stall_timeout() -> Duration {
    Duration::from_secs(150)
}
fn default_admin_address() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}
fn default_log_level() -> String {
    "info".into()
}
fn default_true() -> bool {
    true
}
// Kubernetes gives a pod 30 s between SIGTERM and SIGKILL by default; leave some of it for exit.
fn default_grace_period() -> Duration {
    Duration::from_secs(25)
}
fn all_event_types() -> Vec<EventType> {
    vec![
        EventType::Added,
        EventType::Updated,
        EventType::Deleted,
        EventType::Synced,
    ]
}
// About 100 MB of 1 KB objects: a sink may lag by that much before updates are coalesced.
fn default_max_pending() -> usize {
    100_000
}
/// Resume is what makes restarts lose no delete, so it is on wherever a sink can store a
/// checkpoint.
fn default_resume() -> bool {
    true
}
/// One second bounds what a crash re-sends to a second's worth of acknowledgements.
fn default_checkpoint_interval() -> Duration {
    Duration::from_secs(1)
}
fn default_workers() -> usize {
    8
}
// client-go's DefaultControllerRateLimiter: 5 ms .. 1000 s per item, 10 qps burst 100 overall.
fn default_retry_base() -> Duration {
    Duration::from_millis(5)
}
fn default_retry_max() -> Duration {
    Duration::from_secs(1000)
}
fn default_retry_qps() -> f64 {
    10.0
}
fn default_retry_burst() -> u32 {
    100
}
fn default_rate_limit_burst() -> u32 {
    1
}

/// Environment variables with this prefix override file settings: `KEB_ADMIN__ADDRESS`,
/// `KEB_LOG__LEVEL`, `KEB_KUBERNETES__CONTEXT`.
pub const ENV_PREFIX: &str = "KEB";

impl Config {
    /// Loads `path`, applies `KEB_*` environment overrides, deserializes and validates.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let load_err = |source| Error::Load {
            path: path.to_owned(),
            source,
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

    /// Cross-field checks that serde cannot express. Reports every problem, not just the first.
    pub fn validate(&self) -> Result<()> {
        let mut errors = Vec::new();
        let mut err = |path: String, msg: String| errors.push(format!("{path}: {msg}"));

        if self.cluster.trim().is_empty() {
            err("cluster".into(), "must not be empty".into());
        }
        if self.kubernetes.page_size == 0 {
            err("kubernetes.page_size".into(), "must be at least 1".into());
        }
        if self.kubernetes.watch_timeout_seconds == 0 {
            err(
                "kubernetes.watch_timeout_seconds".into(),
                "must be at least 1".into(),
            );
        }
        if self.kubernetes.discovery_refresh < Duration::from_secs(1) {
            err(
                "kubernetes.discovery_refresh".into(),
                "must be at least 1s".into(),
            );
        }
        if !(self.kubernetes.qps.is_finite() && self.kubernetes.qps > 0.0) {
            err("kubernetes.qps".into(), "must be a positive number".into());
        }
        if self.kubernetes.burst == 0 {
            err("kubernetes.burst".into(), "must be at least 1".into());
        }
        let stall = self.kubernetes.watch_stall_timeout;
        if !stall.is_zero() && stall < Duration::from_secs(1) {
            err(
                "kubernetes.watch_stall_timeout".into(),
                "must be 0 (off) or at least 1s".into(),
            );
        }
        if self
            .log
            .level
            .parse::<tracing_subscriber::EnvFilter>()
            .is_err()
        {
            err(
                "log.level".into(),
                format!("{:?} is not a valid tracing filter", self.log.level),
            );
        }
        let le = &self.leader_election;
        if le.renew_deadline >= le.lease_duration {
            err(
                "leader_election.renew_deadline".into(),
                "must be shorter than lease_duration (fencing)".into(),
            );
        }
        if le.retry_period.is_zero() || le.retry_period >= le.renew_deadline {
            err(
                "leader_election.retry_period".into(),
                "must be above 0 and shorter than renew_deadline".into(),
            );
        }
        if le.lease_duration < Duration::from_secs(1) {
            err(
                "leader_election.lease_duration".into(),
                "must be at least 1s".into(),
            );
        }
        if self.resources.is_empty() {
            err(
                "resources".into(),
                "at least one resource is required".into(),
            );
        }
        let mut resource_names = HashSet::new();
        for (i, r) in self.resources.iter().enumerate() {
            let at = |field: &str| format!("resources[{i}].{field}");
            let name = r.effective_name();
            if !resource_names.insert(name.clone()) {
                err(
                    at("name"),
                    format!("{name:?} is used by another resource; set distinct names"),
                );
            }
            if r.is_wildcard() {
                let group_wildcard = r.api_version == "*"
                    || r.api_version
                        .strip_suffix("/*")
                        .is_some_and(|g| check_api_version(&format!("{g}/v1")).is_ok());
                if !group_wildcard && let Err(reason) = check_api_version(&r.api_version) {
                    err(
                        at("api_version"),
                        format!("{reason}, `group/*` or `*` with kind \"*\""),
                    );
                }
                if r.name.is_none() {
                    err(
                        at("name"),
                        "required with kind \"*\": routes and metric labels name the selection"
                            .into(),
                    );
                }
                for (j, e) in r.exclude.iter().enumerate() {
                    let kind = e.rsplit_once('/').map_or(e.as_str(), |(_, k)| k);
                    if kind.is_empty() || !kind.chars().all(|c| c.is_ascii_alphanumeric()) {
                        err(
                            format!("resources[{i}].exclude[{j}]"),
                            format!("{e:?} is not `Kind` or `group/Kind`"),
                        );
                    }
                }
            } else {
                if let Err(reason) = check_api_version(&r.api_version) {
                    err(at("api_version"), reason);
                }
                if r.kind.is_empty() || !r.kind.chars().all(|c| c.is_ascii_alphanumeric()) {
                    err(
                        at("kind"),
                        format!(
                            "{:?} is not a kind (letters and digits, e.g. Pod, or `*`)",
                            r.kind
                        ),
                    );
                }
                if !r.exclude.is_empty() {
                    err(at("exclude"), "only with kind \"*\"".into());
                }
                if r.scope != ScopeSelection::All {
                    err(at("scope"), "only with kind \"*\"".into());
                }
            }
            let mut seen = HashSet::new();
            for (j, ns) in r.namespaces.iter().enumerate() {
                if !is_dns_label(ns) {
                    err(
                        format!("resources[{i}].namespaces[{j}]"),
                        format!("{ns:?} is not a namespace name"),
                    );
                } else if !seen.insert(ns) {
                    err(
                        format!("resources[{i}].namespaces[{j}]"),
                        format!("{ns:?} is listed twice"),
                    );
                }
            }
            if r.resync().is_some_and(|p| p < Duration::from_secs(1)) {
                err(at("resync_period"), "must be 0 (off) or at least 1s".into());
            }
            if r.events.is_empty() {
                err(at("events"), "at least one event type is required".into());
            }
            for (j, ns) in r.exclude_namespaces.iter().enumerate() {
                let at = format!("resources[{i}].exclude_namespaces[{j}]");
                if !is_dns_label(ns) {
                    err(at, format!("{ns:?} is not a namespace name"));
                } else if r.namespaces.contains(ns) {
                    err(at, format!("{ns:?} is also in namespaces"));
                }
            }
            if let Some(filter) = &r.filter
                && let Err(reason) = crate::pipeline::filter::Expr::compile(filter)
            {
                err(at("filter"), format!("{reason} (in `{filter}`)"));
            }
            for (j, p) in r.ignore_fields.iter().enumerate() {
                if !p.starts_with('/') || p.len() < 2 {
                    err(
                        format!("resources[{i}].ignore_fields[{j}]"),
                        format!("{p:?} is not a JSON pointer to a field (like \"/status\")"),
                    );
                }
            }
        }
        if self.sinks.is_empty() {
            err("sinks".into(), "at least one sink is required".into());
        }
        let mut sink_names = HashSet::new();
        for (i, s) in self.sinks.iter().enumerate() {
            let at = |field: &str| format!("sinks[{i}].{field}");
            if s.name.is_empty() {
                err(at("name"), "must not be empty".into());
            } else if !sink_names.insert(s.name.as_str()) {
                err(at("name"), format!("{:?} is used by another sink", s.name));
            }
            let sections = [
                (SinkType::Stdout, "stdout", s.stdout.is_some()),
                (SinkType::Nats, "nats", s.nats.is_some()),
                (SinkType::Kafka, "kafka", s.kafka.is_some()),
            ];
            for (kind, section, present) in sections {
                if present && s.kind != kind {
                    err(
                        at(section),
                        format!("only a sink of type {section} takes this section"),
                    );
                }
            }
            if s.kind == SinkType::Nats {
                match &s.nats {
                    None => err(
                        at("nats"),
                        "a nats sink needs this section (at least `servers`)".into(),
                    ),
                    Some(n) => {
                        for (path, reason) in n.validate() {
                            err(at(&format!("nats.{path}")), reason);
                        }
                    }
                }
            }
            if s.kind == SinkType::Kafka {
                match &s.kafka {
                    None => err(
                        at("kafka"),
                        "a kafka sink needs this section (at least `brokers`)".into(),
                    ),
                    Some(k) => {
                        for (path, reason) in k.validate() {
                            err(at(&format!("kafka.{path}")), reason);
                        }
                    }
                }
            }
            if s.max_pending == 0 {
                err(at("max_pending"), "must be at least 1".into());
            }
            if s.workers == 0 {
                err(at("workers"), "must be at least 1".into());
            }
            if s.checkpoint_interval < Duration::from_millis(10) {
                err(
                    at("checkpoint_interval"),
                    "must be at least 10ms (each interval writes a batch to the store)".into(),
                );
            }
            if s.retry.base_delay.is_zero() || s.retry.base_delay > s.retry.max_delay {
                err(
                    at("retry.base_delay"),
                    "must be above 0 and at most retry.max_delay".into(),
                );
            }
            if !(s.retry.qps > 0.0 && s.retry.qps.is_finite()) {
                err(at("retry.qps"), "must be a positive number".into());
            }
            if s.retry.burst == 0 {
                err(at("retry.burst"), "must be at least 1".into());
            }
            if let Some(limit) = &s.rate_limit {
                if !(limit.qps > 0.0 && limit.qps.is_finite()) {
                    err(at("rate_limit.qps"), "must be a positive number".into());
                }
                if limit.burst == 0 {
                    err(at("rate_limit.burst"), "must be at least 1".into());
                }
            }
        }
        for (i, s) in self.sinks.iter().enumerate() {
            if let Some(dlq) = &s.dead_letter {
                if dlq == &s.name {
                    err(
                        format!("sinks[{i}].dead_letter"),
                        "a sink cannot be its own dead-letter sink".into(),
                    );
                } else if !sink_names.contains(dlq.as_str()) {
                    err(
                        format!("sinks[{i}].dead_letter"),
                        format!("no sink is named {dlq:?}"),
                    );
                }
            }
        }
        if self.routes.is_empty() {
            err("routes".into(), "at least one route is required".into());
        }
        let mut routed = HashSet::new();
        let mut pairs = HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            if !resource_names.contains(&route.resource) {
                err(
                    format!("routes[{i}].resource"),
                    format!("no resource is named {:?}", route.resource),
                );
            }
            routed.insert(route.resource.as_str());
            if route.sinks.is_empty() {
                err(
                    format!("routes[{i}].sinks"),
                    "at least one sink is required".into(),
                );
            }
            for (j, sink) in route.sinks.iter().enumerate() {
                if !sink_names.contains(sink.as_str()) {
                    err(
                        format!("routes[{i}].sinks[{j}]"),
                        format!("no sink is named {sink:?}"),
                    );
                } else if !pairs.insert((route.resource.as_str(), sink.as_str())) {
                    err(
                        format!("routes[{i}].sinks[{j}]"),
                        format!(
                            "resource {:?} is already routed to sink {sink:?}",
                            route.resource
                        ),
                    );
                }
            }
        }
        for (i, r) in self.resources.iter().enumerate() {
            if !routed.contains(r.effective_name().as_str()) {
                err(
                    format!("resources[{i}]"),
                    format!("{:?} is not used by any route", r.effective_name()),
                );
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Error::Invalid(errors))
        }
    }

    /// The config as pretty JSON, for `check-config`.
    pub fn to_pretty_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serializes")
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
    format!("{path}: {message}")
}

fn check_api_version(v: &str) -> std::result::Result<(), String> {
    let (group, version) = match v.split_once('/') {
        Some((g, ver)) => (Some(g), ver),
        None => (None, v),
    };
    let version_ok = version.starts_with('v')
        && !version.is_empty()
        && version
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let group_ok = group.is_none_or(|g| !g.is_empty() && g.split('.').all(is_dns_label));
    if version_ok && group_ok {
        Ok(())
    } else {
        Err(format!(
            "{v:?} is not an API version (`v1` or `group/version`, e.g. `apps/v1`)"
        ))
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
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
        assert_eq!(c.kubernetes.page_size, 500);
        assert_eq!(c.resources[0].events.len(), 4);
        assert!(c.message.strip_managed_fields && !c.message.allow_secret_data);
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
    fn kafka_sink_problems_are_named_by_path() {
        let mut v = minimal();
        v["sinks"] = json!([{"name": "out", "type": "kafka", "kafka": {
            "brokers": [],
            "topic": "k8s.{name}",
            "mode": "state",
            "encoding": "binary",
            "properties": {"acks": "1"},
            "sasl": {"mechanism": "PLAIN", "username": "u", "password": {}},
        }}]);
        let e = errors_of(v);
        for expected in [
            "sinks[0].kafka.brokers: at least one broker is required",
            "sinks[0].kafka.topic: placeholder {name} is not allowed here",
            "sinks[0].kafka.encoding: state mode writes objects",
            "sinks[0].kafka.properties.acks: set by the sink itself",
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
