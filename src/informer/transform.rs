//! The rewrite every object gets before it is queued and cached (client-go's
//! `TransformFunc`): `apiVersion`/`kind` restored (list items of built-in types omit them),
//! `metadata.managedFields` stripped, Secrets redacted. Doing it before the cache means
//! redacted data never sits in memory and stripped fields cost nothing.
//!
//! One meaning, two forms:
//! - [`Transform::cache`] goes straight from the JSON the API server sent (a list item, a
//!   watch event's object) to the cached form. It parses only what it may change: the object's top level, `metadata`, and
//!   for a Secret `data`, `stringData` and `annotations`. Every other value is copied as the
//!   server wrote it, so there is no `serde_json::Value` tree and nothing is serialized again.
//!   Input that is not compact (a server asked for `pretty`) or is odd (no `metadata`, or one
//!   that is not an object; a non-string type; an identifying field escaped, not a string or
//!   given twice) takes the parsed form below, which decides as before and names what is wrong.
//! - [`Transform::apply`] rewrites a parsed [`DynamicObject`].
//!
//! The two agree on the values of every object the parsed form reads, which tests check
//! (random objects included); the order of members may differ (the server's, or
//! `DynamicObject`'s), and `metadata` members `ObjectMeta` does not know are kept. The bytes
//! form does not check what it copies beyond its being JSON: a list item the parsed form
//! refuses for a value no API server writes (a label that is not a string, a number beyond
//! `f64`) is cached as sent rather than failing its whole list or its watch event.

use std::borrow::Cow;

use kube::api::{DynamicObject, TypeMeta};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::CachedObject;

/// Value that replaces each redacted Secret value.
pub const REDACTED: &str = "<redacted>";

/// The annotation that holds a Secret's data in clear; dropped with redaction.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// See the module docs. The default changes nothing.
#[derive(Debug, Clone, Default)]
pub struct Transform {
    types: Option<TypeMeta>,
    strip_managed_fields: bool,
    redact: bool,
}

impl Transform {
    /// Restores `types` where an object lacks them; strips `managedFields` if asked; redacts
    /// `data`, `stringData` and the last-applied annotation if `redact` (for Secrets).
    pub fn new(types: TypeMeta, strip_managed_fields: bool, redact: bool) -> Self {
        Self {
            types: Some(types),
            strip_managed_fields,
            redact,
        }
    }

    /// Rewrites a parsed object.
    pub fn apply(&self, obj: &mut DynamicObject) {
        if self.types.is_some() && obj.types.as_ref().is_none_or(|t| t.kind.is_empty()) {
            obj.types = self.types.clone();
        }
        if self.strip_managed_fields {
            obj.metadata.managed_fields = None;
        }
        if self.redact {
            redact_secret(obj);
        }
    }

    /// The cached form of an object the server sent as `json` (see the module docs). Fails,
    /// with serde's words, where the object cannot be read as a Kubernetes object.
    pub fn cache(&self, json: &str) -> Result<CachedObject, serde_json::Error> {
        let cached = is_compact(json.as_bytes())
            .then(|| self.write(json))
            .flatten()
            .and_then(|out| serde_json::value::to_raw_value(&out).ok())
            .and_then(CachedObject::from_json);
        if let Some(cached) = cached {
            return Ok(cached);
        }
        let mut obj: DynamicObject = serde_json::from_str(json)?;
        self.apply(&mut obj);
        Ok(CachedObject::new(&obj))
    }

    /// The transformed copy of compact `json`, or `None` where the parsed form must decide.
    fn write<'a>(&'a self, json: &'a str) -> Option<Object<'a>> {
        let top: Members = serde_json::from_str(json).ok()?;
        // A member given twice: the parsed form decides (its types and `ObjectMeta` do not
        // take the first one, as `get` would).
        if top.has_duplicates() {
            return None;
        }
        let string = |name: &str| {
            top.get(name)
                .map(|v| serde_json::from_str::<Cow<'_, str>>(v.get()).ok())
        };
        let restore = match (string("apiVersion"), string("kind")) {
            // A non-string value: the parsed form decides.
            (Some(None), _) | (_, Some(None)) => return None,
            (Some(Some(_)), Some(Some(kind))) => kind.is_empty(),
            // Incomplete types without types to restore: the parsed form drops them.
            _ if self.types.is_none() => return None,
            _ => true,
        } && self.types.is_some();
        // Without `metadata`, the parsed form writes an empty one.
        top.get("metadata")?;
        let mut out = Vec::with_capacity(top.0.len() + 2);
        if let Some(types) = self.types.as_ref().filter(|_| restore) {
            out.push((Cow::Borrowed("apiVersion"), Piece::Str(&types.api_version)));
            out.push((Cow::Borrowed("kind"), Piece::Str(&types.kind)));
        }
        for (key, value) in top.0 {
            let piece = match key.as_ref() {
                "apiVersion" | "kind" if restore => continue,
                // Not an object: the parsed form refuses it.
                "metadata" if !value.get().starts_with('{') => return None,
                "metadata" if self.strip_managed_fields || self.redact => self.metadata(value)?,
                "data" | "stringData" if self.redact && value.get().starts_with('{') => {
                    redacted(value)?
                }
                _ => Piece::Raw(value),
            };
            out.push((key, piece));
        }
        Some(Object(out))
    }

    fn metadata<'a>(&self, metadata: &'a RawValue) -> Option<Piece<'a>> {
        let members: Members = serde_json::from_str(metadata.get()).ok()?;
        if members.has_duplicates() {
            return None;
        }
        let mut out = Vec::with_capacity(members.0.len());
        for (key, value) in members.0 {
            // `ObjectMeta` drops nulls.
            if self.strip_managed_fields && key == "managedFields" || value.get() == "null" {
                continue;
            }
            let piece = if self.redact && key == "annotations" && value.get().starts_with('{') {
                let annotations: Members = serde_json::from_str(value.get()).ok()?;
                let kept = annotations.0.into_iter().filter(|(k, _)| k != LAST_APPLIED);
                Piece::Object(Object(kept.map(|(k, v)| (k, Piece::Raw(v))).collect()))
            } else {
                Piece::Raw(value)
            };
            out.push((key, piece));
        }
        Some(Piece::Object(Object(out)))
    }
}

/// An object to write: members in order, each copied or rewritten. `serde_json` writes it
/// (compact, keys escaped, copied values verbatim) without parsing the result again.
struct Object<'a>(Vec<(Cow<'a, str>, Piece<'a>)>);

enum Piece<'a> {
    Raw(&'a RawValue),
    Str(&'a str),
    Object(Object<'a>),
}

impl serde::Serialize for Object<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key.as_ref(), value)?;
        }
        map.end()
    }
}

impl serde::Serialize for Piece<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Piece::Raw(raw) => raw.serialize(s),
            Piece::Str(text) => s.serialize_str(text),
            Piece::Object(object) => object.serialize(s),
        }
    }
}

/// Replaces every value of `data` and `stringData` with [`REDACTED`] (keys stay, so consumers
/// see which entries exist), and drops the last-applied-configuration annotation, which holds
/// the same data in clear.
pub fn redact_secret(obj: &mut DynamicObject) {
    for field in ["data", "stringData"] {
        if let Some(map) = obj.data.get_mut(field).and_then(|v| v.as_object_mut()) {
            for value in map.values_mut() {
                *value = serde_json::Value::String(REDACTED.to_owned());
            }
        }
    }
    if let Some(annotations) = obj.metadata.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

/// `{"k":"<redacted>",…}` for the members of the object `values`.
fn redacted(values: &RawValue) -> Option<Piece<'_>> {
    let members: Members = serde_json::from_str(values.get()).ok()?;
    let out = members
        .0
        .into_iter()
        .map(|(key, _)| (key, Piece::Str(REDACTED)));
    Some(Piece::Object(Object(out.collect())))
}

/// Whether `json` has no whitespace outside its strings (what the API server writes).
fn is_compact(json: &[u8]) -> bool {
    let mut i = 0;
    while i < json.len() {
        match json[i] {
            b'"' => {
                i += 1;
                loop {
                    match memchr::memchr2(b'"', b'\\', &json[i..]) {
                        Some(j) if json[i + j] == b'\\' => {
                            i += j + 2;
                            if i >= json.len() {
                                return false;
                            }
                        }
                        Some(j) => {
                            i += j + 1;
                            break;
                        }
                        None => return false,
                    }
                }
            }
            b' ' | b'\n' | b'\r' | b'\t' => return false,
            _ => i += 1,
        }
    }
    true
}

/// A JSON object's members in the order written, keys unescaped, values unparsed.
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl Members<'_> {
    fn get(&self, key: &str) -> Option<&RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// Whether a key is given twice (no API server writes one; objects have few members).
    fn has_duplicates(&self) -> bool {
        let keys = &self.0;
        (1..keys.len()).any(|i| keys[..i].iter().any(|(k, _)| *k == keys[i].0))
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(Key(key)) = map.next_key()? {
                    members.push((key, map.next_value()?));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

/// A key, borrowed unless it has escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::testing::transform;

    fn configmaps() -> Transform {
        transform("ConfigMap", false)
    }

    fn secrets() -> Transform {
        transform("Secret", true)
    }

    /// What the parsed form caches for `json`.
    fn parsed(t: &Transform, json: &str) -> serde_json::Result<CachedObject> {
        let mut obj: DynamicObject = serde_json::from_str(json)?;
        t.apply(&mut obj);
        Ok(CachedObject::new(&obj))
    }

    fn value(cached: &CachedObject) -> serde_json::Value {
        serde_json::from_str(cached.json().get()).unwrap()
    }

    const OBJECTS: [&str; 13] = [
        // A list item of a built-in type: no types; managedFields; escapes in keys and values.
        r#"{"metadata":{"name":"a","namespace":"ns","uid":"u","resourceVersion":"7","managedFields":[{"manager":"x","fieldsV1":{"f:data":{}}}],"labels":{"k\"q":"v\\"}},"data":{"é\n":"v \" \u00e9","x":"a b"}}"#,
        // A Secret as a watch sends it: types present, data in clear in three places.
        r#"{"kind":"Secret","apiVersion":"v1","metadata":{"name":"s","namespace":"ns","annotations":{"kubectl.kubernetes.io/last-applied-configuration":"{\"data\":{\"p\":\"aHVudGVy\"}}","keep":"me"},"managedFields":[]},"data":{"p":"aHVudGVy"},"stringData":{"t":"t0p"},"type":"Opaque"}"#,
        // An empty kind, a null data, the name escaped.
        r#"{"apiVersion":"v1","kind":"","metadata":{"name":"a\u0062","resourceVersion":"1"},"data":null}"#,
        // apiVersion without kind; nulls in metadata.
        r#"{"apiVersion":"v9","metadata":{"name":"n","labels":null,"managedFields":null},"data":{"a":[1,2.5,{"b":null}]}}"#,
        // Not compact: the parsed form decides.
        "{\n  \"metadata\": {\"name\": \"p\", \"managedFields\": [{}]},\n  \"data\": {\"k\": \"v v\"}\n}",
        // Secret data that is not an object stays as it is.
        r#"{"metadata":{"name":"s"},"data":"opaque","stringData":[1]}"#,
        // Refused by both.
        r#"{"metadata":null}"#,
        r#"[1,2]"#,
        // Decided by the parsed form: a type that is not a string (restored), no metadata,
        // an identifying field twice.
        r#"{"kind":5,"metadata":{"name":"k"}}"#,
        r#"{"data":{}}"#,
        r#"{"metadata":{"name":"a","name":"b"}}"#,
        r#"{"metadata":{"name":"b","name":null,"labels":{"a":"b"},"labels":null}}"#,
        r#"{"apiVersion":"v1","kind":"A","kind":"B","metadata":{"name":"k"}}"#,
    ];

    #[test]
    fn the_bytes_path_caches_what_the_parsed_path_does() {
        for t in [configmaps(), secrets(), Transform::default()] {
            for json in OBJECTS {
                match (t.cache(json), parsed(&t, json)) {
                    (Ok(bytes), Ok(tree)) => {
                        assert_eq!(value(&bytes), value(&tree), "{json}");
                        for f in [
                            CachedObject::name,
                            CachedObject::namespace,
                            CachedObject::uid,
                            CachedObject::resource_version,
                        ] {
                            assert_eq!(f(&bytes), f(&tree), "{json}");
                        }
                        assert!(is_compact(bytes.json().get().as_bytes()), "{json}");
                    }
                    (Err(_), Err(_)) => {}
                    (bytes, tree) => panic!("{json}: {bytes:?} vs {tree:?}"),
                }
            }
        }
    }

    #[test]
    fn the_bytes_path_copies_what_it_does_not_change() {
        let json = OBJECTS[0];
        let cached = configmaps().cache(json).unwrap();
        assert_eq!(
            cached.json().get(),
            r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a","namespace":"ns","uid":"u","resourceVersion":"7","labels":{"k\"q":"v\\"}},"data":{"é\n":"v \" \u00e9","x":"a b"}}"#
        );
        let secret = secrets().cache(OBJECTS[1]).unwrap();
        assert_eq!(
            secret.json().get(),
            r#"{"kind":"Secret","apiVersion":"v1","metadata":{"name":"s","namespace":"ns","annotations":{"keep":"me"}},"data":{"p":"<redacted>"},"stringData":{"t":"<redacted>"},"type":"Opaque"}"#
        );
    }

    #[test]
    fn compact_means_no_whitespace_outside_strings() {
        for (json, compact) in [
            (r#"{"a":"b c","d":[1,2]}"#, true),
            (r#"{"a":"\" \\","b":1}"#, true),
            (r#"{"a": 1}"#, false),
            ("{\"a\":1}\n", false),
            (r#"{"a":"unterminated}"#, false),
            (r#"{"a":"\"#, false),
        ] {
            assert_eq!(is_compact(json.as_bytes()), compact, "{json}");
        }
    }
}
