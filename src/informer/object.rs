//! What the cache holds of an object: its compact JSON after the transform (managedFields
//! stripped, Secrets redacted), and the few parsed fields that keys, indices, ids, stubs and
//! selectors need. Messages splice the JSON into their envelope instead of serializing a
//! `serde_json::Value` tree per message, and a cached object costs about its JSON size instead
//! of the several times more a `Value` tree takes. Whatever needs the whole object parses the
//! JSON on demand ([`CachedObject::to_dynamic`]).

use std::collections::BTreeMap;

use kube::api::{DynamicObject, TypeMeta};
use serde_json::value::RawValue;

/// The metadata fields the informer machinery reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    /// `metadata.name`.
    pub name: Option<String>,
    /// `metadata.namespace`.
    pub namespace: Option<String>,
    /// `metadata.uid`.
    pub uid: Option<String>,
    /// `metadata.resourceVersion`.
    pub resource_version: Option<String>,
    /// `metadata.labels`.
    pub labels: Option<BTreeMap<String, String>>,
}

/// See the module docs.
#[derive(Debug)]
pub struct CachedObject {
    /// `apiVersion` and `kind`.
    pub types: Option<TypeMeta>,
    /// See [`Meta`].
    pub metadata: Meta,
    json: Box<RawValue>,
}

impl CachedObject {
    /// Serializes `obj` once, and keeps what the machinery reads.
    pub fn new(obj: &DynamicObject) -> Self {
        let m = &obj.metadata;
        Self {
            types: obj.types.clone(),
            metadata: Meta {
                name: m.name.clone(),
                namespace: m.namespace.clone(),
                uid: m.uid.clone(),
                resource_version: m.resource_version.clone(),
                labels: m.labels.clone().filter(|l| !l.is_empty()),
            },
            json: serde_json::value::to_raw_value(obj).unwrap_or_else(|_| {
                // Only a body that is not a JSON object (which `flatten` cannot write) fails;
                // no API server sends one. Keep the identity rather than fail.
                let bare = DynamicObject {
                    types: obj.types.clone(),
                    metadata: obj.metadata.clone(),
                    data: serde_json::json!({}),
                };
                serde_json::value::to_raw_value(&bare).expect("metadata serializes to JSON")
            }),
        }
    }

    /// The object's compact JSON.
    pub fn json(&self) -> &RawValue {
        &self.json
    }

    /// The whole object, parsed from its JSON.
    pub fn to_dynamic(&self) -> DynamicObject {
        serde_json::from_str(self.json.get()).expect("the cache holds JSON it serialized")
    }
}

impl From<DynamicObject> for CachedObject {
    fn from(obj: DynamicObject) -> Self {
        Self::new(&obj)
    }
}

/// The identifying fields of an object, cached or not.
pub trait ObjectMetaRef {
    /// `metadata.name`.
    fn name(&self) -> Option<&str>;
    /// `metadata.namespace`.
    fn namespace(&self) -> Option<&str>;
    /// `metadata.resourceVersion`.
    fn resource_version(&self) -> Option<&str>;
}

impl ObjectMetaRef for CachedObject {
    fn name(&self) -> Option<&str> {
        self.metadata.name.as_deref()
    }
    fn namespace(&self) -> Option<&str> {
        self.metadata.namespace.as_deref()
    }
    fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }
}

impl<T: ObjectMetaRef + ?Sized> ObjectMetaRef for std::sync::Arc<T> {
    fn name(&self) -> Option<&str> {
        (**self).name()
    }
    fn namespace(&self) -> Option<&str> {
        (**self).namespace()
    }
    fn resource_version(&self) -> Option<&str> {
        (**self).resource_version()
    }
}

impl ObjectMetaRef for DynamicObject {
    fn name(&self) -> Option<&str> {
        self.metadata.name.as_deref()
    }
    fn namespace(&self) -> Option<&str> {
        self.metadata.namespace.as_deref()
    }
    fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_round_trips_and_the_fields_are_kept() {
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                         "labels": {"app": "web"}, "annotations": {"x": "y"}},
            "data": {"k": "v \" é"},
        }))
        .unwrap();
        let cached = CachedObject::new(&obj);
        assert_eq!(cached.metadata.name.as_deref(), Some("a"));
        assert_eq!(cached.metadata.labels.as_ref().unwrap()["app"], "web");
        assert_eq!(cached.types.as_ref().unwrap().kind, "ConfigMap");
        let back = cached.to_dynamic();
        assert_eq!(
            serde_json::to_value(&back).unwrap(),
            serde_json::to_value(&obj).unwrap()
        );
        assert!(!cached.json().get().contains('\n'), "compact");
    }
}
