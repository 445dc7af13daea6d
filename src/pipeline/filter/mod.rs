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
mod settings;
mod stage;

use std::sync::Arc;

pub use json_patch::jsonptr::PointerBuf;

pub use expr::{Error, Expr, VARIABLES};
use lanes::{Item, Lanes};
pub use settings::{
    FilterErrorPolicy, FilterMetrics, FilterSettings, Reason, Rules, equal_ignoring,
    remove_pointers,
};
use stage::Stage;

use super::RouteQueue;
use crate::informer::{Notification, NotificationHandler, ObjectRef};

/// The filter stage of one route. See the module docs.
///
/// Built with [`RouteFilter::new`] it evaluates on the caller's thread (the informer's), one
/// notification at a time; [`RouteFilter::with_lanes`] evaluates on tasks of its own, in
/// parallel across keys and in order per key (see `lanes`).
pub struct RouteFilter {
    stage: Arc<Stage>,
    lanes: Lanes,
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
    use super::{settings::field_pointer, stage::State, *};
    use crate::informer::{CachedObject, EventType, Key, NotificationKind, ObjectMetaRef};
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
