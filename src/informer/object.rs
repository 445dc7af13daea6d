//! What the cache holds of an object: its compact JSON after the transform (managedFields
//! stripped, Secrets redacted, every other member as the server wrote it), and the few parsed
//! fields that keys, indices, ids, stubs and selectors need. Messages splice the JSON into their envelope instead of serializing a
//! `serde_json::Value` tree per message, and a cached object costs about its JSON size instead
//! of the several times more a `Value` tree takes. Whatever needs the whole object parses the
//! JSON on demand ([`CachedObject::to_dynamic`]).

use kube::api::DynamicObject;
use serde_json::value::RawValue;

/// Where `metadata.name`, `namespace`, `uid` and `resourceVersion` sit in the JSON: byte
/// ranges into it (no copies), or, for a value the JSON escapes (which no valid name, uid or
/// resourceVersion needs), owned copies.
#[derive(Debug)]
enum Fields {
    Spans([(u32, u32); 4]),
    Owned(Box<[Option<Box<str>>; 4]>),
}

const NAME: usize = 0;
const NAMESPACE: usize = 1;
const UID: usize = 2;
const RESOURCE_VERSION: usize = 3;
const ABSENT: (u32, u32) = (u32::MAX, 0);

#[derive(serde::Deserialize)]
struct Borrowed<'a> {
    #[serde(borrow)]
    metadata: BorrowedMeta<'a>,
}

#[derive(serde::Deserialize)]
struct BorrowedMeta<'a> {
    #[serde(borrow, default)]
    name: Option<&'a str>,
    #[serde(borrow, default)]
    namespace: Option<&'a str>,
    #[serde(borrow, default)]
    uid: Option<&'a str>,
    #[serde(borrow, default, rename = "resourceVersion")]
    resource_version: Option<&'a str>,
}

/// Where the identifying fields sit in `text`; `None` where one cannot be borrowed (escaped,
/// not a string, given twice) or `metadata` is not an object.
fn spans(text: &str) -> Option<Fields> {
    let m = serde_json::from_str::<Borrowed<'_>>(text).ok()?.metadata;
    let span = |v: Option<&str>| {
        v.map_or(ABSENT, |v| {
            let start = v.as_ptr() as usize - text.as_ptr() as usize;
            (start as u32, v.len() as u32)
        })
    };
    Some(Fields::Spans([
        span(m.name),
        span(m.namespace),
        span(m.uid),
        span(m.resource_version),
    ]))
}

/// See the module docs.
#[derive(Debug)]
pub struct CachedObject {
    json: Box<RawValue>,
    fields: Fields,
}

impl CachedObject {
    /// Serializes `obj` once, and notes where the identifying fields are.
    pub fn new(obj: &DynamicObject) -> Self {
        let json = serde_json::value::to_raw_value(obj).unwrap_or_else(|_| {
            // Only a body that is not a JSON object (which `flatten` cannot write) fails; no
            // API server sends one. Keep the identity rather than fail.
            let bare = DynamicObject {
                types: obj.types.clone(),
                metadata: obj.metadata.clone(),
                data: serde_json::json!({}),
            };
            serde_json::value::to_raw_value(&bare).expect("metadata serializes to JSON")
        });
        let fields = spans(json.get()).unwrap_or_else(|| {
            // A value the JSON escapes.
            let m = &obj.metadata;
            let owned = |s: &Option<String>| s.as_deref().map(Box::from);
            Fields::Owned(Box::new([
                owned(&m.name),
                owned(&m.namespace),
                owned(&m.uid),
                owned(&m.resource_version),
            ]))
        });
        Self { json, fields }
    }

    /// Keeps `json` (an object's compact JSON, as the server wrote it) as it is, if its
    /// identifying fields are strings without escapes, each once; `None` otherwise (the parsed
    /// path decides those: see [`Transform::cache`](super::Transform::cache)).
    pub fn from_json(json: Box<RawValue>) -> Option<Self> {
        let fields = spans(json.get())?;
        Some(Self { json, fields })
    }

    fn field(&self, i: usize) -> Option<&str> {
        match &self.fields {
            Fields::Spans(spans) => {
                let (start, len) = spans[i];
                (start != u32::MAX)
                    .then(|| &self.json.get()[start as usize..(start + len) as usize])
            }
            Fields::Owned(values) => values[i].as_deref(),
        }
    }

    /// `metadata.name`.
    pub fn name(&self) -> Option<&str> {
        self.field(NAME)
    }

    /// `metadata.namespace`.
    pub fn namespace(&self) -> Option<&str> {
        self.field(NAMESPACE)
    }

    /// `metadata.uid`.
    pub fn uid(&self) -> Option<&str> {
        self.field(UID)
    }

    /// `metadata.resourceVersion`.
    pub fn resource_version(&self) -> Option<&str> {
        self.field(RESOURCE_VERSION)
    }

    /// The object's compact JSON.
    pub fn json(&self) -> &RawValue {
        &self.json
    }

    /// The whole object, parsed from its JSON. Fails where the JSON (as the server sent it)
    /// is not a Kubernetes object, e.g. `metadata` of the wrong shape.
    pub fn to_dynamic(&self) -> serde_json::Result<DynamicObject> {
        serde_json::from_str(self.json.get())
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
        CachedObject::name(self)
    }
    fn namespace(&self) -> Option<&str> {
        CachedObject::namespace(self)
    }
    fn resource_version(&self) -> Option<&str> {
        CachedObject::resource_version(self)
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

/// `old` and `new` reduced to the top-level fields whose JSON differs, parsed (for
/// `ignore_fields`): an update usually changes one or two (`metadata`, `status`), and the rest
/// need not be parsed to be compared. Equal text means equal values. Different text may still be equal
/// values (an object that took the parsed path is written by serde, not as the server wrote
/// it), which are then compared parsed.
pub fn differing_fields(
    old: &CachedObject,
    new: &CachedObject,
) -> Option<(serde_json::Value, serde_json::Value)> {
    use serde_json::value::RawValue;
    type Fields<'a> = std::collections::BTreeMap<&'a str, &'a RawValue>;
    let (old, new) = (old.json().get(), new.json().get());
    let (Ok(a), Ok(b)) = (
        serde_json::from_str::<Fields>(old),
        serde_json::from_str::<Fields>(new),
    ) else {
        // Escaped keys cannot be borrowed: parse everything.
        return Some((
            serde_json::from_str(old).ok()?,
            serde_json::from_str(new).ok()?,
        ));
    };
    let parse = |raw: &RawValue| serde_json::from_str::<serde_json::Value>(raw.get());
    let (mut x, mut y) = (serde_json::Map::new(), serde_json::Map::new());
    for (k, va) in &a {
        match b.get(k) {
            Some(vb) if vb.get() == va.get() => {}
            Some(vb) => {
                x.insert((*k).to_owned(), parse(va).ok()?);
                y.insert((*k).to_owned(), parse(vb).ok()?);
            }
            None => {
                x.insert((*k).to_owned(), parse(va).ok()?);
            }
        }
    }
    for (k, vb) in &b {
        if !a.contains_key(k) {
            y.insert((*k).to_owned(), parse(vb).ok()?);
        }
    }
    Some((serde_json::Value::Object(x), serde_json::Value::Object(y)))
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
        assert_eq!(
            (
                cached.name(),
                cached.namespace(),
                cached.uid(),
                cached.resource_version()
            ),
            (Some("a"), Some("ns"), Some("u"), Some("7"))
        );
        let mut escaped = obj.clone();
        escaped.metadata.name = Some("a\"b".into());
        escaped.metadata.namespace = None;
        let cached = CachedObject::new(&escaped);
        assert_eq!((cached.name(), cached.namespace()), (Some("a\"b"), None));
        let back = cached.to_dynamic().unwrap();
        assert_eq!(
            serde_json::to_value(&back).unwrap(),
            serde_json::to_value(&escaped).unwrap()
        );
        assert!(!cached.json().get().contains('\n'), "compact");
    }
}
