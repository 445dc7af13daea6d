//! Connecting to the Kubernetes API and resolving configured kinds by discovery.
//!
//! Connection trouble is reported, not hidden: a failure names the kubeconfig, context and
//! server that were tried.

use std::{path::PathBuf, time::Duration};

use kube::{
    Client,
    api::{ApiResource, GroupVersionKind},
    config::{KubeConfigOptions, Kubeconfig},
    discovery::{self, ApiCapabilities, Scope, verbs},
};

use crate::config::{KubernetesConfig, ResourceConfig};

/// How long the start-up reachability check waits for the API server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors connecting or resolving resources.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kubeconfig could not be read or used.
    #[error("cannot load kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The file tried.
        path: String,
        /// The cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// Neither a kubeconfig nor in-cluster configuration was found.
    #[error(
        "no kubeconfig found ($KUBECONFIG unset, ~/.kube/config missing) and not in a cluster: {0}"
    )]
    NoConfig(#[source] kube::config::InClusterError),
    /// The client could not be built (bad TLS material, for example).
    #[error("cannot build a Kubernetes client for {server}: {source}")]
    Client {
        /// The API server URL.
        server: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The API server did not answer.
    #[error("cannot reach the Kubernetes API server {} (kubeconfig: {}, context: {}): {reason}",
        .target.server, .target.kubeconfig_display(), .target.context.as_deref().unwrap_or("-"))]
    Unreachable {
        /// What was tried.
        target: Target,
        /// Why it failed.
        reason: String,
    },
    /// A configured kind cannot be watched.
    #[error("resources[{index}] ({api_version} {kind}): {reason}")]
    Resource {
        /// Position in `resources`.
        index: usize,
        /// Its apiVersion.
        api_version: String,
        /// Its kind.
        kind: String,
        /// What is wrong.
        reason: String,
    },
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where the client points: for messages and logs.
#[derive(Debug, Clone)]
pub struct Target {
    /// Kubeconfig file, or `None` for in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    /// Context used.
    pub context: Option<String>,
    /// API server URL.
    pub server: String,
}

impl Target {
    fn kubeconfig_display(&self) -> String {
        self.kubeconfig
            .as_ref()
            .map_or_else(|| "in-cluster".to_owned(), |p| p.display().to_string())
    }
}

/// Finds the kubeconfig: the configured path, else `$KUBECONFIG` (first entry), else
/// `~/.kube/config` when it exists; `None` means in-cluster.
fn kubeconfig_path(cfg: &KubernetesConfig) -> Option<PathBuf> {
    if let Some(p) = &cfg.kubeconfig {
        return Some(p.clone());
    }
    if let Some(env) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
        return std::env::split_paths(&env).next();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)?
        .join(".kube/config");
    home.exists().then_some(home)
}

/// Builds a client and checks that the API server answers.
pub async fn connect(cfg: &KubernetesConfig) -> Result<(Client, Target)> {
    let path = kubeconfig_path(cfg);
    let (config, context) = match &path {
        Some(p) => {
            let kc_err = |source| Error::Kubeconfig {
                path: p.display().to_string(),
                source,
            };
            let kubeconfig = Kubeconfig::read_from(p).map_err(kc_err)?;
            let context = cfg
                .context
                .clone()
                .or_else(|| kubeconfig.current_context.clone());
            let options = KubeConfigOptions {
                context: cfg.context.clone(),
                ..Default::default()
            };
            let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(kc_err)?;
            (config, context)
        }
        None => (kube::Config::incluster().map_err(Error::NoConfig)?, None),
    };
    let target = Target {
        kubeconfig: path,
        context,
        server: config.cluster_url.to_string(),
    };
    let client = Client::try_from(config).map_err(|source| Error::Client {
        server: target.server.clone(),
        source,
    })?;
    match tokio::time::timeout(CONNECT_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(_)) => Ok((client, target)),
        Ok(Err(err)) => Err(Error::Unreachable {
            target,
            reason: err.to_string(),
        }),
        Err(_) => Err(Error::Unreachable {
            target,
            reason: format!("no answer within {CONNECT_TIMEOUT:?}"),
        }),
    }
}

/// A configured kind, resolved by discovery.
#[derive(Debug, Clone)]
pub struct ResolvedResource {
    /// Group, version, kind and plural.
    pub api_resource: ApiResource,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
}

/// Resolves `resources[index]` by discovery: the kind must exist and support list and watch,
/// and a cluster-scoped kind cannot be limited to namespaces.
pub async fn resolve(
    client: &Client,
    index: usize,
    r: &ResourceConfig,
) -> Result<ResolvedResource> {
    let err = |reason: String| Error::Resource {
        index,
        api_version: r.api_version.clone(),
        kind: r.kind.clone(),
        reason,
    };
    let (group, version) = r
        .api_version
        .split_once('/')
        .unwrap_or(("", &r.api_version));
    let gvk = GroupVersionKind::gvk(group, version, &r.kind);
    let (api_resource, caps): (ApiResource, ApiCapabilities) = discovery::pinned_kind(client, &gvk)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if s.code == 404 => {
                err(format!("the API server does not serve {}", r.api_version))
            }
            kube::Error::Discovery(_) => err(format!("{} has no kind {:?}", r.api_version, r.kind)),
            other => err(format!("discovery failed: {other}")),
        })?;
    for verb in [verbs::LIST, verbs::WATCH] {
        if !caps.supports_operation(verb) {
            return Err(err(format!(
                "resource {:?} does not support {verb}",
                api_resource.plural
            )));
        }
    }
    let namespaced = caps.scope == Scope::Namespaced;
    if !namespaced && !r.namespaces.is_empty() {
        return Err(err("is cluster-scoped; remove `namespaces`".into()));
    }
    Ok(ResolvedResource {
        api_resource,
        namespaced,
    })
}
