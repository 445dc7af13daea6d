//! Where a route filter's rules meet a notification: what the route knows of its consumers
//! (per lane), and the evaluation the module docs' contract describes.

use std::collections::{HashMap, HashSet};

use tracing::warn;

use super::{
    expr::Expr,
    settings::{FilterErrorPolicy, FilterMetrics, Reason, Rules, equal_ignoring},
};
use crate::{
    informer::{CachedObject, EventType, Key, Notification, NotificationKind, ObjectRef},
    pipeline::RouteQueue,
};

/// What evaluates: the rules, the queue behind, the counters.
pub(super) struct Stage {
    pub(super) route: String,
    pub(super) rules: std::sync::Arc<Rules>,
    pub(super) queue: std::sync::Arc<RouteQueue>,
    pub(super) metrics: FilterMetrics,
}

/// What a route knows of its consumers, for the keys of one lane (all keys without lanes).
#[derive(Default)]
pub(super) struct State {
    pub(super) term: u64,
    // Keys whose consumers have the object (only kept with a `filter` or `publish_if`).
    pub(super) published: HashSet<Key>,
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
    pub(super) fn notify(&self, st: &mut State, term: u64, mut n: Notification) {
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

    /// From a resume: the consumers have `key` (see [`crate::informer::NotificationHandler::on_known`]).
    pub(super) fn known(
        &self,
        st: &mut State,
        term: u64,
        key: &str,
        unchanged: Option<&ObjectRef>,
    ) {
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
