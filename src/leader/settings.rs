//! The `leader_election` settings, and the identity and namespace they default to.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::problems::Section;

/// Leader election on a `coordination.k8s.io/v1` Lease. Durations are client-go's defaults.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaderElectionConfig {
    /// Elect one leader among the replicas; only the leader publishes (standbys run their
    /// informers; a new leader lists again before it publishes). Off for a single replica.
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
    #[schemars(with = "String")]
    pub lease_duration: Duration,
    /// How long the leader tries to renew before it stops publishing; below `lease_duration`,
    /// so that it stops before anyone else can start.
    #[serde(default = "default_renew_deadline", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub renew_deadline: Duration,
    /// Pause between attempts to acquire or renew the lease.
    #[serde(default = "default_retry_period", with = "humantime_serde")]
    #[schemars(with = "String")]
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

impl LeaderElectionConfig {
    /// Checks what serde cannot: reports into `p` (paths relative to `leader_election`).
    pub fn validate(&self, p: &mut Section) {
        if self.renew_deadline >= self.lease_duration {
            p.add(
                "renew_deadline",
                "must be shorter than lease_duration (fencing)",
            );
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            p.add(
                "retry_period",
                "must be above 0 and shorter than renew_deadline",
            );
        }
        if self.lease_duration < Duration::from_secs(1) {
            p.add("lease_duration", "must be at least 1s");
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

/// This replica's identity: the configured one, else `$POD_NAME`, else the host name.
pub fn default_identity(cfg: &LeaderElectionConfig) -> String {
    cfg.identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .unwrap_or_else(|| format!("kube-event-bridge-{}", std::process::id()))
}

/// The lease's namespace: the configured one, else `$POD_NAMESPACE`, else the service
/// account's namespace, else `default`.
pub fn default_namespace(cfg: &LeaderElectionConfig) -> String {
    cfg.namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .or_else(|| {
            std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
                .ok()
                .map(|n| n.trim().to_owned())
        })
        .unwrap_or_else(|| "default".into())
}
