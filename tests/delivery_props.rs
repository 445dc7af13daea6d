//! The retry rule, as a property: whatever happens to each acknowledgement (success, a
//! failure, an acknowledgement lost although the broker stored the message, a refusal as too
//! large), a consumer ends with every object's newest state and every incarnation's delete, in
//! both consumer models ("last message wins" and "deduplicate by id, then last message
//! wins"), on a log that keeps every copy (Kafka) and on one that drops a repeated id within
//! its deduplication window (JetStream's `Nats-Msg-Id`).
//!
//! The real route (route queue, workers, encoder, trimming, retries) publishes to a scripted
//! sink: each hand-over takes the next outcome of the case's script and is stored (or not) in
//! the order it was handed over, as one broker connection stores it; acknowledgements come
//! after a scripted delay, so several keys are in flight at once. Bounded cases here
//! (`KEB_DELIVERY_CASES`, default 48); more with e.g. `KEB_DELIVERY_CASES=2000`.

#[path = "support/fake_sink.rs"]
mod fake_sink;
#[path = "support/objects.rs"]
mod objects;

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
    time::Duration,
};

use fake_sink::{FakeSink, Outcome};
use kube_event_bridge::{
    config::MessageConfig,
    informer::{Notification, NotificationKind, ObjectRef},
    message::{Encoder, Encoding},
    metrics::Metrics,
    pipeline::{self, Budget, RouteBuilder},
    workqueue::rate_limiter::RetrySettings,
};
use objects::{Meta, cached, configmap_with_data, configmaps};
use proptest::prelude::*;

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        6 => Just(Outcome::Stored),
        2 => Just(Outcome::Failed),
        2 => Just(Outcome::LostButStored),
        1 => Just(Outcome::TooLarge),
        1 => Just(Outcome::Refused),
    ]
}

/// One stored message: (key, id, type, uid, resourceVersion).
type Stored = (String, String, String, String, String);

/// What the cluster does to one of a few objects.
#[derive(Debug, Clone, Copy)]
enum Change {
    /// Added (a new incarnation) if gone, else updated.
    Touch(u8),
    /// Deleted, if present.
    Delete(u8),
    /// Time passes (milliseconds): workers publish, acknowledgements come.
    Pause(u8),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        5 => (0u8..4).prop_map(Change::Touch),
        2 => (0u8..4).prop_map(Change::Delete),
        2 => (0u8..20).prop_map(Change::Pause),
    ]
}

fn object(name: &str, uid: &str, rv: u64) -> ObjectRef {
    cached(
        configmap_with_data("ns", name, [("v", rv.to_string())])
            .uid(uid)
            .resource_version(rv),
    )
}

/// The state each consumer model ends with per key, and the uids whose delete it read.
fn fold(log: &[Stored], deduplicate: bool) -> (BTreeMap<String, Stored>, HashSet<String>) {
    let mut last = BTreeMap::new();
    let mut deleted = HashSet::new();
    let mut seen = HashSet::new();
    for s in log {
        if deduplicate && !seen.insert(s.1.clone()) {
            continue;
        }
        if s.2 == "deleted" {
            deleted.insert(s.3.clone());
        }
        last.insert(s.0.clone(), s.clone());
    }
    (last, deleted)
}

fn run_case(
    changes: Vec<Change>,
    script: Vec<(Outcome, u8)>,
    window: Option<usize>,
) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let sink = Arc::new(FakeSink {
            script,
            window,
            ..FakeSink::named("scripted")
        });
        let metrics = Arc::new(Metrics::new());
        let budget = Arc::new(Budget::new(1_000_000));
        let delivery = fake_sink::delivery_to(sink.clone(), None);
        let message = MessageConfig {
            include_old_object: true,
            ..MessageConfig::default()
        };
        let encoder = Encoder::new("test", &configmaps(), &message, Encoding::Structured);
        let route = RouteBuilder::new("configmap", "scripted", encoder, delivery, &metrics)
            .budget(budget.clone())
            .retry(RetrySettings {
                base: Duration::from_millis(1),
                max: Duration::from_millis(50),
                qps: 10_000.0,
                burst: 10_000,
            })
            .build()
            .route;
        let running = pipeline::start(&[(route.clone(), 2)]);
        // Per object: its live incarnation (uid, object), incarnations so far; every uid
        // deleted.
        let mut live: BTreeMap<u8, (String, ObjectRef)> = BTreeMap::new();
        let mut incarnations: BTreeMap<u8, u32> = BTreeMap::new();
        let mut deleted_uids = Vec::new();
        let mut rv = 0;
        for c in changes {
            match c {
                Change::Touch(k) => {
                    rv += 1;
                    let name = format!("o{k}");
                    let n = match live.get(&k) {
                        Some((uid, old)) => {
                            let new = object(&name, uid, rv);
                            let n = Notification::new(NotificationKind::Update {
                                old: old.clone(),
                                new: new.clone(),
                            });
                            live.insert(k, (uid.clone(), new));
                            n
                        }
                        None => {
                            let i = incarnations.entry(k).or_default();
                            *i += 1;
                            let uid = format!("uid-{k}-{i}");
                            let obj = object(&name, &uid, rv);
                            live.insert(k, (uid, obj.clone()));
                            Notification::new(NotificationKind::Add {
                                obj,
                                is_initial_list: false,
                            })
                        }
                    };
                    route.queue().push(n);
                }
                Change::Delete(k) => {
                    let Some((uid, obj)) = live.remove(&k) else {
                        continue;
                    };
                    rv += 1;
                    deleted_uids.push(uid);
                    let n = Notification::new(NotificationKind::Delete {
                        obj,
                        final_state_unknown: false,
                    });
                    route.queue().push(n);
                }
                Change::Pause(ms) => tokio::time::sleep(Duration::from_millis(ms as u64)).await,
            }
        }
        // Everything settles: retries go on until each is stored and acknowledged.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3600);
        while budget.held() > 0 {
            prop_assert!(
                tokio::time::Instant::now() < deadline,
                "{} notifications never settled",
                budget.held()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        running
            .drain(tokio::time::Instant::now() + Duration::from_secs(5))
            .await;
        let log: Vec<Stored> = sink
            .accepted()
            .iter()
            .map(|a| {
                let attr = |name: &str| a.attribute(name).to_owned();
                let ty = a.event_type().to_owned();
                (a.key.clone(), a.id.clone(), ty, attr("k8suid"), attr("k8sresourceversion"))
            })
            .collect();
        for deduplicate in [false, true] {
            let model = if deduplicate {
                "deduplicate by id, then last wins"
            } else {
                "last message wins"
            };
            let (last, deletes) = fold(&log, deduplicate);
            for k in incarnations.keys() {
                let key = format!("ns/o{k}");
                let got = last.get(&key);
                match live.get(k) {
                    Some((uid, obj)) => {
                        let rv = obj.resource_version().unwrap_or_default().to_owned();
                        prop_assert!(
                            got.is_some_and(|s| s.2 != "deleted" && s.3 == *uid && s.4 == rv),
                            "{model}: {key} should end at {uid}@{rv}, ends with {got:?}; log {log:?}"
                        );
                    }
                    None => prop_assert!(
                        got.is_some_and(|s| s.2 == "deleted"),
                        "{model}: {key} should end deleted, ends with {got:?}; log {log:?}"
                    ),
                }
            }
            for uid in &deleted_uids {
                prop_assert!(
                    deletes.contains(uid),
                    "{model}: the delete of {uid} is missing; log {log:?}"
                );
            }
        }
        Ok(())
    })
}

fn cases() -> u32 {
    std::env::var("KEB_DELIVERY_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_ack_outcome_leaves_the_newest_state_last_in_both_consumer_models(
        changes in proptest::collection::vec(change(), 1..60),
        script in proptest::collection::vec((outcome(), 0u8..8), 0..120),
        window in prop_oneof![Just(None), Just(Some(usize::MAX)), (1usize..6).prop_map(Some)],
    ) {
        run_case(changes, script, window)?;
    }
}
