//! Change-aware filtering between a route's resumer (or its listeners) and its queue: the
//! membership `filter`, the change condition `publish_if`, and no-op suppression by
//! `ignore_fields`. (`exclude_namespaces` is a field selector the API server applies: see
//! `config::ResourceConfig::effective_field_selector`.) The stage sees every notification;
//! the route's `events` apply after it, in the queue.
//!
//! # Contract
//! - `filter` is a CEL expression over `object` alone: the objects for which it is true
//!   *belong to the stream*. Only membership decides what consumers hold, so only leaving it
//!   makes a `k8sfilteredout` delete.
//! - `publish_if` is a CEL expression over `object`, `oldObject` (the previous state for
//!   `updated` and `synced`, else `null`) and `type` (`added`, `updated`, `deleted`,
//!   `synced`): which notifications of members are published. A change it skips is not lost:
//!   the next published update of the object carries, as its old state, the last one
//!   published.
//! - An evaluation error passes or fails the expression as `filter_error` says; each is
//!   counted, and logged once per key.
//! - Consumers are never left with a stale object, nor lose a live one. With a `filter` or a
//!   `publish_if`, the route remembers which objects it published (and a resume's checkpoint
//!   tells it which ones the consumers had before):
//!   - a delete of a published object is always published; the delete of one never
//!     published only if it belongs to the stream and `publish_if` passes it;
//!   - when a published object stops belonging to the stream, a `deleted` notification of its
//!     current state marked `k8sfilteredout: true` is published instead of the change;
//!   - a member not published yet (relabelled into the filter, or skipped so far) enters the
//!     stream as `added` when `publish_if` passes it as one (and the route publishes adds),
//!     else as the change itself when `publish_if` passes that;
//!   - a resumed update (changed while no replica published) is always published: it
//!     repairs what consumers have, and its stub old state is nothing to judge by.
//! - With `ignore_fields`, an update whose old and new objects are equal once those JSON
//!   pointers are removed is suppressed (`reason="suppressed"`); as with `publish_if`, the
//!   next published update starts from the last one published: `oldObject` and `data.patch`
//!   always lead from what consumers have to the newest state.
//!
//! Every route evaluates on its own (each has its own view of what its consumers have), so
//! `keb_filtered_total` carries the sink besides the resource and the reason.

mod cel_json;
pub mod expr;
mod lanes;

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

pub use json_patch::jsonptr::PointerBuf;
use prometheus::IntCounter;
use serde::{Deserialize, Serialize};
use tracing::warn;

pub use expr::{Expr, VARIABLES};
use lanes::{Item, Lanes};

use super::RouteQueue;
use crate::{
    informer::{
        CachedObject, EventType, Key, Notification, NotificationHandler, NotificationKind,
        ObjectRef, object::differing_fields,
    },
    problems::Section,
};

/// Errors of a filter's settings, found at load.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The expression does not parse.
    #[error("syntax error at line {line}, column {column}: {message}")]
    Syntax {
        /// 1-based line.
        line: isize,
        /// 1-based column.
        column: isize,
        /// What the parser said.
        message: String,
    },
    /// The expression names something that is neither a variable nor a function.
    #[error("unknown name `{name}`{at}: a filter sees {vars} and CEL's standard functions", vars = VARIABLES.join(", "))]
    UnknownName {
        /// The name.
        name: String,
        /// ` at line L, column C`, when known.
        at: String,
    },
    /// A `filter` reads `type` or `oldObject`: it decides which objects belong to the stream,
    /// which a change cannot.
    #[error(
        "`filter` decides which objects belong to the stream and sees only `object`, but reads \
         `{name}`{at}: put conditions on changes in `publish_if` (and `type != \"synced\"` is \
         `events: [added, updated, deleted]`)"
    )]
    ChangeInMembership {
        /// `type` or `oldObject`.
        name: String,
        /// ` at line L, column C`, when known.
        at: String,
    },
    /// The expression does not give a boolean.
    #[error("the expression must be a boolean, but gives a {0} value")]
    NotBoolean(String),
    /// An operator or function applied to types it does not take, whatever the object.
    #[error("type error: {0}")]
    Type(String),
    /// An `ignore_fields` entry is not a JSON pointer to a field.
    #[error("{0:?} is not a JSON pointer to a field (like \"/status\")")]
    Pointer(String),
}

/// What an evaluation error of a resource's `filter` does.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum FilterErrorPolicy {
    /// Publish the notification.
    #[default]
    Pass,
    /// Drop the notification (counted in `keb_filtered_total{reason="filter_error"}`).
    Drop,
}

/// A resource's filter settings (the `filter`, `publish_if`, `filter_error` and
/// `ignore_fields` of its `resources[]` entry).
#[derive(Debug, Clone, Default)]
pub struct FilterSettings {
    /// The membership expression over `object`, if any.
    pub filter: Option<String>,
    /// The change condition over `object`, `oldObject` and `type`, if any.
    pub publish_if: Option<String>,
    /// What an evaluation error does.
    pub on_error: FilterErrorPolicy,
    /// JSON pointers an update may change without being published.
    pub ignore_fields: Vec<String>,
}

impl FilterSettings {
    /// Compiles the expression and parses the pointers; reports into `p` (paths relative to
    /// the resource entry).
    pub fn validate(&self, p: &mut Section) {
        if let Some(filter) = &self.filter
            && let Err(reason) = Expr::compile_membership(filter)
        {
            p.add("filter", format!("{reason} (in `{filter}`)"));
        }
        if let Some(publish_if) = &self.publish_if
            && let Err(reason) = Expr::compile(publish_if)
        {
            p.add("publish_if", format!("{reason} (in `{publish_if}`)"));
        }
        for (j, pointer) in self.ignore_fields.iter().enumerate() {
            if let Err(reason) = field_pointer(pointer) {
                p.add(&format!("ignore_fields[{j}]"), reason);
            }
        }
    }
}

/// `pointer` parsed, when it points at a field (not the whole object).
fn field_pointer(pointer: &str) -> Result<PointerBuf, Error> {
    match PointerBuf::parse(pointer) {
        Ok(p) if pointer.len() >= 2 => Ok(p),
        _ => Err(Error::Pointer(pointer.to_owned())),
    }
}

/// Why a notification was not published, as counted in `keb_filtered_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The object does not belong to the stream (`filter`).
    Filter = 0,
    /// An expression could not be evaluated and `filter_error` is `drop`.
    FilterError,
    /// An update that changed only `ignore_fields`.
    Suppressed,
    /// A change of a member that `publish_if` did not pass.
    PublishIf,
}

impl Reason {
    /// Every reason, in discriminant order (the order of [`FilterMetrics::filtered`]).
    pub const ALL: [Reason; 4] = [
        Self::Filter,
        Self::FilterError,
        Self::Suppressed,
        Self::PublishIf,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Filter => "filter",
            Self::FilterError => "filter_error",
            Self::Suppressed => "suppressed",
            Self::PublishIf => "publish_if",
        }
    }
}

/// Removes each of `pointers` from `value`; one that points at nothing (a missing key, an
/// index past an array's end, `-`) is ignored. (jsonptr's own `delete` takes an index equal
/// to the array's length as valid and then panics removing it.)
pub fn remove_pointers(value: &mut serde_json::Value, pointers: &[PointerBuf]) {
    use json_patch::jsonptr::index::Index;
    for p in pointers {
        let Some((parent, last)) = p.split_back() else {
            continue;
        };
        match parent.resolve_mut(value) {
            Ok(serde_json::Value::Object(m)) => {
                m.remove(last.decoded().as_ref());
            }
            Ok(serde_json::Value::Array(a)) => {
                if let Ok(Index::Num(i)) = last.to_index()
                    && i < a.len()
                {
                    a.remove(i);
                }
            }
            _ => {}
        }
    }
}

/// Whether `a` and `b` are equal once `pointers` are removed from both.
pub fn equal_ignoring(a: &CachedObject, b: &CachedObject, pointers: &[PointerBuf]) -> bool {
    // Only the top-level fields that differ are parsed; what is equal stays equal.
    match differing_fields(a, b) {
        Some((mut a, mut b)) => {
            remove_pointers(&mut a, pointers);
            remove_pointers(&mut b, pointers);
            a == b
        }
        None => false,
    }
}

/// What a resource's routes filter by; compiled once per resource.
#[derive(Debug)]
pub struct Rules {
    filter: Option<Expr>,
    publish_if: Option<Expr>,
    on_error: FilterErrorPolicy,
    ignore_fields: Vec<PointerBuf>,
}

impl Rules {
    /// The rules of `settings`, or `None` when they filter nothing.
    pub fn new(settings: &FilterSettings) -> Result<Option<Self>, Error> {
        if settings.filter.is_none()
            && settings.publish_if.is_none()
            && settings.ignore_fields.is_empty()
        {
            return Ok(None);
        }
        Ok(Some(Self {
            filter: settings
                .filter
                .as_deref()
                .map(Expr::compile_membership)
                .transpose()?,
            publish_if: settings
                .publish_if
                .as_deref()
                .map(Expr::compile)
                .transpose()?,
            on_error: settings.on_error,
            ignore_fields: settings
                .ignore_fields
                .iter()
                .map(|p| field_pointer(p))
                .collect::<Result<_, _>>()?,
        }))
    }

    /// Whether the route must remember which objects its consumers have.
    fn tracks(&self) -> bool {
        self.filter.is_some() || self.publish_if.is_some()
    }
}

/// Counters of one route.
pub struct FilterMetrics {
    /// `keb_filtered_total{resource,sink,reason}`, by [`Reason`].
    pub filtered: [IntCounter; Reason::ALL.len()],
    /// `keb_filter_errors_total{resource,sink}`.
    pub errors: IntCounter,
}

/// The filter stage of one route. See the module docs.
///
/// Built with [`RouteFilter::new`] it evaluates on the caller's thread (the informer's), one
/// notification at a time; [`RouteFilter::with_lanes`] evaluates on tasks of its own, in
/// parallel across keys and in order per key (see `lanes`).
pub struct RouteFilter {
    stage: Arc<Stage>,
    lanes: Lanes,
}

/// What evaluates: the rules, the queue behind, the counters.
struct Stage {
    route: String,
    rules: Arc<Rules>,
    queue: Arc<RouteQueue>,
    metrics: FilterMetrics,
}

/// What a route knows of its consumers, for the keys of one lane (all keys without lanes).
#[derive(Default)]
struct State {
    term: u64,
    // Keys whose consumers have the object (only kept with a `filter` or `publish_if`).
    published: HashSet<Key>,
    // Per published key with changes not published: the old state of the first one, the last
    // published.
    bases: HashMap<Key, ObjectRef>,
    // Keys whose evaluation error was logged.
    logged: HashSet<Key>,
}

impl State {
    /// Prepares for evaluating something passed in `term`: a newer term starts from what its
    /// replay publishes; `false` for an older one, whose items are dropped.
    fn renew(&mut self, term: u64) -> bool {
        if term > self.term {
            *self = State {
                term,
                ..State::default()
            };
        }
        term == self.term
    }
}

impl RouteFilter {
    /// The filter stage of route `route` in front of `queue`, evaluating on the caller's
    /// thread.
    pub fn new(
        route: String,
        rules: Arc<Rules>,
        queue: Arc<RouteQueue>,
        metrics: FilterMetrics,
    ) -> Self {
        Self {
            stage: Arc::new(Stage {
                route,
                rules,
                queue,
                metrics,
            }),
            lanes: Lanes::inline(),
        }
    }

    /// Evaluates on `lanes` tasks of its own (spawned on the current Tokio runtime), in
    /// parallel across keys and in order per key; 0 keeps evaluating on the caller's thread.
    pub fn with_lanes(mut self, lanes: usize) -> Self {
        if lanes > 0 {
            self.lanes = Lanes::spawn(&self.stage, lanes);
        }
        self
    }
}

impl Stage {
    /// Evaluates `expr` (none: true); an error gives what `filter_error` says, or `Err` with
    /// the reason to count under `drop`.
    fn eval(
        &self,
        st: &mut State,
        expr: Option<&Expr>,
        key: &str,
        object: &CachedObject,
        old: Option<&CachedObject>,
        ty: EventType,
    ) -> Result<bool, Reason> {
        let Some(expr) = expr else {
            return Ok(true);
        };
        expr.eval(object, old, ty).or_else(|err| {
            self.metrics.errors.inc();
            if st.logged.insert(key.into()) {
                warn!(route = %self.route, key, error = %err, policy = ?self.rules.on_error,
                      "Cannot evaluate the filter on this object (logged once per object)");
            }
            match self.rules.on_error {
                FilterErrorPolicy::Pass => Ok(true),
                FilterErrorPolicy::Drop => Err(Reason::FilterError),
            }
        })
    }

    /// Whether `object` belongs to the stream; else why not.
    fn member(&self, st: &mut State, key: &str, object: &CachedObject) -> Result<(), Reason> {
        match self.eval(
            st,
            self.rules.filter.as_ref(),
            key,
            object,
            None,
            EventType::Added,
        )? {
            true => Ok(()),
            false => Err(Reason::Filter),
        }
    }

    /// Whether `publish_if` passes the change; else why not.
    fn publishes(
        &self,
        st: &mut State,
        key: &str,
        object: &CachedObject,
        old: Option<&CachedObject>,
        ty: EventType,
    ) -> Result<(), Reason> {
        match self.eval(st, self.rules.publish_if.as_ref(), key, object, old, ty)? {
            true => Ok(()),
            false => Err(Reason::PublishIf),
        }
    }

    fn drop_for(&self, reason: Reason) {
        self.metrics.filtered[reason as usize].inc();
    }

    /// Publishes the `k8sfilteredout` delete of `obj`, received at `at`.
    fn filtered_out(&self, st: &State, obj: ObjectRef, at: (std::time::Instant, jiff::Timestamp)) {
        let kind = NotificationKind::Delete {
            obj,
            final_state_unknown: false,
        };
        self.push(st, Notification::at(kind, at.0, at.1).into_filtered_out());
    }

    /// Hands `n` to the queue, unless the term `st` was evaluated in ended meanwhile.
    fn push(&self, st: &State, n: Notification) {
        self.queue.push_in(n, Some(st.term));
    }
}

impl Stage {
    /// Evaluates `n`, passed in `term`, with what `st` knows of its key; passes it on,
    /// changed, or drops it. What it passes on, the queue takes only within `term`.
    fn notify(&self, st: &mut State, term: u64, mut n: Notification) {
        if !self.queue.is_active() || !st.renew(term) {
            return;
        }
        let key = n.key().clone();
        let ty = n.event_type();
        let tracks = self.rules.tracks();
        match n.kind().clone() {
            NotificationKind::Delete { obj, .. } => {
                // A delete always settles what the route knows of the key.
                st.bases.remove(&key);
                st.logged.remove(&key);
                let had = !tracks || st.published.remove(&key) || n.resumed;
                if !had {
                    // Consumers never had it: published only as a change of a member.
                    if let Err(reason) = self
                        .member(st, &key, &obj)
                        .and_then(|()| self.publishes(st, &key, &obj, None, ty))
                    {
                        return self.drop_for(reason);
                    }
                }
            }
            NotificationKind::Add { obj, .. } => {
                st.bases.remove(&key);
                if let Err(reason) = self.member(st, &key, &obj) {
                    if st.published.remove(&key) {
                        return self.filtered_out(st, obj, (n.received, n.observed));
                    }
                    return self.drop_for(reason);
                }
                if let Err(reason) = self.publishes(st, &key, &obj, None, ty) {
                    return self.drop_for(reason);
                }
                if tracks {
                    st.published.insert(key);
                }
            }
            NotificationKind::Update { old, new } => {
                let published = !tracks || n.resumed || st.published.contains(&key);
                if let Err(reason) = self.member(st, &key, &new) {
                    if published && tracks {
                        st.published.remove(&key);
                        st.bases.remove(&key);
                        return self.filtered_out(st, new, (n.received, n.observed));
                    }
                    return self.drop_for(reason);
                }
                if !published {
                    // A member the consumers do not have enters the stream: as an `added`
                    // when `publish_if` passes it as one (and the route publishes adds),
                    // else as the change itself when `publish_if` passes that.
                    let as_added = self.queue.publishes(EventType::Added)
                        && self
                            .publishes(st, &key, &new, None, EventType::Added)
                            .is_ok();
                    if !as_added && let Err(reason) = self.publishes(st, &key, &new, Some(&old), ty)
                    {
                        return self.drop_for(reason);
                    }
                    st.published.insert(key.clone());
                    st.bases.remove(&key);
                    if as_added {
                        n.set_kind(NotificationKind::Add {
                            obj: new,
                            is_initial_list: false,
                        });
                    }
                    return self.push(st, n);
                }
                if tracks && n.resumed {
                    // The checkpoint says the consumers have it.
                    st.published.insert(key.clone());
                }
                let updated = ty == EventType::Updated && !n.resumed;
                if updated
                    && !self.rules.ignore_fields.is_empty()
                    && equal_ignoring(&old, &new, &self.rules.ignore_fields)
                {
                    st.bases.entry(key).or_insert(old);
                    return self.drop_for(Reason::Suppressed);
                }
                // A resumed update repairs what consumers have (and its old state is a stub
                // `publish_if` cannot read): always published.
                if !n.resumed
                    && let Err(reason) = self.publishes(st, &key, &new, Some(&old), ty)
                {
                    if updated {
                        st.bases.entry(key).or_insert(old);
                    }
                    return self.drop_for(reason);
                }
                // Whatever is published now is what consumers have: an update starts from
                // the last published state, and a resync or resumed update carries the state.
                // A type the queue drops (`events` without it) publishes nothing: the base stays.
                if self.queue.publishes(ty)
                    && let Some(base) = st.bases.remove(&key)
                    && updated
                {
                    n.set_kind(NotificationKind::Update { old: base, new });
                }
            }
        }
        self.push(st, n);
    }

    /// From a resume: the consumers have `key` (see [`NotificationHandler::on_known`]).
    fn known(&self, st: &mut State, term: u64, key: &str, unchanged: Option<&ObjectRef>) {
        if !self.rules.tracks() || !self.queue.is_active() || !st.renew(term) {
            return;
        }
        match unchanged {
            Some(obj) if self.member(st, key, obj).is_err() => {
                // The filter changed since the consumers got it.
                st.published.remove(key);
                let now = (std::time::Instant::now(), jiff::Timestamp::now());
                self.filtered_out(st, obj.clone(), now);
            }
            _ => {
                st.published.insert(key.into());
            }
        }
    }
}

impl NotificationHandler for RouteFilter {
    fn on_notification(&self, n: Notification) {
        if !self.stage.queue.is_active() {
            return;
        }
        self.lanes.pass(&self.stage, Item::Notification(n));
    }

    fn on_known(&self, key: &str, unchanged: Option<&ObjectRef>) {
        if !self.stage.rules.tracks() || !self.stage.queue.is_active() {
            return;
        }
        self.lanes
            .pass(&self.stage, Item::Known(key.into(), unchanged.cloned()));
    }

    fn on_synced(&self, namespace: Option<&str>, listed_at: Option<&str>) {
        self.stage.queue.on_synced(namespace, listed_at);
    }

    fn flush(&self) {
        self.lanes.flush(&self.stage);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::ObjectMetaRef;
    use crate::workqueue::{
        metrics::QueueMetrics, rate_limiter::ItemExponentialFailureRateLimiter,
    };
    use prometheus::{IntCounter, IntGauge};
    use std::time::Duration;

    /// ConfigMap `ns/{name}` at `rv` with label `team` and `status.phase`.
    pub(super) fn object(name: &str, rv: &str, team: &str, status: &str) -> ObjectRef {
        let o: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"namespace": "ns", "name": name, "uid": format!("uid-{name}"),
                         "resourceVersion": rv, "labels": {"team": team}},
            "data": {"k": "v"},
            "status": {"phase": status},
        }))
        .unwrap();
        Arc::new(CachedObject::new(&o))
    }

    fn stage(config: &str) -> (RouteFilter, Arc<RouteQueue>, [IntCounter; 4]) {
        stage_publishing(config, &EventType::ALL)
    }

    /// The stage of `config` in front of a queue publishing `events`.
    fn stage_publishing(
        config: &str,
        events: &[EventType],
    ) -> (RouteFilter, Arc<RouteQueue>, [IntCounter; 4]) {
        stage_holding(config, events, 1000)
    }

    /// The stage of `config` in front of a queue publishing `events` that coalesces beyond
    /// `cap` notifications.
    fn stage_holding(
        config: &str,
        events: &[EventType],
        cap: usize,
    ) -> (RouteFilter, Arc<RouteQueue>, [IntCounter; 4]) {
        let r = serde_yaml_like(config);
        let rules = Arc::new(Rules::new(&r).unwrap().expect("rules"));
        let queue = Arc::new(
            RouteQueue::new(
                "r".into(),
                Box::new(ItemExponentialFailureRateLimiter::new(
                    Duration::from_secs(1),
                    Duration::from_secs(10),
                )),
                QueueMetrics::unregistered(),
                Arc::new(super::super::Budget::new(cap)),
                IntGauge::new("b", "b").unwrap(),
                IntCounter::new("c", "c").unwrap(),
            )
            .with_events(events),
        );
        let filtered =
            Reason::ALL.map(|r| IntCounter::new(format!("f_{}", r.as_str()), "f").unwrap());
        let f = RouteFilter::new(
            "r".into(),
            rules,
            queue.clone(),
            FilterMetrics {
                filtered: filtered.clone(),
                errors: IntCounter::new("e", "e").unwrap(),
            },
        );
        (f, queue, filtered)
    }

    /// Filter settings from the JSON of a resource entry's filter fields.
    fn serde_yaml_like(fields: &str) -> FilterSettings {
        let v: serde_json::Value = serde_json::from_str(fields).unwrap();
        FilterSettings {
            filter: v["filter"].as_str().map(str::to_owned),
            publish_if: v["publish_if"].as_str().map(str::to_owned),
            on_error: serde_json::from_value(v["filter_error"].clone()).unwrap_or_default(),
            ignore_fields: serde_json::from_value(v["ignore_fields"].clone()).unwrap_or_default(),
        }
    }

    /// What the queue holds, as `type rv [filteredout]`, in order, for key `ns/a`.
    fn drain(q: &RouteQueue) -> Vec<String> {
        drain_in_order(q).into_iter().map(|(_, n)| n).collect()
    }

    /// What the queue holds per key, as `type rv [from rv] [filteredout]`, in order.
    fn drain_by_key(q: &RouteQueue) -> std::collections::BTreeMap<Key, Vec<String>> {
        let mut out = std::collections::BTreeMap::<Key, Vec<String>>::new();
        for (key, n) in drain_in_order(q) {
            out.entry(key).or_default().push(n);
        }
        out
    }

    /// What the queue holds, key by key in the order they were queued.
    fn drain_in_order(q: &RouteQueue) -> Vec<(Key, String)> {
        let mut out = Vec::new();
        while let Some(key) = q.queue().try_get() {
            let (batch, _) = q.take(&key);
            q.settle(batch.len());
            q.finish(&key);
            q.queue().done(&key);
            for n in batch {
                let mut s = format!(
                    "{} {}",
                    n.event_type().as_str(),
                    n.object().resource_version().unwrap_or_default()
                );
                if let NotificationKind::Update { old, .. } = n.kind() {
                    s += &format!(" from {}", old.resource_version().unwrap_or_default());
                }
                if n.filtered_out {
                    s += " filteredout";
                }
                out.push((key.clone(), s));
            }
        }
        out
    }

    #[test]
    fn objects_leaving_the_filter_get_a_filtered_out_delete_and_come_back_as_added() {
        let (f, q, filtered) = stage(r#"{"filter": "object.metadata.labels.team == 'shop'"}"#);
        let on = |kind| f.on_notification(Notification::new(kind));
        on(NotificationKind::Add {
            obj: object("a", "1", "shop", "x"),
            is_initial_list: true,
        });
        on(NotificationKind::Add {
            obj: object("b", "1", "web", "x"),
            is_initial_list: true,
        });
        on(NotificationKind::Update {
            old: object("a", "1", "shop", "x"),
            new: object("a", "2", "web", "x"),
        });
        on(NotificationKind::Update {
            old: object("a", "2", "web", "x"),
            new: object("a", "3", "web", "y"),
        });
        on(NotificationKind::Update {
            old: object("a", "3", "web", "y"),
            new: object("a", "4", "shop", "y"),
        });
        on(NotificationKind::Delete {
            obj: object("b", "2", "web", "x"),
            final_state_unknown: false,
        });
        on(NotificationKind::Delete {
            obj: object("a", "5", "web", "y"),
            final_state_unknown: false,
        });
        assert_eq!(
            drain(&q),
            ["added 1", "deleted 2 filteredout", "added 4", "deleted 5"]
        );
        assert_eq!(filtered[0].get(), 3, "b's add and delete, a's update at 3");
    }

    #[test]
    fn publish_if_never_removes_objects_and_what_it_skips_leads_to_the_next_update() {
        // The book's change filter (docs/src/filters.md): only phase changes of updates are
        // published.
        let (f, q, filtered) = stage(
            r#"{"filter": "object.metadata.labels.team == 'shop'",
                "publish_if": "type != 'updated' || object.status.phase != oldObject.status.phase"}"#,
        );
        let on = |kind| f.on_notification(Notification::new(kind));
        on(NotificationKind::Add {
            obj: object("a", "1", "shop", "x"),
            is_initial_list: true,
        });
        // Updates that do not change the phase: skipped, never a k8sfilteredout delete.
        on(NotificationKind::Update {
            old: object("a", "1", "shop", "x"),
            new: object("a", "2", "shop", "x"),
        });
        on(NotificationKind::Update {
            old: object("a", "2", "shop", "x"),
            new: object("a", "3", "shop", "x"),
        });
        // A resync of a member passes (`type != 'updated'`).
        on(NotificationKind::Update {
            old: object("a", "3", "shop", "x"),
            new: object("a", "3", "shop", "x"),
        });
        on(NotificationKind::Update {
            old: object("a", "3", "shop", "x"),
            new: object("a", "4", "shop", "y"),
        });
        // Leaving the membership still removes it.
        on(NotificationKind::Update {
            old: object("a", "4", "shop", "y"),
            new: object("a", "5", "web", "y"),
        });
        assert_eq!(
            drain(&q),
            [
                "added 1",
                "synced 3 from 3",
                "updated 4 from 3",
                "deleted 5 filteredout"
            ]
        );
        assert_eq!(filtered[Reason::PublishIf as usize].get(), 2);
    }

    #[test]
    fn without_added_in_events_an_object_back_in_the_filter_comes_back_as_updated() {
        let (f, q, _) = stage_publishing(
            r#"{"filter": "object.metadata.labels.team == 'shop'"}"#,
            &[EventType::Updated, EventType::Deleted],
        );
        let on = |kind| f.on_notification(Notification::new(kind));
        on(NotificationKind::Add {
            obj: object("a", "1", "shop", "x"),
            is_initial_list: true,
        });
        on(NotificationKind::Update {
            old: object("a", "1", "shop", "x"),
            new: object("a", "2", "web", "x"),
        });
        on(NotificationKind::Update {
            old: object("a", "2", "web", "x"),
            new: object("a", "3", "shop", "x"),
        });
        // Not a delete last: the object is live and in the stream.
        assert_eq!(drain(&q), ["deleted 2 filteredout", "updated 3 from 2"]);
    }

    #[test]
    fn a_filter_reading_type_or_old_object_is_refused_with_the_way_out() {
        for filter in ["type != 'synced'", "object.x != oldObject.x"] {
            let err = Rules::new(&serde_yaml_like(&format!(r#"{{"filter": "{filter}"}}"#)))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("publish_if") && err.contains("at line 1, column"),
                "{err}"
            );
        }
    }

    #[test]
    fn publish_if_never_keeps_a_member_out_and_never_drops_a_resumed_repair() {
        let (f, q, _) = stage(
            r#"{"filter": "object.metadata.labels.team == 'shop'", "filter_error": "drop",
                "publish_if": "type != 'updated' || object.status.phase != oldObject.status.phase"}"#,
        );
        let on = |n: Notification| f.on_notification(n);
        on(Notification::new(NotificationKind::Add {
            obj: object("a", "1", "shop", "x"),
            is_initial_list: true,
        }));
        on(Notification::new(NotificationKind::Update {
            old: object("a", "1", "shop", "x"),
            new: object("a", "2", "web", "x"),
        }));
        // Back in the filter with the phase unchanged: publish_if fails it as an update, but
        // it enters the stream as an added.
        on(Notification::new(NotificationKind::Update {
            old: object("a", "2", "web", "x"),
            new: object("a", "3", "shop", "x"),
        }));
        // Changed while down: the stub old state has no status (an evaluation error, dropped
        // by the policy), yet the repair is published.
        let mut resumed = Notification::new(NotificationKind::Update {
            old: Arc::new(CachedObject::new(
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"namespace": "ns", "name": "b", "uid": "uid-b",
                                 "resourceVersion": "1"}}))
                .unwrap(),
            )),
            new: object("b", "2", "shop", "x"),
        });
        resumed.resumed = true;
        on(resumed);
        assert_eq!(
            drain(&q),
            [
                "added 1",
                "deleted 2 filteredout",
                "added 3",
                "updated 2 from 1"
            ]
        );
    }

    #[test]
    fn a_resumed_update_that_passes_counts_as_published() {
        // Updated while the bridge was down, then relabelled out of the filter: consumers
        // must get the k8sfilteredout delete (issue: filter + resume lost deletes).
        let (f, q, _) = stage(r#"{"filter": "object.metadata.labels.team == 'shop'"}"#);
        let mut resumed = Notification::new(NotificationKind::Update {
            old: object("a", "1", "shop", "x"),
            new: object("a", "2", "shop", "x"),
        });
        resumed.resumed = true;
        f.on_notification(resumed);
        f.on_notification(Notification::new(NotificationKind::Update {
            old: object("a", "2", "shop", "x"),
            new: object("a", "3", "web", "x"),
        }));
        f.on_notification(Notification::new(NotificationKind::Update {
            old: object("a", "3", "web", "x"),
            new: object("a", "4", "shop", "x"),
        }));
        f.on_notification(Notification::new(NotificationKind::Delete {
            obj: object("a", "5", "web", "x"),
            final_state_unknown: false,
        }));
        assert_eq!(
            drain(&q),
            [
                "updated 2 from 1",
                "deleted 3 filteredout",
                "added 4",
                "deleted 5"
            ]
        );
    }

    #[test]
    fn evaluation_errors_pass_or_drop_as_configured() {
        for (policy, expected) in [("pass", vec!["added 1"]), ("drop", vec![])] {
            let (f, q, filtered) = stage(&format!(
                r#"{{"filter": "object.spec.replicas > 2", "filter_error": "{policy}"}}"#
            ));
            f.on_notification(Notification::new(NotificationKind::Add {
                obj: object("a", "1", "shop", "x"),
                is_initial_list: false,
            }));
            assert_eq!(drain(&q), expected, "{policy}");
            assert_eq!(filtered[1].get(), (policy == "drop") as u64);
            assert_eq!(filtered[0].get(), 0);
            assert_eq!(f.stage.metrics.errors.get(), 1);
        }
    }

    #[test]
    fn status_only_updates_are_suppressed_and_the_next_update_starts_from_the_last_published() {
        let (f, q, filtered) =
            stage(r#"{"ignore_fields": ["/status", "/metadata/resourceVersion"]}"#);
        let on =
            |old, new| f.on_notification(Notification::new(NotificationKind::Update { old, new }));
        on(object("a", "1", "shop", "x"), object("a", "2", "shop", "y"));
        on(object("a", "2", "shop", "y"), object("a", "3", "shop", "z"));
        on(object("a", "3", "shop", "z"), object("a", "4", "web", "z"));
        // A resync is not an update: never suppressed.
        on(object("a", "4", "web", "z"), object("a", "4", "web", "z"));
        assert_eq!(drain(&q), ["updated 4 from 1", "synced 4 from 4"]);
        assert_eq!(filtered[2].get(), 2);
    }

    #[test]
    fn a_resync_the_route_does_not_publish_keeps_the_base_of_the_next_update() {
        let (f, q, _) = stage_publishing(
            r#"{"ignore_fields": ["/status", "/metadata/resourceVersion"]}"#,
            &[EventType::Added, EventType::Updated, EventType::Deleted],
        );
        let on =
            |old, new| f.on_notification(Notification::new(NotificationKind::Update { old, new }));
        on(object("a", "1", "shop", "x"), object("a", "2", "shop", "y"));
        // A resync the queue drops (no `synced` in events): consumers still have rv 1.
        on(object("a", "2", "shop", "y"), object("a", "2", "shop", "y"));
        on(object("a", "2", "shop", "y"), object("a", "3", "web", "y"));
        assert_eq!(drain(&q), ["updated 3 from 1"]);
    }

    #[test]
    fn without_ignore_fields_status_updates_pass() {
        let (f, q, _) = stage(r#"{"filter": "true"}"#);
        f.on_notification(Notification::new(NotificationKind::Update {
            old: object("a", "1", "shop", "x"),
            new: object("a", "2", "shop", "y"),
        }));
        assert_eq!(drain(&q), ["added 2"], "not published yet: enters as added");
        f.on_notification(Notification::new(NotificationKind::Update {
            old: object("a", "2", "shop", "y"),
            new: object("a", "3", "shop", "z"),
        }));
        assert_eq!(drain(&q), ["updated 3 from 2"]);
    }

    #[test]
    fn resumed_objects_count_as_published() {
        let (f, q, _) = stage(r#"{"filter": "object.metadata.labels.team == 'shop'"}"#);
        // Unchanged since the checkpoint and still matching: later leaves get a delete.
        f.on_known("ns/a", Some(&object("a", "1", "shop", "x")));
        // Unchanged, but the filter no longer takes it: removed at once.
        f.on_known("ns/b", Some(&object("b", "1", "web", "x")));
        f.on_notification(Notification::new(NotificationKind::Update {
            old: object("a", "1", "shop", "x"),
            new: object("a", "2", "web", "x"),
        }));
        assert_eq!(
            drain(&q),
            ["deleted 1 filteredout", "deleted 2 filteredout"]
        );
    }

    /// A pseudo-random history of `keys` objects: adds, updates moving them in and out of a
    /// `team == 'shop'` filter, status-only updates, deletes and re-creations.
    fn history(keys: usize, changes: usize) -> Vec<Notification> {
        let mut state: Vec<Option<(u64, &str, &str)>> = vec![None; keys];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut out = Vec::new();
        for rv in 1..=changes as u64 {
            let i = (next() % keys as u64) as usize;
            let name = format!("o{i}");
            let team = ["shop", "web"][(next() % 2) as usize];
            let status = ["x", "y"][(next() % 2) as usize];
            let kind = match state[i] {
                None => {
                    state[i] = Some((rv, team, status));
                    NotificationKind::Add {
                        obj: object(&name, &rv.to_string(), team, status),
                        is_initial_list: false,
                    }
                }
                Some((old_rv, old_team, old_status)) => {
                    let old = object(&name, &old_rv.to_string(), old_team, old_status);
                    if next() % 8 == 0 {
                        state[i] = None;
                        NotificationKind::Delete {
                            obj: old,
                            final_state_unknown: false,
                        }
                    } else {
                        state[i] = Some((rv, team, status));
                        NotificationKind::Update {
                            old,
                            new: object(&name, &rv.to_string(), team, status),
                        }
                    }
                }
            };
            out.push(Notification::new(kind));
        }
        out
    }

    /// Lanes give every key exactly what evaluating on the caller's thread gives: the same
    /// notifications, in the same order, and the same counts, with filter, `publish_if` and
    /// `ignore_fields` together, evaluated in parallel with the caller.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_give_each_key_what_the_callers_thread_gives() {
        lanes_match_the_callers_thread();
    }

    /// The same when the lanes' tasks never get to run (one thread, no await): every ring
    /// fills up, and the caller runs a lane each time it holds more than `RING`.
    #[tokio::test(flavor = "current_thread")]
    async fn a_lane_whose_task_is_behind_is_run_by_the_caller_in_order() {
        lanes_match_the_callers_thread();
    }

    fn lanes_match_the_callers_thread() {
        let config = r#"{"filter": "object.metadata.labels.team == 'shop'",
                         "publish_if": "type != 'updated' || object.status.phase != 'y' || object.metadata.name.endsWith('7') && object.metadata.labels.missing == 'z'",
                         "filter_error": "drop",
                         "ignore_fields": ["/metadata/resourceVersion"]}"#;
        let notes = history(300, 30_000);
        let (inline, inline_q, inline_counts) = stage_holding(config, &EventType::ALL, 1 << 20);
        let (laned, laned_q, laned_counts) = stage_holding(config, &EventType::ALL, 1 << 20);
        let laned = laned.with_lanes(3);
        // Resumed keys first, as a resume passes them on.
        for i in 0..20 {
            let (key, obj) = (
                format!("ns/o{i}"),
                object(&format!("o{i}"), "0", ["shop", "web"][i % 2], "x"),
            );
            inline.on_known(&key, Some(&obj));
            laned.on_known(&key, Some(&obj));
        }
        for n in notes {
            inline.on_notification(n.clone());
            laned.on_notification(n);
        }
        laned.flush();
        let (want, got) = (drain_by_key(&inline_q), drain_by_key(&laned_q));
        assert!(want.len() > 250, "a history that publishes: {}", want.len());
        assert_eq!(got, want);
        let counts = |c: &[IntCounter; 4]| c.iter().map(IntCounter::get).collect::<Vec<_>>();
        assert_eq!(counts(&laned_counts), counts(&inline_counts));
        assert!(
            counts(&inline_counts).iter().all(|&c| c > 0),
            "every reason occurs: {:?}",
            counts(&inline_counts)
        );
    }

    /// What a lane holds from an ended term is dropped, not published in the next.
    #[tokio::test(flavor = "current_thread")]
    async fn lanes_drop_what_an_ended_term_passed() {
        let (f, q, _) = stage(r#"{"filter": "object.metadata.labels.team == 'shop'"}"#);
        let f = f.with_lanes(2);
        for name in ["a", "b", "c"] {
            f.on_notification(Notification::new(NotificationKind::Add {
                obj: object(name, "1", "shop", "x"),
                is_initial_list: false,
            }));
        }
        // The lanes' tasks have not run yet (one thread, no await so far).
        q.set_active(false);
        q.set_active(true);
        f.flush();
        assert_eq!(drain(&q), Vec::<String>::new());
        f.on_notification(Notification::new(NotificationKind::Add {
            obj: object("a", "2", "shop", "x"),
            is_initial_list: false,
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(drain(&q), ["added 2"], "a lane's task evaluates on its own");
    }

    /// An item that passed the lane's term check just before leadership was lost and
    /// regained is evaluated as of its own term: neither it nor what it would teach the
    /// filter lands in the new term.
    #[test]
    fn an_evaluation_overtaken_by_a_new_term_publishes_nothing_in_it() {
        let (f, q, _) = stage(r#"{"filter": "object.metadata.labels.team == 'shop'"}"#);
        let ended = q.term();
        let mut st = State::default();
        q.set_active(false);
        q.set_active(true);
        // Evaluated as if it had passed the check in `ended`.
        f.stage.notify(
            &mut st,
            ended,
            Notification::new(NotificationKind::Add {
                obj: object("a", "1", "shop", "x"),
                is_initial_list: false,
            }),
        );
        assert_eq!(drain(&q), Vec::<String>::new(), "not taken in the new term");
        // The new term's first item starts from a clean state: `a` is not known as published,
        // so leaving the filter publishes nothing.
        f.stage.notify(
            &mut st,
            q.term(),
            Notification::new(NotificationKind::Update {
                old: object("a", "1", "shop", "x"),
                new: object("a", "2", "web", "x"),
            }),
        );
        assert_eq!(drain(&q), Vec::<String>::new());
        // And an item of the ended term that comes after is dropped, state untouched.
        let before = st.term;
        f.stage.notify(
            &mut st,
            ended,
            Notification::new(NotificationKind::Add {
                obj: object("b", "1", "shop", "x"),
                is_initial_list: false,
            }),
        );
        assert_eq!((st.term, st.published.len()), (before, 0));
        assert_eq!(drain(&q), Vec::<String>::new());
    }

    #[test]
    fn pointers_are_removed_with_escapes() {
        let mut v = serde_json::json!({"metadata": {"annotations": {"a/b": "1", "c": "2"}}, "list": [1, 2]});
        let pointers =
            ["/metadata/annotations/a~1b", "/list/0", "/nope/x"].map(|p| field_pointer(p).unwrap());
        remove_pointers(&mut v, &pointers);
        assert_eq!(
            v,
            serde_json::json!({"metadata": {"annotations": {"c": "2"}}, "list": [2]})
        );
    }
}
