//! The parity scenario at scale, on the real kube-apiserver v1.36 and etcd 3.6
//! (tests/support/cluster.rs): OBJECTS ConfigMaps (about 1 KB each) in one namespace, then
//! client-go's own informer and the bridge (release binary, stdout sink to a file, default
//! `max_pending`) start side by side; CHANGES random changes follow from 16 writers at once;
//! then a gap (the API server SIGKILLed, 5% of the objects deleted straight in etcd, history
//! compacted) and both relist.
//!
//! Prints: the create rate; each one's time to sync and (the bridge) to publish every
//! object; after the churn and after the gap, the comparison (versions seen bridge/client-go,
//! keys whose notifications differ, identical finals, final-state-unknown deletes, and every
//! loss column against the API server); the peak of notifications the bridge held
//! (`keb_listener_buffered_notifications`, sampled every 50 ms); each process's peak RSS.
//!
//! `cargo bench --bench real_cluster` (BENCH_OBJECTS=20000, BENCH_CHANGES=20000; needs
//! target/realk8s/realk8s, which scripts/test builds).

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    collections::BTreeSet,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use support::{
    cluster::{Cluster, ReferenceInformer},
    json_lines,
    objects::{configmap_with_data, realistic_configmap},
    parity::{Comparison, Rng, bridge, bridge_seen, client_go_seen, fsu, ready, seed, settle},
    wait::{self, Patience},
};

const NS: &str = "scale";
const WRITERS: u64 = 16;

fn from_env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&v| v > 0)
        .unwrap_or(default)
}

/// ConfigMap `i`: the realistic one's data, in [`NS`], as a client creates it.
fn object(i: u64, round: u64) -> ConfigMap {
    let real = realistic_configmap(i as usize);
    let mut data = real.data.unwrap();
    data.insert("round".into(), round.to_string());
    configmap_with_data(NS, &format!("cm-{i:06}"), data)
}

/// Notifications the bridge holds now (summed over its routes).
async fn held(admin: std::net::SocketAddr) -> u64 {
    let (_, body) = support::http_get(admin, "/metrics").await;
    body.lines()
        .filter(|l| l.starts_with("keb_listener_buffered_notifications{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn main() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run());
}

async fn run() {
    let n = from_env("BENCH_OBJECTS", 20_000);
    let changes = from_env("BENCH_CHANGES", 20_000);
    let seed = seed();
    println!("real cluster: {n} objects, {changes} changes, seed {seed}");
    let mut cluster = Cluster::start().await;
    println!("kube-apiserver ready in {:.1?}", cluster.last_start);
    cluster.create_namespace(NS).await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().await, NS);

    let began = Instant::now();
    stream::iter(0..n)
        .for_each_concurrent(64, |i| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &object(i, 0))
                    .await
                    .unwrap();
            }
        })
        .await;
    let took = began.elapsed();
    println!(
        "created {n} in {took:.1?} ({:.0}/s)",
        n as f64 / took.as_secs_f64()
    );

    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig();
    let began = Instant::now();
    let reference =
        ReferenceInformer::start(&kubeconfig, dir.path(), ("", "v1", "configmaps"), Some(NS));
    let replica = bridge(dir.path(), NS, &kubeconfig, false, 100_000);
    let out = dir.path().join("bridge.jsonl");
    let patience = Patience::of(Duration::from_secs(600)).polling(Duration::from_millis(100));
    let (mut client_go_synced, mut bridge_published) = (None, None);
    wait::until("both synced", patience, async || {
        if client_go_synced.is_none() && reference.lines().iter().any(|l| l["type"] == "synced") {
            client_go_synced = Some(began.elapsed());
        }
        if bridge_published.is_none() && json_lines(&out).len() as u64 >= n {
            bridge_published = Some(began.elapsed());
        }
        client_go_synced.is_some() && bridge_published.is_some()
    })
    .await;
    ready(&replica).await;
    println!(
        "initial list: client-go synced in {:.2?}; the bridge published all {n} in {:.2?}",
        client_go_synced.unwrap(),
        bridge_published.unwrap()
    );

    // The peak of what the bridge holds, sampled through the churn and the gap.
    let peak = Arc::new(AtomicU64::new(0));
    let admin = replica.admin().unwrap();
    let sampler = tokio::spawn({
        let peak = peak.clone();
        async move {
            loop {
                peak.fetch_max(held(admin).await, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });

    // Churn: each writer owns the objects i ≡ w (mod WRITERS), so no two race on one.
    let began = Instant::now();
    let deleted = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    stream::iter(0..WRITERS)
        .for_each_concurrent(WRITERS as usize, |w| {
            let (api, deleted) = (api.clone(), deleted.clone());
            async move {
                let mut rng = Rng(seed ^ (w + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                for round in 1..=changes / WRITERS {
                    let i = w + WRITERS * rng.below(n / WRITERS);
                    let name = format!("cm-{i:06}");
                    let gone = deleted.lock().unwrap().contains(&i);
                    if gone {
                        api.create(&PostParams::default(), &object(i, round))
                            .await
                            .unwrap();
                        deleted.lock().unwrap().remove(&i);
                    } else if rng.below(10) == 0 {
                        api.delete(&name, &DeleteParams::default()).await.unwrap();
                        deleted.lock().unwrap().insert(i);
                    } else {
                        api.replace(&name, &PostParams::default(), &object(i, round))
                            .await
                            .unwrap();
                    }
                }
            }
        })
        .await;
    let took = began.elapsed();
    println!(
        "churn: {changes} changes in {took:.1?} ({:.0}/s)",
        changes as f64 / took.as_secs_f64()
    );
    let live = settle(
        &cluster,
        NS,
        &reference,
        dir.path(),
        Duration::from_secs(600),
    )
    .await;
    println!("settled {:.1?} after the churn began", began.elapsed());
    let c = Comparison::of(&json_lines(&out), &reference.lines(), &live);
    println!("after the churn: {c}");
    c.print_differing_keys(3);

    // The gap.
    cluster.kill_apiserver();
    let gap: BTreeSet<String> = live.keys().step_by(20).cloned().collect();
    for key in &gap {
        cluster.etcd_delete(&format!("/registry/configmaps/{key}"));
    }
    cluster.etcd_compact();
    cluster.start_apiserver().await;
    let began = Instant::now();
    let (mut client_go_relisted, mut bridge_relisted) = (None, None);
    wait::until("both relisted", patience, async || {
        if client_go_relisted.is_none()
            && fsu(&client_go_seen(&reference.lines())).is_superset(&gap)
        {
            client_go_relisted = Some(began.elapsed());
        }
        if bridge_relisted.is_none() && fsu(&bridge_seen(&json_lines(&out))).is_superset(&gap) {
            bridge_relisted = Some(began.elapsed());
        }
        client_go_relisted.is_some() && bridge_relisted.is_some()
    })
    .await;
    println!(
        "gap: {} deleted in etcd; after the API server's restart ({:.1?}), client-go inferred them in {:.2?}, the bridge in {:.2?}",
        gap.len(),
        cluster.last_start,
        client_go_relisted.unwrap(),
        bridge_relisted.unwrap()
    );
    let live = settle(
        &cluster,
        NS,
        &reference,
        dir.path(),
        Duration::from_secs(600),
    )
    .await;
    sampler.abort();
    let c = Comparison::of(&json_lines(&out), &reference.lines(), &live);
    println!("after the gap: {c}");
    c.print_differing_keys(3);
    println!(
        "peak held by the bridge {} notifications; peak RSS: bridge {:.0} MiB, client-go {:.0} MiB",
        peak.load(Ordering::Relaxed),
        support::peak_rss_mib(replica.child.id()),
        support::peak_rss_mib(reference.pid()),
    );
}
