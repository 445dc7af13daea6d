//! What a consumer ends with: a destination's messages folded per key in the order it holds
//! them, compared with the API server's objects (DESIGN.md, "What a consumer ends with").

use std::{
    collections::{BTreeMap, HashSet},
    fmt,
};

use serde_json::Value;

use super::{
    event_type,
    wait::{self, Patience},
};

/// Per object key (`namespace/name`): uid and resourceVersion, as [`super::ApiServer::objects`]
/// and [`super::cluster::Cluster::objects`] give the server's objects.
pub type Objects = BTreeMap<String, (String, String)>;

/// What a consumer that folds a stream by the order it reads it ends with, per object key:
/// the last message's object uid and resourceVersion, `None` when the last message is a
/// delete. Resyncs are folded like updates.
pub fn fold_in_order<'a>(
    events: impl IntoIterator<Item = &'a Value>,
) -> BTreeMap<String, Option<(String, String)>> {
    let mut folded = BTreeMap::new();
    for e in events {
        let meta = &e["data"]["object"]["metadata"];
        let state = (event_type(e) != "deleted").then(|| {
            (
                meta["uid"].as_str().unwrap_or_default().to_owned(),
                meta["resourceVersion"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        });
        folded.insert(e["subject"].as_str().unwrap().to_owned(), state);
    }
    folded
}

/// The second consumer model's first step (JetStream does it itself): each `id` once, the
/// first copy kept, in order.
pub fn deduplicated(events: &[Value]) -> Vec<Value> {
    let mut seen = HashSet::new();
    events
        .iter()
        .filter(|e| seen.insert(e["id"].as_str().unwrap().to_owned()))
        .cloned()
        .collect()
}

/// How a folded stream differs from the API server's objects (see [`fold_in_order`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Differences {
    /// Gone from the server, last message not a delete (or of another incarnation).
    pub lost_deletes: Vec<String>,
    /// Live on the server, last message a delete.
    pub phantom_deletes: Vec<String>,
    /// Live, last message of an older state (or another incarnation).
    pub stale: Vec<String>,
    /// Live, never published.
    pub missing: Vec<String>,
}

impl Differences {
    /// Whether the consumer ends with exactly the server's objects.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The four counts in one line: `lost deletes 0, phantom deletes 0, stale 0, missing 0`.
    pub fn counts(&self) -> String {
        format!(
            "lost deletes {}, phantom deletes {}, stale {}, missing {}",
            self.lost_deletes.len(),
            self.phantom_deletes.len(),
            self.stale.len(),
            self.missing.len()
        )
    }

    /// Adds `other`'s keys (another kind of the same stream) to these.
    pub fn extend(&mut self, other: Differences) {
        self.lost_deletes.extend(other.lost_deletes);
        self.phantom_deletes.extend(other.phantom_deletes);
        self.stale.extend(other.stale);
        self.missing.extend(other.missing);
    }
}

/// One line per kind of difference that occurs, naming its keys: `stale (2): ns/a, ns/b`;
/// `none` when the consumer ends with the server's objects.
impl fmt::Display for Differences {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        let kinds = [
            ("lost deletes", &self.lost_deletes),
            ("phantom deletes", &self.phantom_deletes),
            ("stale", &self.stale),
            ("missing", &self.missing),
        ];
        for (name, keys) in kinds.into_iter().filter(|(_, keys)| !keys.is_empty()) {
            writeln!(f, "\n  {name} ({}): {}", keys.len(), keys.join(", "))?;
        }
        Ok(())
    }
}

/// Compares `folded` with `live` (the server's objects that belong to the stream).
pub fn differences(
    folded: &BTreeMap<String, Option<(String, String)>>,
    live: &Objects,
) -> Differences {
    let mut d = Differences::default();
    for (key, state) in folded {
        match (state, live.get(key)) {
            (Some(_), None) => d.lost_deletes.push(key.clone()),
            (None, Some(_)) => d.phantom_deletes.push(key.clone()),
            (Some(got), Some(want)) if got != want => d.stale.push(key.clone()),
            _ => {}
        }
    }
    d.missing = live
        .keys()
        .filter(|k| !folded.contains_key(*k))
        .cloned()
        .collect();
    d
}

/// How `events`, folded in order ([`fold_in_order`]), differ from `live`.
pub fn compare<'a>(events: impl IntoIterator<Item = &'a Value>, live: &Objects) -> Differences {
    differences(&fold_in_order(events), live)
}

/// [`compare`] for a stream of several kinds: each kind's events (by `k8skind`) against its
/// objects, the differences added up.
pub fn compare_kinds(events: &[Value], kinds: &[(&str, Objects)]) -> Differences {
    let mut d = Differences::default();
    for (kind, live) in kinds {
        d.extend(compare(
            events.iter().filter(|e| e["k8skind"] == *kind),
            live,
        ));
    }
    d
}

/// [`compare`] for both consumer models: last message wins, and deduplicate by `id` first.
pub fn compare_both(events: &[Value], live: &Objects) -> [Differences; 2] {
    [compare(events, live), compare(&deduplicated(events), live)]
}

/// Asserts that a consumer folding `events` in order ends with exactly `live`; the panic
/// lists each lost delete, phantom delete, stale final and missing object, after `what`.
#[track_caller]
pub fn assert_matches_cluster<'a>(
    what: &str,
    events: impl IntoIterator<Item = &'a Value>,
    live: &Objects,
) {
    let d = compare(events, live);
    assert!(
        d.is_empty(),
        "{what}: the fold differs from the server: {d}"
    );
}

/// [`assert_matches_cluster`] for both consumer models (see [`compare_both`]).
#[track_caller]
pub fn assert_both_match_cluster(what: &str, events: &[Value], live: &Objects) {
    let [last_wins, deduplicated] = compare_both(events, live);
    assert!(
        last_wins.is_empty() && deduplicated.is_empty(),
        "{what}: the fold differs from the server; last message wins: {last_wins}; \
         deduplicated by id: {deduplicated}"
    );
}

/// Waits (up to 60 s) until what `read` returns folds to `live` ([`compare`]); panics naming
/// `what` otherwise.
pub async fn until_matches(what: &str, read: impl AsyncFn() -> Vec<Value>, live: &Objects) {
    let patience = Patience::of(std::time::Duration::from_secs(60));
    wait::until(what, patience, async || {
        compare(&read().await, live).is_empty()
    })
    .await;
}

/// [`until_matches`] for both consumer models ([`compare_both`]).
pub async fn until_both_match(what: &str, read: impl AsyncFn() -> Vec<Value>, live: &Objects) {
    let patience = Patience::of(std::time::Duration::from_secs(60));
    wait::until(what, patience, async || {
        compare_both(&read().await, live)
            .iter()
            .all(Differences::is_empty)
    })
    .await;
}

/// How many of `events` carry the CloudEvents extension flag `flag` (`k8sresumed`,
/// `k8sfilteredout`, …) set.
pub fn flagged(events: &[Value], flag: &str) -> usize {
    events.iter().filter(|e| e[flag] == true).count()
}
