//! Memory per cached object: OBJECTS ConfigMaps of about 960 bytes of JSON (labels,
//! annotations, managedFields, a few data keys, as a real cluster's), decoded from JSON text as
//! the reflector decodes a list, transformed (managedFields stripped) and put into an
//! [`Indexer`] with the namespace index, as the informer caches them. Prints the resident
//! memory the cache adds, per object and against the objects' JSON bytes (compact, after the
//! transform), for the cache as it is (`CachedObject`: the JSON plus a few parsed fields)
//! and, for comparison, for `DynamicObject` trees (what the cache held before). Each mode
//! runs in a process of its own, so that one's freed memory does not hide the other's.
//!
//! `cargo bench --bench memory [-- OBJECTS]` (default 100000)

#[path = "../tests/support/objects.rs"]
mod objects;

use std::sync::Arc;

use kube::api::DynamicObject;
use kube_event_bridge::{config::MessageConfig, informer::Indexer, message::object_transform};
use objects::{configmaps, realistic_configmap, typed};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// The JSON text of ConfigMap `i`, as the API server sends it.
fn configmap_json(i: usize) -> String {
    typed(&realistic_configmap(i)).to_string()
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let objects: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(100_000);
    match args
        .iter()
        .find(|a| a.starts_with("mode="))
        .map(String::as_str)
    {
        None => {
            println!("memory bench: {objects} ConfigMaps, Indexer with the namespace index");
            for mode in ["cached", "dynamic"] {
                let out = std::process::Command::new(std::env::current_exe().unwrap())
                    .args([format!("mode={mode}"), objects.to_string()])
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                print!("{}", String::from_utf8_lossy(&out.stdout));
            }
        }
        Some(mode) => measure(&mode["mode=".len()..], objects),
    }
}

fn measure(mode: &str, objects: usize) {
    let resource = configmaps();
    let transform = object_transform(&resource, &MessageConfig::default());
    let before = resident_bytes();
    let mut json_bytes = 0usize;
    let started = std::time::Instant::now();
    let (kept_cached, kept_dynamic) = match mode {
        "cached" => {
            // With the namespace index, as every informer's.
            let indexer = Indexer::new();
            for i in 0..objects {
                // As a list page's item is cached: from the server's bytes.
                let cached = transform.cache(&configmap_json(i)).unwrap();
                json_bytes += cached.json().get().len();
                let key = kube_event_bridge::informer::meta_namespace_key(&cached);
                indexer.upsert(&key, Arc::new(cached));
            }
            (Some(indexer), None)
        }
        _ => {
            // What the cache held before: the decoded tree, keyed the same way.
            let mut map = std::collections::HashMap::new();
            for i in 0..objects {
                let mut obj: DynamicObject = serde_json::from_str(&configmap_json(i)).unwrap();
                transform.apply(&mut obj);
                json_bytes += serde_json::to_string(&obj).unwrap().len();
                let key = kube_event_bridge::informer::meta_namespace_key(&obj);
                map.insert(key, Arc::new(obj));
            }
            (None, Some(map))
        }
    };
    let took = started.elapsed().as_secs_f64();
    let added = resident_bytes().saturating_sub(before) as f64;
    println!(
        "  {mode:<8} {objects} objects, {:.0} B of JSON each: resident +{:.1} MiB, {:.0} B per object, {:.2}x the JSON bytes (decode+transform+cache {:.2} s)",
        json_bytes as f64 / objects as f64,
        added / 1048576.0,
        added / objects as f64,
        added / json_bytes as f64,
        took,
    );
    drop((kept_cached, kept_dynamic));
}
