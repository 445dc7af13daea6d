//! The model-based test of the whole pipeline (see `support/model.rs`), bounded: a few seeded
//! cases, single-leader and sharded. `KEB_MODEL_CASES` and `KEB_MODEL_OPS` run more; `cargo bench --bench chaos -- model
//! MINUTES` runs cases until the time is up. A failing case names its seed: set
//! `KEB_MODEL_SEED` to replay it.

mod support;

use support::model::{Outcome, Settings, run_case};

/// Runs `KEB_MODEL_CASES` cases (default `cases`) of `KEB_MODEL_OPS` operations (default
/// `ops`) from seed `KEB_MODEL_SEED` (default `first`), each asserted, and prints the sums.
async fn cases(sharded: bool, cases: u64, ops: u64, first: u64) {
    // `KEB_MODEL_LOG=info` (a filter): the replicas' logs on standard error, for a replay.
    if let Ok(filter) = std::env::var("KEB_MODEL_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let cases = env("KEB_MODEL_CASES", cases);
    let ops = env("KEB_MODEL_OPS", ops) as usize;
    let first = env("KEB_MODEL_SEED", first);
    let mut total = Outcome::default();
    for seed in first..first + cases {
        let dir = tempfile::tempdir().unwrap();
        let o = run_case(Settings { seed, ops, sharded }, dir.path()).await;
        println!("seed {seed}: {}", o.line());
        assert!(
            o.holds(),
            "seed {seed} (replay: KEB_MODEL_SEED={seed} KEB_MODEL_CASES=1): {}",
            o.details()
        );
        total.add(&o);
    }
    println!("model: {cases} cases: {}", total.line());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sequences_where_features_meet_leave_consumers_with_the_api_servers_objects() {
    cases(false, 3, 60, 1).await;
}

/// The same with sharded replicas and shard handovers: replicas replaced, scale out and in,
/// rolling updates between shard counts 1, 2 and 3, lease timings that differ between
/// replicas, and the CRD deleted and created again meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_shard_handovers_and_count_changes_leave_consumers_with_the_api_servers_objects() {
    cases(true, 2, 60, 101).await;
}
