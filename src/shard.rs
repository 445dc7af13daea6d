//! Shards: a fixed split of every resource's objects into `sharding.shards` parts by the
//! 64-bit FNV-1a hash of the object's namespace, as Kubernetes' server-side sharded list and
//! watch (KEP-5866) defines it: shard `i` of `m` holds the hashes in
//! `[i·2⁶⁴/m, (i+1)·2⁶⁴/m)`.
//!
//! # Why the namespace, not the uid
//! Every incarnation of `namespace/name` (deleted and created again) must stay in one shard:
//! the delete of the old one and the add of the new one go to the same topic under the same
//! key, and only one publisher keeps them in order. The uid differs between incarnations, so
//! a uid split could publish the old incarnation's delete (from one shard's owner) after the
//! new one's add (from another's), and a compacted topic would then end with a tombstone for
//! a live object. The namespace keeps them together; the cost is balance: one namespace is
//! never split, and all cluster-scoped objects (namespace "") fall into one shard.

use serde::{Deserialize, Serialize};

use crate::problems::Section;

/// The most shards a configuration may ask for.
pub const MAX_SHARDS: u32 = 256;

/// How a resource's objects are split among the replicas.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ShardingConfig {
    /// Number of shards, each owned through its own Lease by one replica at a time; the
    /// replicas share them. 1 (the default) is single-leader mode.
    #[serde(default = "default_shards")]
    pub shards: u32,
}

impl Default for ShardingConfig {
    fn default() -> Self {
        Self {
            shards: default_shards(),
        }
    }
}

fn default_shards() -> u32 {
    1
}

impl ShardingConfig {
    /// Checks the count; paths relative to `sharding`.
    pub fn validate(&self, p: &mut Section) {
        if self.shards == 0 || self.shards > MAX_SHARDS {
            p.add(
                "shards",
                format!("must be between 1 and {MAX_SHARDS}, not {}", self.shards),
            );
        }
    }

    /// Every shard.
    pub fn all(&self) -> Vec<Shard> {
        let count = self.shards.clamp(1, MAX_SHARDS);
        (0..count).map(|index| Shard { index, count }).collect()
    }
}

/// 64-bit FNV-1a, the hash of KEP-5866.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// One shard: `index` of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard {
    /// Which one, from 0.
    pub index: u32,
    /// Of how many.
    pub count: u32,
}

impl Shard {
    /// The only shard of single-leader mode.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// Whether it is the whole keyspace (one shard).
    pub fn is_whole(&self) -> bool {
        self.count <= 1
    }

    /// Its hash range `[start, end)`; `end` may be 2⁶⁴.
    pub fn range(&self) -> (u128, u128) {
        let span = 1u128 << 64;
        let count = u128::from(self.count.max(1));
        (
            span * u128::from(self.index) / count,
            span * (u128::from(self.index) + 1) / count,
        )
    }

    /// Whether an object of `namespace` ("" for cluster-scoped) belongs to it.
    pub fn holds_namespace(&self, namespace: &str) -> bool {
        self.holds_hash(fnv1a64(namespace.as_bytes()))
    }

    /// Whether a hash falls in its range.
    pub fn holds_hash(&self, hash: u64) -> bool {
        let (start, end) = self.range();
        let h = u128::from(hash);
        start <= h && h < end
    }

    /// Whether the object of key `namespace/name` (or `name`) belongs to it.
    pub fn holds_key(&self, key: &str) -> bool {
        self.is_whole() || self.holds_namespace(key.split_once('/').map_or("", |(ns, _)| ns))
    }

    /// The `shardSelector` of KEP-5866 for its range, on the object's namespace.
    pub fn selector(&self) -> String {
        let (start, end) = self.range();
        format!("shardRange(object.metadata.namespace, '{start:#018x}', '{end:#018x}')")
    }

    /// How it is named in lease names, routes and metrics: `3-of-12`.
    pub fn label(&self) -> String {
        format!("{}-of-{}", self.index, self.count)
    }

    /// The shard a [`Shard::label`] names; `None` when `label` is not one.
    pub fn from_label(label: &str) -> Option<Shard> {
        let (index, count) = label.split_once("-of-")?;
        let shard = Shard {
            index: index.parse().ok()?,
            count: count.parse().ok()?,
        };
        (shard.index < shard.count).then_some(shard)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {}/{}", self.index, self.count)
    }
}

/// A route of sink `sink` (`{base}/{sink}`, or `{base}#{i}-of-{m}/{sink}` with sharding)
/// split into its base and its shard label; `None` when `route` is not one of `sink`'s.
pub fn split_route<'a>(route: &'a str, sink: &str) -> Option<(&'a str, Option<&'a str>)> {
    let kind = route.strip_suffix(sink)?.strip_suffix('/')?;
    Some(match kind.rsplit_once('#') {
        Some((base, label)) if Shard::from_label(label).is_some() => (base, Some(label)),
        _ => (kind, None),
    })
}

/// The label of the shard whose route `route` (of sink `sink`) is: `""` when it carries no
/// shard label (single-leader mode) or is not one of `sink`'s.
pub fn label_of_route<'a>(route: &'a str, sink: &str) -> &'a str {
    split_route(route, sink)
        .and_then(|(_, label)| label)
        .unwrap_or("")
}

/// Parses a `shardRange(object.metadata.<field>, 'start', 'end')` selector: the field and the
/// range. `None` when it is not one.
pub fn parse_selector(selector: &str) -> Option<(String, u128, u128)> {
    let inner = selector
        .trim()
        .strip_prefix("shardRange(")?
        .strip_suffix(')')?;
    let mut parts = inner.split(',').map(str::trim);
    let field = parts.next()?.strip_prefix("object.metadata.")?.to_owned();
    let mut bound = || {
        let p = parts.next()?;
        let hex = p
            .strip_prefix('\'')?
            .strip_suffix('\'')?
            .strip_prefix("0x")?;
        u128::from_str_radix(hex, 16).ok()
    };
    let (start, end) = (bound()?, bound()?);
    (parts.next().is_none() && start <= end && end <= 1u128 << 64).then_some((field, start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_reference_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn shards_cover_the_keyspace_once() {
        for count in [1, 2, 3, 12, 256] {
            let shards = ShardingConfig { shards: count }.all();
            assert_eq!(shards[0].range().0, 0);
            assert_eq!(shards.last().unwrap().range().1, 1u128 << 64);
            for w in shards.windows(2) {
                assert_eq!(w[0].range().1, w[1].range().0);
            }
            for ns in ["", "default", "kube-system", "team-a"] {
                assert_eq!(
                    shards.iter().filter(|s| s.holds_namespace(ns)).count(),
                    1,
                    "{ns} in {count}"
                );
            }
        }
    }

    #[test]
    fn selectors_round_trip_and_name_the_namespace() {
        let s = Shard { index: 0, count: 2 };
        assert_eq!(
            s.selector(),
            "shardRange(object.metadata.namespace, '0x0000000000000000', '0x8000000000000000')"
        );
        for shard in (ShardingConfig { shards: 12 }).all() {
            let (field, start, end) = parse_selector(&shard.selector()).unwrap();
            assert_eq!(field, "namespace");
            assert_eq!((start, end), shard.range());
        }
        assert!(parse_selector("shardRange(object.metadata.uid, '0x1')").is_none());
        assert!(parse_selector("labels").is_none());
    }

    #[test]
    fn keys_go_by_their_namespace() {
        let shards = ShardingConfig { shards: 4 }.all();
        let of = |key: &str| shards.iter().position(|s| s.holds_key(key)).unwrap();
        assert_eq!(of("team-a/x"), of("team-a/y"));
        assert_eq!(of("node-1"), of("node-2"), "cluster-scoped: one shard");
        assert!(Shard::WHOLE.holds_key("anything/at-all"));
    }
}
