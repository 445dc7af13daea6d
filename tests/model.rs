//! The model-based test of the whole pipeline (see `support/model.rs`), bounded: a few seeded
//! cases. `KEB_MODEL_CASES` and `KEB_MODEL_OPS` run more; `cargo bench --bench chaos -- model
//! MINUTES` runs cases until the time is up. A failing case names its seed: set
//! `KEB_MODEL_SEED` to replay it.

mod support;

use support::model::{Outcome, Settings, run_case};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sequences_where_features_meet_leave_consumers_with_the_api_servers_objects() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let cases = env("KEB_MODEL_CASES", 3);
    let ops = env("KEB_MODEL_OPS", 60) as usize;
    let first = env("KEB_MODEL_SEED", 1);
    let mut total = Outcome::default();
    for seed in first..first + cases {
        let dir = tempfile::tempdir().unwrap();
        let o = run_case(Settings { seed, ops }, dir.path()).await;
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
