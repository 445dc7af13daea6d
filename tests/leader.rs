//! Leader election against the local API test server: two instances, one publisher; the
//! leader's renewals are cut and the standby takes over; a release hands over at once.

mod support;

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use kube_event_bridge::{app::Report, config::Config};
use serde_json::{Value, json};
use support::{ApiServer, RunningApp, configmap, typed};
use tokio::time::Instant;

const LEASE_DURATION: Duration = Duration::from_secs(3);

fn config(dir: &Path, identity: &str) -> Config {
    Config::from_value(json!({
        "cluster": "test",
        "admin": {"address": "127.0.0.1:0"},
        "resources": [{"api_version": "v1", "kind": "ConfigMap"}],
        "sinks": [{"name": "out", "type": "stdout", "stdout": {"path": dir.join(format!("{identity}.jsonl"))}}],
        "routes": [{"resource": "configmap", "sinks": ["out"]}],
        "leader_election": {
            "enabled": true, "identity": identity, "namespace": "kube-system",
            "lease_duration": "3s", "renew_deadline": "2s", "retry_period": "200ms",
        },
    }))
    .unwrap()
}

struct Instance {
    identity: &'static str,
    app: RunningApp,
    out: std::path::PathBuf,
}

impl Instance {
    async fn start(api: &ApiServer, dir: &Path, identity: &'static str) -> Self {
        let app = RunningApp::start(config(dir, identity), api).await;
        Self {
            identity,
            app,
            out: dir.join(format!("{identity}.jsonl")),
        }
    }

    fn leading(&self) -> bool {
        self.app.metrics.leader.get() == 1
    }

    /// `namespace/name` of every message this instance published.
    fn published(&self) -> Vec<String> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["subject"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    async fn stop(self) -> Report {
        self.app.stop().await
    }
}

async fn until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "{what} did not happen within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
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

    until("a leader", Duration::from_secs(10), || {
        one.leading() || two.leading()
    })
    .await;
    let (leader, standby) = if one.leading() {
        (one, two)
    } else {
        (two, one)
    };
    until("the cache replay", Duration::from_secs(10), || {
        leader.published().len() >= 2
    })
    .await;
    api.create(typed(&configmap("ns", "c", "1")));
    until("c published", Duration::from_secs(10), || {
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
    until("the leader steps down", LEASE_DURATION, || {
        !leader.leading()
    })
    .await;
    let published_by_old_leader = leader.published().len();
    let takeover = until("the standby takes over", Duration::from_secs(10), || {
        standby.leading()
    })
    .await;
    let since_cut = cut.elapsed();
    assert!(
        since_cut <= LEASE_DURATION + Duration::from_secs(2),
        "takeover {since_cut:?} after the renewals stopped (lease {LEASE_DURATION:?}); waited {takeover:?}"
    );
    until("d delivered", Duration::from_secs(10), || {
        standby.published().contains(&"ns/d".to_string())
            || leader.published().contains(&"ns/d".to_string())
    })
    .await;
    api.create(typed(&configmap("ns", "e", "1")));
    until("e by the new leader", Duration::from_secs(10), || {
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
    let handover = until(
        "the other takes over after the release",
        Duration::from_secs(10),
        || leader.leading(),
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
