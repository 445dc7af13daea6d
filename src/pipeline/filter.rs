//! Change-aware filtering between a route's listeners (or its resumer) and its queue: the CEL
//! `filter` and no-op suppression by `ignore_fields`. (`exclude_namespaces` is a field selector
//! the API server applies: see `ResourceConfig::effective_field_selector`.)
//!
//! # Contract
//! - The filter is a CEL expression over `object` (the newest state), `oldObject` (the
//!   previous state for `updated` and `synced`, else `null`) and `type` (`added`, `updated`,
//!   `deleted`, `synced`); a notification passes when it yields `true`. An evaluation error
//!   passes or drops the notification as `filter_error` says; each is counted, and logged once
//!   per key.
//! - Consumers are never left with a stale object. The route remembers which objects it
//!   published (and a resume's checkpoint tells it which ones the consumers had before):
//!   - a delete of a published object is always published, whatever the filter says;
//!   - when an update or resync of a published object fails the filter and the object no
//!     longer belongs to the stream (it fails the filter both as `added` and as `updated`),
//!     a `deleted` notification of its current state marked `k8sfilteredout: true` is
//!     published instead (when the route publishes deletes at all);
//!   - an update or resync that passes for an object not published yet is published as
//!     `added` (when the filter passes it as such), so that every object enters the stream
//!     with an `added`.
//! - With `ignore_fields`, an update whose old and new objects are equal once those JSON
//!   pointers are removed is suppressed (`reason="suppressed"`). The next published update of
//!   the object carries, as its old state, the last one published: `oldObject` and
//!   `data.patch` always lead from what consumers have to the newest state.
//!
//! Every route evaluates on its own (each has its own view of what its consumers have), so
//! `keb_filtered_total` carries the sink besides the resource and the reason.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
};

use cel::common::{types, value::Val};
use prometheus::IntCounter;
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use tracing::warn;

use super::RouteQueue;
use crate::{
    config::{EventType, FilterErrorPolicy, ResourceConfig},
    informer::{CachedObject, Notification, NotificationHandler, NotificationKind, ObjectRef},
};

/// The variables a filter sees.
pub const VARIABLES: [&str; 3] = ["object", "oldObject", "type"];

/// Reasons counted in `keb_filtered_total{reason}`, in this order.
pub const REASONS: [&str; 3] = ["filter", "filter_error", "suppressed"];

/// A compiled filter expression.
pub struct Expr {
    program: cel::Program,
    env: Arc<cel::Env>,
    // Top-level fields of `object` and `oldObject` the expression reads (`metadata`,
    // `spec`), when it reads them only as `object.field…`: the rest is not even parsed.
    // `None` parses everything; a variable not used at all is not parsed.
    object_fields: Option<Option<HashSet<String>>>,
    old_fields: Option<Option<HashSet<String>>>,
}

impl std::fmt::Debug for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Expr").finish_non_exhaustive()
    }
}

impl Expr {
    /// Compiles `source`. A syntax error names its line and column; so does a reference to
    /// something that is neither a variable the filter sees nor a CEL function, and an
    /// expression that is not boolean (checked by evaluating it against a sample object, as
    /// CEL here is dynamically typed: errors that depend on the objects show at evaluation).
    pub fn compile(source: &str) -> Result<Self, String> {
        let env = Arc::new(cel::Env::stdlib());
        let program = env.compile(source).map_err(|errs| {
            let first = errs.errors.first();
            match first {
                Some(e) => format!(
                    "syntax error at line {}, column {}: {}",
                    e.pos.0,
                    e.pos.1,
                    e.msg.strip_prefix("Syntax error: ").unwrap_or(&e.msg)
                ),
                None => "syntax error".to_owned(),
            }
        })?;
        let refs = program.references();
        let expr = Self {
            object_fields: refs
                .has_variable("object")
                .then(|| fields_read(source, "object")),
            old_fields: refs
                .has_variable("oldObject")
                .then(|| fields_read(source, "oldObject")),
            program,
            env,
        };
        expr.check(source)?;
        Ok(expr)
    }

    /// Evaluates the expression against a sample object as each event type, and turns what
    /// cannot depend on the objects into an error: an undeclared reference, a wrong argument
    /// count, an operator or function applied to types it does not take (the sample's
    /// metadata has Kubernetes' types), or a result that is not a boolean.
    fn check(&self, source: &str) -> Result<(), String> {
        for ty in EventType::ALL {
            let old = matches!(ty, EventType::Updated | EventType::Synced).then_some(SAMPLE);
            let sample = |json| to_val(json, None).expect("a valid sample");
            match self.run(sample(SAMPLE), old.map_or_else(null, sample), ty) {
                Ok(cel::Value::Bool(_)) => {}
                Ok(other) => {
                    return Err(format!(
                        "the expression must be a boolean, but gives a {:?} value",
                        other.type_of()
                    ));
                }
                Err(cel::ExecutionError::UndeclaredReference(name)) => {
                    let at = column_of(source, &name)
                        .map(|c| format!(" at line 1, column {c}"))
                        .unwrap_or_default();
                    return Err(format!(
                        "unknown name `{name}`{at}: a filter sees {} and CEL's standard functions",
                        VARIABLES.join(", ")
                    ));
                }
                Err(
                    e @ (cel::ExecutionError::InvalidArgumentCount { .. }
                    | cel::ExecutionError::NoSuchOverload(_)
                    | cel::ExecutionError::UnsupportedBinaryOperator(..)
                    | cel::ExecutionError::ValuesNotComparable(..)),
                ) if ty == EventType::Updated => {
                    return Err(format!("type error: {e}"));
                }
                Err(_) => {} // depends on the objects (a missing key, say)
            }
        }
        Ok(())
    }

    /// Whether the notification about `object` (and `old`) of type `ty` passes. The objects'
    /// JSON is read straight into CEL values that borrow its strings, skipping the top-level
    /// fields the expression does not read.
    pub fn eval(
        &self,
        object: &CachedObject,
        old: Option<&CachedObject>,
        ty: EventType,
    ) -> Result<bool, String> {
        let object = match &self.object_fields {
            Some(keep) => to_val(object.json().get(), keep.as_ref())?,
            None => null(),
        };
        let old = match (&self.old_fields, old) {
            (Some(keep), Some(old)) => to_val(old.json().get(), keep.as_ref())?,
            _ => null(),
        };
        match self.run(object, old, ty) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!(
                "the filter gave a {:?} value, not a boolean",
                other.type_of()
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    fn run<'v>(
        &self,
        object: Box<dyn Val + 'v>,
        old: Box<dyn Val + 'v>,
        ty: EventType,
    ) -> Result<cel::Value, cel::ExecutionError> {
        let mut ctx = cel::Context::with_env(self.env.clone());
        ctx.add_variable_as_val("object", object);
        ctx.add_variable_as_val("oldObject", old);
        ctx.add_variable_from_value("type", ty.as_str());
        self.program.execute(&ctx)
    }
}

fn null<'v>() -> Box<dyn Val + 'v> {
    Box::new(types::CelNull)
}

/// The top-level fields of `var` that `source` reads, when every whole-word occurrence of
/// `var` is followed by `.field`; `None` (everything) otherwise, e.g. for `object["spec"]`,
/// `size(object)` or `var` in a string literal.
fn fields_read(source: &str, var: &str) -> Option<HashSet<String>> {
    let mut fields = HashSet::new();
    for i in whole_words(source, var) {
        let field: String = source[i + var.len()..]
            .trim_start()
            .strip_prefix('.')?
            .trim_start()
            .chars()
            .take_while(|&c| is_word(c))
            .collect();
        if field.is_empty() {
            return None;
        }
        fields.insert(field);
    }
    Some(fields)
}

/// The 1-based column of the first whole-word occurrence of `name` in `source`.
fn column_of(source: &str, name: &str) -> Option<usize> {
    whole_words(source, name)
        .next()
        .map(|i| source[..i].chars().count() + 1)
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Byte offsets of the occurrences of `name` in `source` that are not part of a longer name.
fn whole_words<'a>(source: &'a str, name: &'a str) -> impl Iterator<Item = usize> + 'a {
    source.match_indices(name).filter_map(move |(i, _)| {
        let before = source[..i].chars().next_back();
        let after = source[i + name.len()..].chars().next();
        (!before.is_some_and(is_word) && !after.is_some_and(is_word)).then_some(i)
    })
}

/// What a filter is checked against at load: metadata with Kubernetes' types.
const SAMPLE: &str = r#"{"apiVersion":"v1","kind":"Sample","metadata":{"name":"sample",
    "namespace":"default","uid":"00000000-0000-0000-0000-000000000000","resourceVersion":"1",
    "generation":1,"creationTimestamp":"2026-01-01T00:00:00Z","labels":{},"annotations":{}}}"#;

/// Parses JSON straight into a CEL value borrowing its strings; at the top level only the
/// fields in `keep` (all when `None`).
fn to_val<'a>(json: &'a str, keep: Option<&HashSet<String>>) -> Result<Box<dyn Val + 'a>, String> {
    let mut de = serde_json::Deserializer::from_str(json);
    de.deserialize_any(ValVisitor { keep })
        .map_err(|e| format!("cannot read the object: {e}"))
}

struct ValVisitor<'k> {
    keep: Option<&'k HashSet<String>>,
}

impl<'de> Visitor<'de> for ValVisitor<'_> {
    type Value = Box<dyn Val + 'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelBool::from(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelInt::from(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(match i64::try_from(v) {
            Ok(i) => Box::new(types::CelInt::from(i)),
            Err(_) => Box::new(types::CelUInt::from(v)),
        })
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelDouble::from(v)))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelString::from(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelString::from(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelString::from(v)))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelNull))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items: Vec<Box<dyn Val + 'de>> = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(v) = seq.next_element_seed(ValSeed)? {
            items.push(v);
        }
        Ok(Box::new(types::CelList::from(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries: HashMap<types::CelMapKey<'de>, Box<dyn Val + 'de>> = HashMap::new();
        while let Some(k) = map.next_key_seed(KeySeed)? {
            if let Some(keep) = self.keep
                && !keep.contains(k.as_ref())
            {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            let v = map.next_value_seed(ValSeed)?;
            let key = match k {
                std::borrow::Cow::Borrowed(k) => types::CelMapKey::from(k),
                std::borrow::Cow::Owned(k) => types::CelMapKey::from(k),
            };
            entries.insert(key, v);
        }
        Ok(Box::new(types::CelMap::from(entries)))
    }
}

struct ValSeed;

impl<'de> serde::de::DeserializeSeed<'de> for ValSeed {
    type Value = Box<dyn Val + 'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(ValVisitor { keep: None })
    }
}

/// A map key, borrowed from the JSON unless it has escapes.
struct KeySeed;

impl<'de> serde::de::DeserializeSeed<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v))
    }
}

/// Removes each JSON pointer of `pointers` from `value` (a missing one is ignored).
pub fn remove_pointers(value: &mut serde_json::Value, pointers: &[String]) {
    for p in pointers {
        if p.is_empty() {
            *value = serde_json::Value::Null;
            continue;
        }
        let (parent, last) = p.rsplit_once('/').expect("validated: starts with /");
        let last = last.replace("~1", "/").replace("~0", "~");
        match value.pointer_mut(parent) {
            Some(serde_json::Value::Object(m)) => {
                m.remove(&last);
            }
            Some(serde_json::Value::Array(a)) => {
                if let Ok(i) = last.parse::<usize>()
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
pub fn equal_ignoring(a: &CachedObject, b: &CachedObject, pointers: &[String]) -> bool {
    // Only the top-level fields that differ are parsed; what is equal stays equal.
    match crate::message::differing_fields(a, b) {
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
    on_error: FilterErrorPolicy,
    ignore_fields: Vec<String>,
}

impl Rules {
    /// The rules of `r`, or `None` when it filters nothing. The config was validated, so the
    /// expression compiles.
    pub fn of(r: &ResourceConfig) -> Result<Option<Self>, String> {
        if r.filter.is_none() && r.ignore_fields.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self {
            filter: r.filter.as_deref().map(Expr::compile).transpose()?,
            on_error: r.filter_error,
            ignore_fields: r.ignore_fields.clone(),
        }))
    }
}

/// Counters of one route.
pub struct FilterMetrics {
    /// `keb_filtered_total{resource,sink,reason}`, by [`REASONS`].
    pub filtered: [IntCounter; 3],
    /// `keb_filter_errors_total{resource,sink}`.
    pub errors: IntCounter,
}

/// The filter stage of one route. See the module docs.
pub struct RouteFilter {
    route: String,
    rules: Arc<Rules>,
    queue: Arc<RouteQueue>,
    publishes_deletes: bool,
    metrics: FilterMetrics,
    state: Mutex<State>,
}

/// What the filter says of one notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Pass,
    Fail,
    // An evaluation error with `filter_error: drop`.
    ErrorDrop,
}

impl Verdict {
    /// The index in [`REASONS`] of a notification dropped for this verdict.
    fn reason(self) -> usize {
        match self {
            Self::ErrorDrop => 1,
            _ => 0,
        }
    }
}

#[derive(Default)]
struct State {
    term: u64,
    // Keys whose consumers have the object (only kept with a filter).
    published: HashSet<String>,
    // Per key with suppressed updates: the old state of the first one, the last published.
    bases: HashMap<String, ObjectRef>,
    // Keys whose evaluation error was logged.
    logged: HashSet<String>,
}

impl RouteFilter {
    /// The filter stage of route `route` in front of `queue`; `publishes_deletes`: whether the
    /// route's `events` include `deleted` (else no `k8sfilteredout` notification is sent).
    pub fn new(
        route: String,
        rules: Arc<Rules>,
        queue: Arc<RouteQueue>,
        publishes_deletes: bool,
        metrics: FilterMetrics,
    ) -> Self {
        Self {
            route,
            rules,
            queue,
            publishes_deletes,
            metrics,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // A new term starts from what its replay publishes.
        let term = self.queue.term();
        if st.term != term {
            *st = State {
                term,
                ..State::default()
            };
        }
        st
    }

    /// Whether the filter passes `object` as a notification of type `ty`; errors as the
    /// policy says.
    fn verdict(
        &self,
        st: &mut State,
        key: &str,
        object: &CachedObject,
        old: Option<&CachedObject>,
        ty: EventType,
    ) -> Verdict {
        let Some(expr) = &self.rules.filter else {
            return Verdict::Pass;
        };
        match expr.eval(object, old, ty) {
            Ok(true) => Verdict::Pass,
            Ok(false) => Verdict::Fail,
            Err(err) => {
                self.metrics.errors.inc();
                if st.logged.insert(key.to_owned()) {
                    warn!(route = %self.route, key, error = %err, policy = ?self.rules.on_error,
                          "Cannot evaluate the filter on this object (logged once per object)");
                }
                match self.rules.on_error {
                    FilterErrorPolicy::Pass => Verdict::Pass,
                    FilterErrorPolicy::Drop => Verdict::ErrorDrop,
                }
            }
        }
    }

    /// Whether the object still belongs to the stream: the filter passes it as `added` or as
    /// `updated` (a filter on `type` alone never removes an object).
    fn member(&self, st: &mut State, key: &str, new: &CachedObject, old: &CachedObject) -> bool {
        self.verdict(st, key, new, None, EventType::Added) == Verdict::Pass
            || self.verdict(st, key, new, Some(old), EventType::Updated) == Verdict::Pass
    }

    fn drop_for(&self, reason: usize) {
        self.metrics.filtered[reason].inc();
    }

    /// Publishes the `k8sfilteredout` delete of `obj`, received at `at`.
    fn filtered_out(&self, obj: ObjectRef, at: (std::time::Instant, jiff::Timestamp)) {
        if !self.publishes_deletes {
            return;
        }
        self.queue.push(Notification {
            kind: NotificationKind::Delete {
                obj,
                final_state_unknown: false,
            },
            received: at.0,
            observed: at.1,
            resumed: false,
            filtered_out: true,
        });
    }
}

impl NotificationHandler for RouteFilter {
    fn on_notification(&self, mut n: Notification) {
        if !self.queue.is_active() {
            return;
        }
        let obj = n.object().clone();
        let key = n.key();
        let ty = n.event_type();
        let has_filter = self.rules.filter.is_some();
        let mut st = self.lock();
        match n.kind.clone() {
            NotificationKind::Delete { .. } => {
                st.bases.remove(&key);
                st.logged.remove(&key);
                let published = st.published.remove(&key) || n.resumed;
                if has_filter && !published {
                    let verdict = self.verdict(&mut st, &key, &obj, None, ty);
                    if verdict != Verdict::Pass {
                        return self.drop_for(verdict.reason());
                    }
                }
            }
            NotificationKind::Add { .. } => {
                let verdict = self.verdict(&mut st, &key, &obj, None, ty);
                if verdict == Verdict::Pass {
                    if has_filter {
                        st.published.insert(key);
                    }
                } else {
                    if st.published.remove(&key) {
                        drop(st);
                        return self.filtered_out(obj, (n.received, n.observed));
                    }
                    return self.drop_for(verdict.reason());
                }
            }
            NotificationKind::Update { old, new } => {
                if has_filter {
                    let published = st.published.contains(&key) || n.resumed;
                    let verdict = self.verdict(&mut st, &key, &new, Some(&old), ty);
                    if verdict != Verdict::Pass {
                        if published && !self.member(&mut st, &key, &new, &old) {
                            st.published.remove(&key);
                            st.bases.remove(&key);
                            drop(st);
                            return self.filtered_out(new, (n.received, n.observed));
                        }
                        return self.drop_for(verdict.reason());
                    }
                    if !published {
                        st.published.insert(key.clone());
                        st.bases.remove(&key);
                        if self.verdict(&mut st, &key, &new, None, EventType::Added)
                            == Verdict::Pass
                        {
                            n.kind = NotificationKind::Add {
                                obj: new,
                                is_initial_list: false,
                            };
                        }
                        drop(st);
                        return self.queue.push(n);
                    }
                }
                if !self.rules.ignore_fields.is_empty() && ty == EventType::Updated && !n.resumed {
                    if equal_ignoring(&old, &new, &self.rules.ignore_fields) {
                        st.bases.entry(key).or_insert(old);
                        return self.drop_for(2);
                    }
                    if let Some(base) = st.bases.remove(&key) {
                        n.kind = NotificationKind::Update { old: base, new };
                    }
                }
            }
        }
        drop(st);
        self.queue.push(n);
    }

    fn on_known(&self, key: &str, unchanged: Option<&ObjectRef>) {
        if self.rules.filter.is_none() || !self.queue.is_active() {
            return;
        }
        let mut st = self.lock();
        match unchanged {
            Some(obj) if !self.member(&mut st, key, obj, obj) => {
                // The filter changed since the consumers got it.
                st.published.remove(key);
                drop(st);
                let now = (std::time::Instant::now(), jiff::Timestamp::now());
                self.filtered_out(obj.clone(), now);
            }
            _ => {
                st.published.insert(key.to_owned());
            }
        }
    }

    fn on_synced(&self) {
        self.queue.on_synced();
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

    fn object(name: &str, rv: &str, team: &str, status: &str) -> ObjectRef {
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

    fn stage(config: &str) -> (RouteFilter, Arc<RouteQueue>, [IntCounter; 3]) {
        let r: ResourceConfig = serde_yaml_like(config);
        let rules = Arc::new(Rules::of(&r).unwrap().expect("rules"));
        let queue = Arc::new(RouteQueue::new(
            "r".into(),
            Box::new(ItemExponentialFailureRateLimiter::new(
                Duration::from_secs(1),
                Duration::from_secs(10),
            )),
            QueueMetrics::unregistered(),
            Arc::new(super::super::Budget::new(1000)),
            IntGauge::new("b", "b").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        ));
        let filtered = REASONS.map(|r| IntCounter::new(format!("f_{r}"), "f").unwrap());
        let f = RouteFilter::new(
            "r".into(),
            rules,
            queue.clone(),
            true,
            FilterMetrics {
                filtered: filtered.clone(),
                errors: IntCounter::new("e", "e").unwrap(),
            },
        );
        (f, queue, filtered)
    }

    fn serde_yaml_like(extra: &str) -> ResourceConfig {
        let mut v = serde_json::json!({"api_version": "v1", "kind": "ConfigMap"});
        let extra: serde_json::Value = serde_json::from_str(extra).unwrap();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    /// What the queue holds, as `type rv [filteredout]`, in order, for key `ns/a`.
    fn drain(q: &RouteQueue) -> Vec<String> {
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
                if let NotificationKind::Update { old, .. } = &n.kind {
                    s += &format!(" from {}", old.resource_version().unwrap_or_default());
                }
                if n.filtered_out {
                    s += " filteredout";
                }
                out.push(s);
            }
        }
        out
    }

    #[test]
    fn syntax_errors_name_line_and_column() {
        let err = Expr::compile("object.metadata.name ==").unwrap_err();
        assert!(err.starts_with("syntax error at line 1, column"), "{err}");
        let err = Expr::compile("object.metadata.name == 'a' &&\n  ) ").unwrap_err();
        assert!(err.starts_with("syntax error at line 2"), "{err}");
    }

    #[test]
    fn unknown_names_and_non_boolean_expressions_are_errors() {
        let err = Expr::compile("obj.metadata.name == 'a'").unwrap_err();
        assert!(
            err.contains("unknown name `obj` at line 1, column 1"),
            "{err}"
        );
        let err = Expr::compile("type == 'added' && nosuch(object)").unwrap_err();
        assert!(err.contains("unknown name `nosuch`"), "{err}");
        let err = Expr::compile("object.metadata.name").unwrap_err();
        assert!(err.contains("must be a boolean"), "{err}");
        let err = Expr::compile("object.metadata.generation + 'x' == 1").unwrap_err();
        assert!(err.starts_with("type error"), "{err}");
        // Depends on the objects: fine at compile time.
        Expr::compile("object.spec.replicas > 2").unwrap();
        Expr::compile(r#"object.metadata.labels["team"] == "shop" && type != "synced""#).unwrap();
        Expr::compile("has(object.metadata.labels.team) && object.metadata.name.startsWith('a')")
            .unwrap();
        Expr::compile("type == 'updated' && object.data != oldObject.data").unwrap();
    }

    #[test]
    fn evaluation_sees_object_old_object_and_type() {
        let e = Expr::compile(
            r#"object.metadata.labels["team"] == "shop" && (type != "updated" || oldObject.status.phase != object.status.phase)"#,
        )
        .unwrap();
        let a = object("a", "1", "shop", "Pending");
        let b = object("a", "2", "shop", "Running");
        let c = object("a", "3", "web", "Running");
        assert_eq!(e.eval(&a, None, EventType::Added), Ok(true));
        assert_eq!(e.eval(&b, Some(&a), EventType::Updated), Ok(true));
        assert_eq!(e.eval(&b, Some(&b), EventType::Updated), Ok(false));
        assert_eq!(e.eval(&c, None, EventType::Added), Ok(false));
        let missing = Expr::compile("object.spec.replicas > 2").unwrap();
        let err = missing.eval(&a, None, EventType::Added).unwrap_err();
        assert!(err.contains("spec"), "{err}");
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
    fn a_filter_on_type_alone_never_removes_objects() {
        let (f, q, _) = stage(r#"{"filter": "type != 'synced'"}"#);
        let a1 = object("a", "1", "shop", "x");
        f.on_notification(Notification::new(NotificationKind::Add {
            obj: a1.clone(),
            is_initial_list: true,
        }));
        f.on_notification(Notification::new(NotificationKind::Update {
            old: a1.clone(),
            new: a1.clone(),
        }));
        assert_eq!(drain(&q), ["added 1"]);
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
            assert_eq!(f.metrics.errors.get(), 1);
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
        assert!(Rules::of(&r).unwrap().is_none(), "no filter stage for that");
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

    #[test]
    fn only_the_top_level_fields_read_are_parsed() {
        let set = |s: &[&str]| Some(s.iter().map(|s| s.to_string()).collect::<HashSet<_>>());
        assert_eq!(
            fields_read(
                "object.metadata.name == 'a' && object . spec.x > oldObject.status.y",
                "object"
            ),
            set(&["metadata", "spec"])
        );
        assert_eq!(
            fields_read("oldObject.status.y == 1", "oldObject"),
            set(&["status"])
        );
        assert_eq!(fields_read("oldObject.status.y == 1", "object"), set(&[]));
        assert_eq!(fields_read("size(object) > 1", "object"), None);
        assert_eq!(fields_read("object['spec'].x == 1", "object"), None);
        assert_eq!(fields_read("object.spec.x == 'the object'", "object"), None);
        // Pruned or not, the verdict is the same.
        let o = object("a", "1", "shop", "x");
        for e in [
            "object.status.phase == 'x'",
            "has(object.data) && object.metadata.labels.team == 'shop'",
        ] {
            let pruned = Expr::compile(e).unwrap();
            let whole = Expr::compile(&format!("{e} && size(object) > 0")).unwrap();
            assert_eq!(pruned.eval(&o, None, EventType::Added), Ok(true), "{e}");
            assert_eq!(whole.eval(&o, None, EventType::Added), Ok(true), "{e}");
        }
    }

    #[test]
    fn pointers_are_removed_with_escapes() {
        let mut v = serde_json::json!({"metadata": {"annotations": {"a/b": "1", "c": "2"}}, "list": [1, 2]});
        remove_pointers(
            &mut v,
            &[
                "/metadata/annotations/a~1b".into(),
                "/list/0".into(),
                "/nope/x".into(),
            ],
        );
        assert_eq!(
            v,
            serde_json::json!({"metadata": {"annotations": {"c": "2"}}, "list": [2]})
        );
    }
}
