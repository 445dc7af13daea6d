//! client-go's `Indexer` (`ThreadSafeStore`): the informer's cache, keyed `namespace/name`, with
//! named secondary indices.
//!
//! # Contract
//! - `add`/`update` are upserts; `delete` of a missing key is no error.
//! - Every write updates every index under the write lock; a key leaves the sets of its old
//!   values and joins those of its new values; empty sets are removed.
//! - Objects are `Arc`s: readers share them, nobody mutates them.
//! - The `namespace` index is always present (`""` for cluster-scoped objects).
//! - Unlike client-go, an index function cannot fail, so nothing here panics.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, RwLock},
};

use super::{CachedObject, ObjectRef};
use crate::FastHash;

/// Errors of index queries.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// The index name was never registered.
    #[error("index {0:?} does not exist")]
    UnknownIndex(String),
    /// `add_indexers` was given a name that is already registered.
    #[error("index {0:?} already exists")]
    IndexExists(String),
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Computes the index values of an object (zero, one or many).
pub type IndexFunc = Arc<dyn Fn(&CachedObject) -> Vec<String> + Send + Sync>;

/// Name of the built-in namespace index (client-go's `NamespaceIndex`).
pub const NAMESPACE_INDEX: &str = "namespace";

/// client-go's `MetaNamespaceIndexFunc`.
pub fn namespace_index_func(obj: &CachedObject) -> Vec<String> {
    vec![obj.namespace().unwrap_or_default().to_owned()]
}

/// Thread-safe cache with named indices. See the module docs for the contract.
pub struct Indexer {
    inner: RwLock<Inner>,
}

#[derive(Default)]
struct Inner {
    items: HashMap<String, ObjectRef, FastHash>,
    indexers: HashMap<String, IndexFunc>,
    // index name → index value → keys
    indices: HashMap<String, HashMap<String, HashSet<String, FastHash>, FastHash>>,
}

impl Default for Indexer {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Indexer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Indexer").field("len", &self.len()).finish()
    }
}

impl Indexer {
    /// An empty cache with the namespace index.
    pub fn new() -> Self {
        let indexer = Self {
            inner: RwLock::new(Inner::default()),
        };
        indexer
            .add_indexer(NAMESPACE_INDEX, Arc::new(namespace_index_func))
            .expect("fresh indexer has no indices");
        indexer
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        // A panic while holding the lock cannot leave `Inner` half-written (every write
        // computes first, then assigns), so a poisoned lock is still consistent.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers an index; existing items are indexed at once.
    pub fn add_indexer(&self, name: &str, func: IndexFunc) -> Result<()> {
        let mut inner = self.write();
        if inner.indexers.contains_key(name) {
            return Err(Error::IndexExists(name.to_owned()));
        }
        let mut index: HashMap<String, HashSet<String, FastHash>, FastHash> = HashMap::default();
        for (key, obj) in &inner.items {
            for value in func(obj) {
                index.entry(value).or_default().insert(key.clone());
            }
        }
        inner.indices.insert(name.to_owned(), index);
        inner.indexers.insert(name.to_owned(), func);
        Ok(())
    }

    /// Inserts or replaces `key`; returns the previous object.
    pub fn upsert(&self, key: &str, obj: ObjectRef) -> Option<ObjectRef> {
        let mut inner = self.write();
        // An update (the common case) keeps the stored key: no allocation.
        let old = match inner.items.get_mut(key) {
            Some(slot) => Some(std::mem::replace(slot, obj.clone())),
            None => inner.items.insert(key.to_owned(), obj.clone()),
        };
        inner.update_indices(old.as_deref(), Some(&obj), key);
        old
    }

    /// Removes `key`; returns the removed object.
    pub fn delete(&self, key: &str) -> Option<ObjectRef> {
        let mut inner = self.write();
        let old = inner.items.remove(key)?;
        inner.update_indices(Some(&old), None, key);
        Some(old)
    }

    /// Swaps in a whole new content and rebuilds every index.
    pub fn replace(&self, items: impl IntoIterator<Item = (String, ObjectRef)>) {
        let mut inner = self.write();
        inner.items = items.into_iter().collect();
        let Inner {
            items,
            indexers,
            indices,
        } = &mut *inner;
        for (name, func) in indexers.iter() {
            let mut index: HashMap<String, HashSet<String, FastHash>, FastHash> =
                HashMap::default();
            for (key, obj) in items.iter() {
                for value in func(obj) {
                    index.entry(value).or_default().insert(key.clone());
                }
            }
            indices.insert(name.clone(), index);
        }
    }

    /// The object at `key`.
    pub fn get(&self, key: &str) -> Option<ObjectRef> {
        self.read().items.get(key).cloned()
    }

    /// Whether `key` is cached.
    pub fn contains(&self, key: &str) -> bool {
        self.read().items.contains_key(key)
    }

    /// Every cached object, in no particular order.
    pub fn list(&self) -> Vec<ObjectRef> {
        self.read().items.values().cloned().collect()
    }

    /// Every cached key with its object, in no particular order.
    pub fn entries(&self) -> Vec<(String, ObjectRef)> {
        self.read()
            .items
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Every cached key, in no particular order.
    pub fn list_keys(&self) -> Vec<String> {
        self.read().items.keys().cloned().collect()
    }

    /// Number of cached objects.
    pub fn len(&self) -> usize {
        self.read().items.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The objects with `value` in index `name`.
    pub fn by_index(&self, name: &str, value: &str) -> Result<Vec<ObjectRef>> {
        let inner = self.read();
        let index = inner
            .indices
            .get(name)
            .ok_or_else(|| Error::UnknownIndex(name.to_owned()))?;
        Ok(index
            .get(value)
            .map(|keys| {
                keys.iter()
                    .filter_map(|k| inner.items.get(k).cloned())
                    .collect()
            })
            .unwrap_or_default())
    }

    /// The keys with `value` in index `name`, sorted.
    pub fn index_keys(&self, name: &str, value: &str) -> Result<Vec<String>> {
        let inner = self.read();
        let index = inner
            .indices
            .get(name)
            .ok_or_else(|| Error::UnknownIndex(name.to_owned()))?;
        let mut keys: Vec<String> = index
            .get(value)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        Ok(keys)
    }

    /// The objects sharing any of `obj`'s values in index `name`, without duplicates.
    pub fn index(&self, name: &str, obj: &CachedObject) -> Result<Vec<ObjectRef>> {
        let inner = self.read();
        let func = inner
            .indexers
            .get(name)
            .ok_or_else(|| Error::UnknownIndex(name.to_owned()))?;
        let index = &inner.indices[name];
        let keys: HashSet<&String> = func(obj)
            .iter()
            .filter_map(|v| index.get(v))
            .flatten()
            .collect();
        Ok(keys
            .into_iter()
            .filter_map(|k| inner.items.get(k).cloned())
            .collect())
    }

    /// The values currently present in index `name`.
    pub fn list_index_func_values(&self, name: &str) -> Result<Vec<String>> {
        let inner = self.read();
        let index = inner
            .indices
            .get(name)
            .ok_or_else(|| Error::UnknownIndex(name.to_owned()))?;
        Ok(index.keys().cloned().collect())
    }
}

impl Inner {
    fn update_indices(
        &mut self,
        old: Option<&CachedObject>,
        new: Option<&CachedObject>,
        key: &str,
    ) {
        for (name, func) in &self.indexers {
            let old_values = old.map(|o| func(o)).unwrap_or_default();
            let new_values = new.map(|o| func(o)).unwrap_or_default();
            // The common case: one value, unchanged.
            if old_values.len() == 1 && new_values.len() == 1 && old_values[0] == new_values[0] {
                continue;
            }
            let index = self
                .indices
                .get_mut(name)
                .expect("every indexer has an index");
            for value in &old_values {
                if let Some(set) = index.get_mut(value) {
                    set.remove(key);
                    if set.is_empty() {
                        index.remove(value);
                    }
                }
            }
            for value in new_values {
                index.entry(value).or_default().insert(key.to_owned());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::testing::obj;

    // Labels are not kept parsed: an index on them parses the object (on demand).
    fn labels_index(o: &CachedObject) -> Vec<String> {
        o.to_dynamic()
            .unwrap()
            .metadata
            .labels
            .iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v}"))
            .collect()
    }

    fn with_labels(ns: &str, name: &str, labels: &[(&str, &str)]) -> ObjectRef {
        let mut o = obj(ns, name, "1").to_dynamic().unwrap();
        o.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        Arc::new(crate::informer::CachedObject::new(&o))
    }

    #[test]
    fn upsert_get_delete() {
        let idx = Indexer::new();
        assert!(idx.upsert("a/x", obj("a", "x", "1")).is_none());
        let old = idx.upsert("a/x", obj("a", "x", "2")).unwrap();
        assert_eq!(old.resource_version(), Some("1"));
        assert_eq!(idx.get("a/x").unwrap().resource_version(), Some("2"));
        assert!(idx.delete("a/x").is_some());
        assert!(
            idx.delete("a/x").is_none(),
            "deleting a missing key is no error"
        );
        assert!(idx.is_empty());
    }

    #[test]
    fn namespace_index_tracks_moves_and_removes_empty_sets() {
        let idx = Indexer::new();
        idx.upsert("a/x", obj("a", "x", "1"));
        idx.upsert("a/y", obj("a", "y", "1"));
        idx.upsert("b/z", obj("b", "z", "1"));
        idx.upsert("n", obj("", "n", "1"));
        assert_eq!(
            idx.index_keys(NAMESPACE_INDEX, "a").unwrap(),
            ["a/x", "a/y"]
        );
        assert_eq!(idx.index_keys(NAMESPACE_INDEX, "").unwrap(), ["n"]);
        idx.delete("b/z");
        let mut values = idx.list_index_func_values(NAMESPACE_INDEX).unwrap();
        values.sort();
        assert_eq!(values, ["", "a"], "the empty set of b is removed");
        idx.delete("a/x");
        assert_eq!(
            idx.by_index(NAMESPACE_INDEX, "a").unwrap().len(),
            1,
            "a keeps its non-empty set"
        );
    }

    #[test]
    fn multi_value_index_functions() {
        let idx = Indexer::new();
        idx.add_indexer("labels", Arc::new(labels_index)).unwrap();
        idx.upsert(
            "a/x",
            with_labels("a", "x", &[("app", "web"), ("tier", "front")]),
        );
        idx.upsert("a/y", with_labels("a", "y", &[("app", "web")]));
        assert_eq!(idx.index_keys("labels", "app=web").unwrap(), ["a/x", "a/y"]);
        assert_eq!(idx.index_keys("labels", "tier=front").unwrap(), ["a/x"]);
        // x shares app=web with y and tier=front with itself: two distinct objects.
        assert_eq!(
            idx.index(
                "labels",
                &with_labels("a", "q", &[("app", "web"), ("tier", "front")])
            )
            .unwrap()
            .len(),
            2
        );
        idx.upsert("a/x", with_labels("a", "x", &[("app", "db")]));
        assert_eq!(
            idx.index_keys("labels", "tier=front").unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(idx.index_keys("labels", "app=web").unwrap(), ["a/y"]);
    }

    #[test]
    fn indexers_added_late_index_existing_items_and_names_are_unique() {
        let idx = Indexer::new();
        idx.upsert("a/x", with_labels("a", "x", &[("app", "web")]));
        idx.add_indexer("labels", Arc::new(labels_index)).unwrap();
        assert_eq!(idx.index_keys("labels", "app=web").unwrap(), ["a/x"]);
        assert_eq!(
            idx.add_indexer("labels", Arc::new(labels_index)),
            Err(Error::IndexExists("labels".into()))
        );
        assert_eq!(
            idx.by_index("nope", "x").unwrap_err(),
            Error::UnknownIndex("nope".into())
        );
    }

    #[test]
    fn replace_rebuilds_indices() {
        let idx = Indexer::new();
        idx.upsert("a/x", obj("a", "x", "1"));
        idx.replace([("b/y".to_string(), obj("b", "y", "2"))]);
        assert!(idx.get("a/x").is_none());
        assert!(idx.index_keys(NAMESPACE_INDEX, "a").unwrap().is_empty());
        assert_eq!(idx.index_keys(NAMESPACE_INDEX, "b").unwrap(), ["b/y"]);
    }
}
