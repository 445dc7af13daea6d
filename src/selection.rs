//! Which kinds each configured resource selects, asked of the API server's discovery: its
//! one kind, or every kind a wildcard (`kind: "*"`) matches.

use kube::{
    Client,
    api::{ApiResource, GroupVersionKind},
    discovery::{self, ApiCapabilities, Scope, verbs},
};
use tracing::warn;

use crate::{
    cluster::{Error, Result},
    config::{ResourceConfig, ScopeSelection},
};

/// What discovery says a configured resource selects now.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// The kinds selected.
    pub kinds: Vec<ResolvedResource>,
    /// Groups whose discovery failed (for `api_version: "*"`): whether they still serve a
    /// kind is unknown, so nothing of theirs counts as gone.
    pub unanswered: Vec<String>,
}

/// A configured kind, resolved by discovery.
#[derive(Debug, Clone)]
pub struct ResolvedResource {
    /// Group, version, kind and plural.
    pub api_resource: ApiResource,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
}

/// The kinds `resources[index]` selects now: its one kind ([`resolve`]), or for `kind: "*"`
/// every kind of the selected API versions (a group's preferred version for `group/*`)
/// that supports list and watch, within `scope` and not in `exclude` (cluster-scoped kinds
/// are left out when the entry lists namespaces). A group whose discovery fails is skipped
/// with a warning and listed as unanswered (an aggregated API that is down must not stop the
/// rest); none selected is [`Error::NotServed`], or a failure when some group did not answer.
pub async fn resolve_all(client: &Client, index: usize, r: &ResourceConfig) -> Result<Selection> {
    if !r.is_wildcard() {
        return resolve(client, index, r).await.map(|one| Selection {
            kinds: vec![one],
            unanswered: Vec::new(),
        });
    }
    let mut unanswered = Vec::new();
    let err = |reason: String| Error::Resource {
        index,
        api_version: r.api_version.clone(),
        kind: r.kind.clone(),
        reason,
    };
    let groups: Vec<discovery::ApiGroup> = if r.api_version == "*" {
        let names = client
            .list_api_groups()
            .await
            .map_err(|e| err(format!("discovery failed: {e}")))?;
        let mut groups = Vec::new();
        for name in std::iter::once(String::new()).chain(names.groups.into_iter().map(|g| g.name)) {
            match discovery::group(client, &name).await {
                Ok(g) => groups.push(g),
                Err(e) => {
                    warn!(group = %name, error = %e,
                        "Discovery of an API group failed; its kinds are neither started nor stopped until it answers");
                    unanswered.push(name);
                }
            }
        }
        groups
    } else if let Some(group) = r.api_version.strip_suffix("/*") {
        match discovery::group(client, group).await {
            Ok(g) => vec![g],
            Err(kube::Error::Discovery(_)) => Vec::new(),
            Err(kube::Error::Api(s)) if s.code == 404 => Vec::new(),
            Err(e) => return Err(err(format!("discovery failed: {e}"))),
        }
    } else {
        let (group, version) = r
            .api_version
            .split_once('/')
            .unwrap_or(("", &r.api_version));
        let gv = kube::core::GroupVersion::gv(group, version);
        match discovery::pinned_group(client, &gv).await {
            Ok(g) => vec![g],
            Err(kube::Error::Api(s)) if s.code == 404 => Vec::new(),
            Err(e) => return Err(err(format!("discovery failed: {e}"))),
        }
    };
    let pinned_version = r
        .api_version
        .split_once('/')
        .map_or(r.api_version.as_str(), |(_, v)| v);
    let mut selected = Vec::new();
    for g in &groups {
        let resources = if r.api_version.ends_with('*') {
            g.recommended_resources()
        } else {
            g.versioned_resources(pinned_version)
        };
        for (api_resource, caps) in resources {
            let namespaced = caps.scope == Scope::Namespaced;
            let in_scope = match r.scope {
                ScopeSelection::All => true,
                ScopeSelection::Namespaced => namespaced,
                ScopeSelection::Cluster => !namespaced,
            };
            if caps.supports_operation(verbs::LIST)
                && caps.supports_operation(verbs::WATCH)
                && in_scope
                && (namespaced || r.namespaces.is_empty())
                && !r.excludes(&api_resource.group, &api_resource.kind)
            {
                selected.push(ResolvedResource {
                    api_resource,
                    namespaced,
                });
            }
        }
    }
    if selected.is_empty() && !unanswered.is_empty() {
        return Err(err(format!(
            "discovery failed for the groups {unanswered:?}"
        )));
    }
    if selected.is_empty() {
        return Err(Error::NotServed {
            index,
            api_version: r.api_version.clone(),
            kind: r.kind.clone(),
            reason: "no kind that can be listed and watched matches (yet)".into(),
        });
    }
    Ok(Selection {
        kinds: selected,
        unanswered,
    })
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
    let not_served = |reason: String| Error::NotServed {
        index,
        api_version: r.api_version.clone(),
        kind: r.kind.clone(),
        reason,
    };
    let (api_resource, caps): (ApiResource, ApiCapabilities) = discovery::pinned_kind(client, &gvk)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if s.code == 404 => {
                not_served(format!("the API server does not serve {}", r.api_version))
            }
            kube::Error::Discovery(_) => {
                not_served(format!("{} has no kind {:?}", r.api_version, r.kind))
            }
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
