//! Leader election against the local API test server: two instances, one publisher; the
//! leader's renewals are cut and the standby takes over; a release hands over at once. With
//! thousands of objects and fast renewals: each object is published once per leadership
//! change, never again at a renewal.

mod support;

use std::{
    collections::HashMap,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use kube_event_bridge::app::Report;
use serde_json::{Value, json};
use support::{
    ApiServer, RunningApp,
    config::ConfigBuilder,
    objects::{configmap, typed},
    wait,
};
use tokio::time::Instant;

/// The lease the instances take: 3 s (their fast leader election timings).
const LEASE_DURATION: Duration = Duration::from_secs(3);

struct Instance {
    identity: &'static str,
    app: RunningApp,
    out: std::path::PathBuf,
}

impl Instance {
    async fn start(api: &ApiServer, dir: &Path, identity: &'static str) -> Self {
        Self::start_renewing_every(api, dir, identity, "200ms").await
    }

    /// An instance whose lease attempts are `retry_period` apart.
    async fn start_renewing_every(
        api: &ApiServer,
        dir: &Path,
        identity: &'static str,
        retry_period: &str,
    ) -> Self {
        let out = dir.join(format!("{identity}.jsonl"));
        let config = ConfigBuilder::new()
            .configmaps()
            .stdout("out", &out)
            .route("configmap", &["out"])
            .fast_leader_election(identity, retry_period)
            .build();
        let app = RunningApp::start(config, api).await;
        Self { identity, app, out }
    }

    /// An instance writing to `out` (shared by instances that take turns: one stream, one
    /// checkpoint beside it), with the `kubernetes` section given.
    async fn start_sharing(
        api: &ApiServer,
        out: &Path,
        identity: &'static str,
        kubernetes: Value,
    ) -> Self {
        let config = ConfigBuilder::new()
            .configmaps()
            .stdout("out", out)
            .route("configmap", &["out"])
            .kubernetes(kubernetes)
            .fast_leader_election(identity, "100ms")
            .build();
        let app = RunningApp::start(config, api).await;
        Self {
            identity,
            app,
            out: out.to_owned(),
        }
    }

    fn leading(&self) -> bool {
        self.app.metrics.leader.get() == 1
    }

    /// `namespace/name` of every message this instance published.
    fn published(&self) -> Vec<String> {
        self.messages()
            .iter()
            .map(|m| m["subject"].as_str().unwrap().to_owned())
            .collect()
    }

    /// Every message this instance published.
    fn messages(&self) -> Vec<Value> {
        support::cloudevent_lines(&self.out)
    }

    async fn stop(self) -> Report {
        self.app.stop().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_publishes_a_standby_takes_over_and_a_release_hands_over_at_once() {
    let api = ApiServer::start().await;
    api.create(typed(&configmap("ns", "a", "1")));
    api.create(typed(&configmap("ns", "b", "1")));
    let dir = tempfile::tempdir().unwrap();
    let one = Instance::start(&api, dir.path(), "one").await;
    let two = Instance::start(&api, dir.path(), "two").await;

    // Watch both gauges for the whole test: never two leaders at once.
    let overlap = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn({
        let (m1, m2, overlap) = (
            one.app.metrics.clone(),
            two.app.metrics.clone(),
            overlap.clone(),
        );
        async move {
            loop {
                if m1.leader.get() == 1 && m2.leader.get() == 1 {
                    overlap.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });

    wait::until("a leader", Duration::from_secs(10), async || {
        one.leading() || two.leading()
    })
    .await;
    let (leader, standby) = if one.leading() {
        (one, two)
    } else {
        (two, one)
    };
    wait::until("the cache replay", Duration::from_secs(10), async || {
        leader.published().len() >= 2
    })
    .await;
    api.create(typed(&configmap("ns", "c", "1")));
    wait::until("c published", Duration::from_secs(10), async || {
        leader.published().contains(&"ns/c".to_string())
    })
    .await;
    assert!(
        standby.published().is_empty(),
        "the standby publishes nothing"
    );

    // The leader's renewals stop reaching the API server; a change happens during failover.
    api.refuse_lease_writes_from(Some(leader.identity));
    let cut = Instant::now();
    api.create(typed(&configmap("ns", "d", "1")));
    wait::until("the leader steps down", LEASE_DURATION, async || {
        !leader.leading()
    })
    .await;
    let published_by_old_leader = leader.published().len();
    let takeover = wait::until(
        "the standby takes over",
        Duration::from_secs(10),
        async || standby.leading(),
    )
    .await;
    let since_cut = cut.elapsed();
    assert!(
        since_cut <= LEASE_DURATION + Duration::from_secs(2),
        "takeover {since_cut:?} after the renewals stopped (lease {LEASE_DURATION:?}); waited {takeover:?}"
    );
    wait::until("d delivered", Duration::from_secs(10), async || {
        standby.published().contains(&"ns/d".to_string())
            || leader.published().contains(&"ns/d".to_string())
    })
    .await;
    api.create(typed(&configmap("ns", "e", "1")));
    wait::until("e by the new leader", Duration::from_secs(10), async || {
        standby.published().contains(&"ns/e".to_string())
    })
    .await;
    let new_leader_saw = standby.published();
    for key in ["ns/a", "ns/b", "ns/c", "ns/d"] {
        assert!(
            new_leader_saw.contains(&key.to_string()),
            "the new leader replayed {key}: {new_leader_saw:?}"
        );
    }
    assert_eq!(
        leader.published().len(),
        published_by_old_leader,
        "the old leader published nothing after stepping down"
    );

    // The new leader shuts down: it releases the lease, and the other (renewals allowed
    // again) takes over without waiting for expiry.
    api.refuse_lease_writes_from(None);
    let report = standby.stop().await;
    assert!(report.undelivered.is_empty());
    let lease = api
        .get(
            "coordination.k8s.io/v1",
            "Lease",
            "kube-system",
            "kube-event-bridge",
        )
        .unwrap();
    assert!(
        lease["spec"]["holderIdentity"].is_null(),
        "released: {lease}"
    );
    let handover = wait::until(
        "the other takes over after the release",
        Duration::from_secs(10),
        async || leader.leading(),
    )
    .await;
    assert!(
        handover < LEASE_DURATION,
        "a released lease is taken at once, not after expiry ({handover:?})"
    );
    leader.stop().await;
    sampler.abort();
    assert!(!overlap.load(Ordering::SeqCst), "two leaders at once");
}

/// How many times each message id occurs, keeping those that occur more than once.
fn repeated_ids(messages: &[Value]) -> HashMap<String, usize> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for m in messages {
        *seen
            .entry(m["id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    seen.retain(|_, n| *n > 1);
    seen
}

fn renew_time(api: &ApiServer) -> Option<String> {
    api.get(
        "coordination.k8s.io/v1",
        "Lease",
        "kube-system",
        "kube-event-bridge",
    )
    .and_then(|l| l["spec"]["renewTime"].as_str().map(str::to_owned))
}

const MANY: usize = 3000;

fn create_many(api: &ApiServer) {
    for i in 0..MANY {
        api.create(typed(&configmap("ns", &format!("cm-{i:05}"), "1")));
    }
}

/// The bug of the first release: every renewal (every `retry_period`) replayed the whole
/// cache, and repeated adds of one object piled up at the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_publishes_each_object_once_across_many_renewals() {
    let api = ApiServer::start().await;
    create_many(&api);
    // The first list fails, so leadership arrives before the informer has synced: the list
    // itself must deliver the objects, and the leadership replay must not add copies.
    api.fail_next_lists(1);
    let dir = tempfile::tempdir().unwrap();
    let one = Instance::start_renewing_every(&api, dir.path(), "one", "100ms").await;
    wait::until("leading", Duration::from_secs(10), async || one.leading()).await;
    let synced_when_leading = one.app.factory.has_synced();
    wait::until(
        "every object published",
        Duration::from_secs(30),
        async || one.published().len() >= MANY,
    )
    .await;
    // At least 20 renewals (one every 100 ms) while nothing changes.
    let renewed = renew_time(&api);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_ne!(renew_time(&api), renewed, "the lease was renewed meanwhile");
    api.update(typed(&configmap("ns", "cm-00007", "2")));
    api.create(typed(&configmap("ns", "late", "1")));
    wait::until(
        "the later changes published",
        Duration::from_secs(10),
        async || one.published().len() >= MANY + 2,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let messages = one.messages();
    let report = one.stop().await;
    assert!(report.undelivered.is_empty(), "{report:?}");
    assert!(
        !synced_when_leading,
        "the test meant leadership to arrive before the first list"
    );
    assert_eq!(
        messages.len(),
        MANY + 2,
        "each object once, then the two changes; repeated ids: {:?}",
        repeated_ids(&messages)
            .into_iter()
            .take(5)
            .collect::<Vec<_>>()
    );
    let initial = messages
        .iter()
        .filter(|m| m["k8sinitial"] == true && m["type"].as_str().unwrap().ends_with(".added"))
        .count();
    assert_eq!(initial, MANY, "the initial list, each object once");
    assert!(repeated_ids(&messages).is_empty());
}

/// A failover publishes each object once per leadership change: once by the first leader,
/// once by the one that takes over, nothing more, and nothing by a replica that does not lead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_leadership_change_publishes_each_object_once() {
    let api = ApiServer::start().await;
    create_many(&api);
    let dir = tempfile::tempdir().unwrap();
    let one = Instance::start_renewing_every(&api, dir.path(), "one", "100ms").await;
    wait::until("one leads", Duration::from_secs(10), async || one.leading()).await;
    let two = Instance::start_renewing_every(&api, dir.path(), "two", "100ms").await;
    two.app.synced().await;
    wait::until(
        "one published every object",
        Duration::from_secs(30),
        async || one.published().len() >= MANY,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await; // ten renewals
    assert_eq!(one.published().len(), MANY, "renewals published nothing");
    assert!(two.published().is_empty(), "the standby publishes nothing");

    api.refuse_lease_writes_from(Some(one.identity));
    wait::until("one steps down", LEASE_DURATION, async || !one.leading()).await;
    wait::until("two takes over", Duration::from_secs(10), async || {
        two.leading()
    })
    .await;
    wait::until(
        "two replayed every object",
        Duration::from_secs(30),
        async || two.published().len() >= MANY,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await; // ten renewals by the new leader
    let (by_one, by_two) = (one.messages(), two.messages());
    two.stop().await;
    one.stop().await;
    assert_eq!(by_one.len(), MANY, "{:?}", repeated_ids(&by_one));
    assert_eq!(by_two.len(), MANY, "{:?}", repeated_ids(&by_two));
    assert!(repeated_ids(&by_one).is_empty() && repeated_ids(&by_two).is_empty());
    let subjects = |ms: &[Value]| {
        ms.iter()
            .map(|m| m["subject"].as_str().unwrap().to_owned())
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(
        subjects(&by_one),
        subjects(&by_two),
        "both leaders sent every object"
    );
}

/// A standby's watch can lag behind the leader's (here: stalled, while the leader's stall
/// timeout restarted its own). Its cache is then older than what the leader published. The new
/// leader relists (a consistent read) and compares the checkpoint with that, not with its
/// cache: nothing is published for objects that did not change, and the stream, folded in
/// order, ends equal to the API server (comparing with the stale cache deleted the newly
/// created object, re-added the deleted one and moved the updated one back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_compares_the_checkpoint_with_a_fresh_list_not_its_lagging_cache() {
    let api = ApiServer::start().await;
    for i in 0..5 {
        api.create(typed(&configmap("ns", &format!("x{i}"), "1")));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("stream.jsonl");
    let one =
        Instance::start_sharing(&api, &out, "one", json!({"watch_stall_timeout": "1s"})).await;
    wait::until("one leads", Duration::from_secs(10), async || one.leading()).await;
    let two = Instance::start_sharing(&api, &out, "two", json!({})).await;
    two.app.synced().await;
    support::wait_for_lines(&out, 5).await;
    // Every open watch goes silent: one's restarts after 1 s, two's stays silent.
    api.stall_watches();
    api.create(typed(&configmap("ns", "new", "1")));
    api.update(typed(&configmap("ns", "x1", "2")));
    api.delete("v1", "ConfigMap", "ns", "x2");
    support::wait_for_lines(&out, 8).await;
    assert_eq!(
        two.app.factory.informers()[0].indexer().len(),
        5,
        "the standby's cache lags: it saw none of the three changes"
    );
    // one hands over: drained, checkpoint written, lease released.
    one.stop().await;
    wait::until("two takes over", Duration::from_secs(10), async || {
        two.leading()
    })
    .await;
    let relisted = || {
        two.app
            .metrics
            .informer_relists
            .with_label_values(&[two.app.factory.informers()[0].name()])
            .get()
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let events = support::cloudevent_lines(&out);
    let live = api.objects("v1", "ConfigMap");
    let relists = relisted();
    two.stop().await;
    support::assert_matches_cluster("after the hand-over", &events, &live);
    assert_eq!(
        events.len(),
        8,
        "the new leader published nothing: every object was unchanged since the checkpoint"
    );
    assert_eq!(relists, 1, "one relist, on becoming leader");
}

/// A new leader whose relist is held back (the kind's lists are refused for a while) sees the
/// kind move to another version before that relist: the new version's informer lists afresh
/// and the route compares that list with the checkpoint. Only what changed is published (the
/// new informer used to start from the standby's cache, so unchanged objects went by as
/// resyncs and the resume deleted every one of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_switch_while_a_new_leader_waits_for_its_relist_deletes_nothing() {
    const GROUP: &str = "shop.example.org";
    let api = ApiServer::start().await;
    api.install_crd(GROUP, "v1beta1", "Widget", "widgets", true);
    let widget = |name: &str| {
        support::objects::custom_resource(&format!("{GROUP}/v1beta1"), "Widget", Some("ns"), name)
    };
    for i in 0..20 {
        api.create(widget(&format!("w{i}")));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("stream.jsonl");
    let start = async |identity| {
        let config = ConfigBuilder::new()
            .kubernetes(json!({"discovery_refresh": "1s", "discovery_grace": "1s"}))
            .resources(json!([{"name": "shop", "api_version": format!("{GROUP}/*"), "kind": "*"}]))
            .stdout("out", &out)
            .route_each_resource_to(&["out"])
            .fast_leader_election(identity, "100ms")
            .build();
        RunningApp::start(config, &api).await
    };
    let one = start("one").await;
    wait::until("one leads", Duration::from_secs(10), async || {
        one.metrics.leader.get() == 1
    })
    .await;
    let two = start("two").await;
    two.synced().await;
    support::wait_for_lines(&out, 20).await;
    // two's relist on taking over is refused until the kind has moved.
    api.forbid("widgets", true);
    assert!(one.stop().await.undelivered.is_empty());
    wait::until("two takes over", Duration::from_secs(10), async || {
        two.metrics.leader.get() == 1
    })
    .await;
    api.serve_crd_at(GROUP, "widgets", "v1");
    let factory = two.factory.clone();
    wait::until("the informer at v1", Duration::from_secs(10), async || {
        factory
            .informers()
            .iter()
            .any(|i| i.name().contains("/v1/widgets"))
    })
    .await;
    api.delete(&format!("{GROUP}/v1"), "Widget", "ns", "w0");
    api.forbid("widgets", false);
    wait::until("the delete", Duration::from_secs(20), async || {
        support::cloudevent_lines(&out).len() > 20
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let events = support::cloudevent_lines(&out);
    assert!(two.stop().await.undelivered.is_empty());
    support::assert_matches_cluster(
        "after the version switch",
        &events,
        &api.objects(&format!("{GROUP}/v1"), "Widget"),
    );
    assert_eq!(
        events.len(),
        21,
        "only the delete was published after the takeover"
    );
}

/// The holder's timing travels with the Lease: a lease left by a holder whose messages may
/// be delivered up to 8 s after its last renewal began (its `renew_deadline` plus a long
/// `delivery_timeout`, written as `kube-event-bridge.io/delivered-within`) is taken over by
/// an instance whose own settings need no wait (a stdout sink), and that instance still
/// waits 8 s − 3 s (the lease's duration) before publishing: the metric and `/readyz` say so
/// meanwhile, and the end is logged. The same lease without the annotation (a holder of an
/// older release), or with one another holder wrote (an older release renewed it since), is
/// waited out with the taker's own settings: at once. A holder that also announced what
/// fences its messages (`kube-event-bridge.io/fenced-by`: no transactional ids, and what it
/// sends otherwise delivered within 3 s, inside the lease) is taken over at once; one that
/// announced an id the taker has no producer of, or whose announcement is of an earlier
/// renewal (renewed since by a release that keeps it), is waited out as without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taker_waits_out_the_last_holders_longer_deliveries() {
    // The announced transactional ids, and whether announced at the Lease's renewal.
    let none: Option<(&[&str], bool)> = None;
    let cases = [
        (Some("8s;an-old-pod"), none, true),
        (None, none, false),
        (Some("8s;another-pod"), none, false),
        (Some("8s;an-old-pod"), Some((&[][..], true)), false),
        (
            Some("8s;an-old-pod"),
            Some((&["kube-event-bridge.elsewhere.kafka"][..], true)),
            true,
        ),
        (Some("8s;an-old-pod"), Some((&[][..], false)), true),
    ];
    for (annotation, fenced_by, annotated) in cases {
        let api = ApiServer::start().await;
        api.create(typed(&configmap("ns", "a", "1")));
        let renewed = jiff::Timestamp::now().to_string();
        let mut lease = json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "kube-event-bridge", "namespace": "kube-system"},
            "spec": {"holderIdentity": "an-old-pod", "leaseDurationSeconds": 3,
                     "acquireTime": renewed, "renewTime": renewed},
        });
        if let Some(value) = annotation {
            lease["metadata"]["annotations"] =
                json!({"kube-event-bridge.io/delivered-within": value});
        }
        if let Some((ids, current)) = fenced_by {
            let at = if current {
                renewed.clone()
            } else {
                "2026-01-01T00:00:00Z".into()
            };
            let value = json!({"holder": "an-old-pod", "renewed": at,
                               "transactionalIds": ids, "unfencedWithin": "3s"});
            lease["metadata"]["annotations"]["kube-event-bridge.io/fenced-by"] =
                json!(value.to_string());
        }
        api.create(lease);
        let dir = tempfile::tempdir().unwrap();
        let taker = Instance::start(&api, dir.path(), "taker").await;
        let gauge = taker
            .app
            .metrics
            .takeover_wait
            .with_label_values(&["kube-event-bridge"]);
        let took = wait::until(
            "the lease taken over",
            Duration::from_secs(15),
            async || api.lease_holder().as_deref() == Some("taker"),
        )
        .await;
        let taken_at = Instant::now();
        let published = wait::until("a published", Duration::from_secs(20), async || {
            !taker.published().is_empty()
        });
        if annotated {
            // The wait shows while it lasts (its length is checked by when it publishes;
            // the count may be seen late on a loaded machine).
            wait::until("the wait shown", Duration::from_secs(4), async || {
                gauge.get() > 0.0
            })
            .await;
            assert!(
                gauge.get() <= 5.0,
                "at most the annotated wait: {}",
                gauge.get()
            );
            let (_, readyz) = support::http_get(taker.app.admin, "/readyz").await;
            assert!(
                readyz.contains("lease kube-event-bridge: taken over; publishing in"),
                "{readyz}"
            );
            published.await;
            let waited = taken_at.elapsed();
            assert!(
                waited >= Duration::from_millis(4_500),
                "published {waited:?} after taking the lease over (after {took:?}); the old holder's messages may land until 5 s after"
            );
            assert_eq!(gauge.get(), 0.0, "the wait is over");
        } else {
            published.await;
            let waited = taken_at.elapsed();
            assert!(
                waited < Duration::from_secs(3),
                "no annotation of this holder ({annotation:?}), or all it sends fenced or delivered within the lease ({fenced_by:?}), and no wait of the taker's own: published after {waited:?}"
            );
        }
        taker.stop().await;
    }
}

/// An elector whose renewals are refused steps down; nothing is reported while the lease
/// stays its own (no one else can have fenced it), and a deposal naming the taker, with the
/// lost term's count and the instant from which another could take it (the last renewal
/// plus the lease's duration), once another identity holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_while_leading_is_reported_once_another_holds_it() {
    use kube_event_bridge::leader::{Fence, LeaderElectionConfig, LeaderElector};
    let api = ApiServer::start().await;
    let cfg = LeaderElectionConfig {
        enabled: true,
        lease_duration: LEASE_DURATION,
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(200),
        ..Default::default()
    };
    let elector = |identity: &str| {
        LeaderElector::new(
            api.client(),
            &cfg,
            "kube-system",
            identity.to_owned(),
            Fence::default(),
            Duration::ZERO,
            prometheus::IntGauge::new("leading", "leading").unwrap(),
        )
    };
    let (cancel_a, cancel_b) = (
        tokio_util::sync::CancellationToken::new(),
        tokio_util::sync::CancellationToken::new(),
    );
    let mut a = elector("a");
    let mut deposals_a = a.deposals();
    let (leading_a, terms_a) = (a.subscribe(), a.terms());
    let run_a = tokio::spawn(a.run(cancel_a.clone()));
    wait::until("a leads", Duration::from_secs(10), async || {
        *leading_a.borrow()
    })
    .await;
    let refused_at = Instant::now();
    api.refuse_lease_writes_from(Some("a"));
    wait::until("a steps down", Duration::from_secs(10), async || {
        !*leading_a.borrow()
    })
    .await;
    // Still its own on the API server: nothing fenced it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(deposals_a.try_recv().is_err(), "no one else holds it yet");
    api.refuse_lease_writes_from(None);
    let b = elector("b");
    let run_b = tokio::spawn(b.run(cancel_b.clone()));
    // `a` may win it back before `b` has waited the lease out: then it leads again and
    // reports nothing; refuse it once more so that `b` takes it.
    api.refuse_lease_writes_from(Some("a"));
    let deposal = tokio::time::timeout(Duration::from_secs(20), deposals_a.recv())
        .await
        .expect("a deposal within the lease's expiry and a retry")
        .expect("the elector runs");
    assert_eq!(deposal.holder, "b");
    assert_eq!(
        deposal.term,
        terms_a.load(Ordering::SeqCst),
        "the lost term is the last one a began"
    );
    assert!(!*leading_a.borrow());
    // Its last renewal started less than a retry period (and an answer) before the refusal.
    let from = deposal.takeable_from;
    assert!(
        from > refused_at + LEASE_DURATION - Duration::from_secs(1) && from <= Instant::now(),
        "takeable {:?} after the refusal",
        from.saturating_duration_since(refused_at)
    );
    // Reported once per loss.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(deposals_a.try_recv().is_err(), "once per loss");
    // `b` releases on shutdown: `a` takes it at once.
    cancel_b.cancel();
    run_b.await.unwrap();
    api.refuse_lease_writes_from(None);
    wait::until("a leads again", Duration::from_secs(10), async || {
        *leading_a.borrow()
    })
    .await;
    cancel_a.cancel();
    run_a.await.unwrap();
}
