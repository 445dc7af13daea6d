//! One `resources[]` entry: which kinds to watch, where, and how each route filters them.

use std::{collections::HashSet, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    informer::EventType,
    pipeline::filter::{FilterErrorPolicy, FilterSettings},
    problems::Section,
};

/// One resource to watch.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
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
    #[schemars(with = "Option<String>")]
    pub resync_period: Option<Duration>,
    /// Which notification types to publish. They apply last: the filter and resume see every
    /// notification, and a `deleted` not published still removes the object from the route's
    /// state and checkpoint.
    #[serde(default = "all_event_types")]
    pub events: Vec<EventType>,
    /// Namespaces left out (with `namespaces` empty: every namespace but these), e.g.
    /// `[kube-system]`; the API server filters them (`metadata.namespace!=…` field selectors),
    /// so their objects are neither sent nor cached.
    #[serde(default)]
    pub exclude_namespaces: Vec<String>,
    /// A CEL expression over `object`: which objects belong to the stream. One that stops
    /// matching leaves with a `deleted` event marked `k8sfilteredout`, one that starts
    /// matching enters with an `added`. It may not read `type` or `oldObject` (see
    /// `publish_if`). Example: `object.metadata.labels["team"] == "shop"`.
    #[serde(default)]
    pub filter: Option<String>,
    /// A CEL expression over `object`, `oldObject` and `type` (`added`, `updated`, `deleted`,
    /// `synced`): which changes of the stream's objects are published. What it skips never
    /// removes an object; the next published update starts from the last published state.
    /// Example: `!(type == "updated" && object.spec.replicas == oldObject.spec.replicas)`.
    #[serde(default)]
    pub publish_if: Option<String>,
    /// What an evaluation error of `filter` or `publish_if` (a field missing on an object)
    /// does: `pass` takes the expression as true, `drop` as false; either is counted and
    /// logged once per object.
    #[serde(default)]
    pub filter_error: FilterErrorPolicy,
    /// JSON pointers (`/status`, `/metadata/resourceVersion`): an update that changes only
    /// these fields is not published; the next published one carries the newest state.
    #[serde(default)]
    pub ignore_fields: Vec<String>,
}

/// Which kinds a `kind: "*"` selection takes by scope.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
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

    /// Checks this entry on its own (names and routes are checked across entries by
    /// [`Config::validate`](super::Config::validate)); paths relative to `resources[i]`.
    pub fn validate(&self, p: &mut Section) {
        if self.is_wildcard() {
            let group_wildcard = self.api_version == "*"
                || self
                    .api_version
                    .strip_suffix("/*")
                    .is_some_and(|g| check_api_version(&format!("{g}/v1")).is_ok());
            if !group_wildcard && let Err(reason) = check_api_version(&self.api_version) {
                p.add(
                    "api_version",
                    format!("{reason}, `group/*` or `*` with kind \"*\""),
                );
            }
            if self.name.is_none() {
                p.add(
                    "name",
                    "required with kind \"*\": routes and metric labels name the selection",
                );
            }
            for (j, e) in self.exclude.iter().enumerate() {
                let kind = e.rsplit_once('/').map_or(e.as_str(), |(_, k)| k);
                if kind.is_empty() || !kind.chars().all(|c| c.is_ascii_alphanumeric()) {
                    p.add(
                        &format!("exclude[{j}]"),
                        format!("{e:?} is not `Kind` or `group/Kind`"),
                    );
                }
            }
        } else {
            if let Err(reason) = check_api_version(&self.api_version) {
                p.add("api_version", reason);
            }
            if self.kind.is_empty() || !self.kind.chars().all(|c| c.is_ascii_alphanumeric()) {
                p.add(
                    "kind",
                    format!(
                        "{:?} is not a kind (letters and digits, e.g. Pod, or `*`)",
                        self.kind
                    ),
                );
            }
            if !self.exclude.is_empty() {
                p.add("exclude", "only with kind \"*\"");
            }
            if self.scope != ScopeSelection::All {
                p.add("scope", "only with kind \"*\"");
            }
        }
        let mut seen = HashSet::new();
        for (j, ns) in self.namespaces.iter().enumerate() {
            let at = format!("namespaces[{j}]");
            if !is_dns_label(ns) {
                p.add(&at, format!("{ns:?} is not a namespace name"));
            } else if !seen.insert(ns) {
                p.add(&at, format!("{ns:?} is listed twice"));
            }
        }
        if self.resync().is_some_and(|r| r < Duration::from_secs(1)) {
            p.add("resync_period", "must be 0 (off) or at least 1s");
        }
        if self.events.is_empty() {
            p.add("events", "at least one event type is required");
        }
        for (j, ns) in self.exclude_namespaces.iter().enumerate() {
            let at = format!("exclude_namespaces[{j}]");
            if !is_dns_label(ns) {
                p.add(&at, format!("{ns:?} is not a namespace name"));
            } else if self.namespaces.contains(ns) {
                p.add(&at, format!("{ns:?} is also in namespaces"));
            }
        }
        if let Some(selector) = &self.label_selector
            && let Err(err) = crate::selector::check(selector)
        {
            p.add("label_selector", err);
        }
        self.filter_settings().validate(p);
    }

    /// The API group this entry selects: `Some("")` for core, `Some(g)`, or `None` for every
    /// group (`api_version: "*"`).
    fn group(&self) -> Option<&str> {
        match self.api_version.split_once('/') {
            _ if self.api_version == "*" => None,
            Some((g, _)) => Some(g),
            None => Some(""),
        }
    }

    /// Whether an object could be selected by both this entry and `other`: their kinds can
    /// be the same (a version is not part of a kind's identity) and their namespaces can
    /// overlap. Label selectors and filters are not compared: an object can be relabelled
    /// from one into the other.
    pub fn may_share_objects_with(&self, other: &ResourceConfig) -> bool {
        let groups = match (self.group(), other.group()) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        let takes = |wild: &ResourceConfig, kind: &str, group: Option<&str>| {
            group.is_none_or(|g| !wild.excludes(g, kind))
        };
        let kinds = match (self.is_wildcard(), other.is_wildcard()) {
            (false, false) => self.kind == other.kind,
            (true, false) => takes(self, &other.kind, other.group()),
            (false, true) => takes(other, &self.kind, self.group()),
            (true, true) => !matches!(
                (self.scope, other.scope),
                (ScopeSelection::Namespaced, ScopeSelection::Cluster)
                    | (ScopeSelection::Cluster, ScopeSelection::Namespaced)
            ),
        };
        let watches = |r: &ResourceConfig, ns: &String| {
            if r.namespaces.is_empty() {
                !r.exclude_namespaces.contains(ns)
            } else {
                r.namespaces.contains(ns)
            }
        };
        let namespaces = match (self.namespaces.is_empty(), other.namespaces.is_empty()) {
            (true, true) => true,
            (false, _) => self.namespaces.iter().any(|ns| watches(other, ns)),
            (true, false) => other.namespaces.iter().any(|ns| watches(self, ns)),
        };
        groups && kinds && namespaces
    }

    /// The settings of this resource's filter stage.
    pub fn filter_settings(&self) -> FilterSettings {
        FilterSettings {
            filter: self.filter.clone(),
            publish_if: self.publish_if.clone(),
            on_error: self.filter_error,
            ignore_fields: self.ignore_fields.clone(),
        }
    }
}

fn all_event_types() -> Vec<EventType> {
    vec![
        EventType::Added,
        EventType::Updated,
        EventType::Deleted,
        EventType::Synced,
    ]
}

pub(super) fn check_api_version(v: &str) -> std::result::Result<(), String> {
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

pub(super) fn is_dns_label(s: &str) -> bool {
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
    use crate::pipeline::filter::Rules;

    /// A ConfigMap entry with the fields of `extra` (JSON) added.
    fn serde_yaml_like(extra: &str) -> ResourceConfig {
        let mut v = serde_json::json!({"api_version": "v1", "kind": "ConfigMap"});
        let extra: serde_json::Value = serde_json::from_str(extra).unwrap();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn excluded_namespaces_become_field_selectors_when_all_namespaces_are_watched() {
        let r = serde_yaml_like(
            r#"{"exclude_namespaces": ["kube-system", "b"], "field_selector": "status.phase=Running"}"#,
        );
        assert_eq!(
            r.effective_field_selector(true).as_deref(),
            Some("status.phase=Running,metadata.namespace!=kube-system,metadata.namespace!=b")
        );
        assert_eq!(
            r.effective_field_selector(false).as_deref(),
            Some("status.phase=Running"),
            "a cluster-scoped kind of a wildcard selection"
        );
        let r = serde_yaml_like(r#"{"exclude_namespaces": ["a"], "namespaces": ["c"]}"#);
        assert_eq!(r.effective_field_selector(true), None);
        assert!(
            Rules::new(&r.filter_settings()).unwrap().is_none(),
            "no filter stage for that"
        );
    }
}
